"""ultralytics' RT-DETR-l, built from its yaml with random weights (no download): msda_core.patch(model) must give
its own PyTorch path's outputs and parameter gradients in float64 (equivalence.py)."""

import torch
from equivalence import check_patched_equals_unpatched
from ultralytics import RTDETR

IMAGE_SIZE = 64  # strides 8, 16, 32: levels of 8x8, 4x4 and 2x2


def test_patched_rtdetr_l_equals_its_pytorch_path(record):
    torch.manual_seed(0)
    model = RTDETR("rtdetr-l.yaml").model  # the nn.Module; RTDETR itself is a trainer/predictor front end
    image = torch.rand(1, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    result = check_patched_equals_unpatched(model, {"x": image})
    assert result.mechanisms == ["global"]
    record("ultralytics rtdetr-l", result)
