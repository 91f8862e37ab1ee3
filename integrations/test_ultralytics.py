"""ultralytics' RT-DETR-l, built from its yaml with random weights (no download): msda_core.patch(model) must give
its own PyTorch path's outputs and parameter gradients in float64 (equivalence.py). The session runs it on 8.4 and
again on 8.3 (rank-6 locations where 8.4 folds them)."""

import torch
import ultralytics
from equivalence import check_patched_equals_unpatched
from ultralytics import RTDETR

IMAGE_SIZE = 160  # strides 8, 16, 32: levels of 20x20, 10x10, 5x5: 525 anchors, for 8.3's top-300 query selection


def test_patched_rtdetr_l_equals_its_pytorch_path(record):
    torch.manual_seed(0)
    model = RTDETR("rtdetr-l.yaml").model  # the nn.Module; RTDETR itself is a trainer/predictor front end
    image = torch.rand(1, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    result = check_patched_equals_unpatched(model, {"x": image})
    assert result.mechanisms == ["global"]
    record(f"ultralytics {ultralytics.__version__} rtdetr-l", result)
