"""roboflow RF-DETR (rfdetr on PyPI), its own LWDETR model built from its Nano config shrunk to one decoder layer
and a 64x64 image, random weights (no download): msda_core.patch(model) must give its own PyTorch path's outputs
and parameter gradients in float64 (equivalence.py), on the eager path (rank-6 locations) and on the export path
(rank-5 locations). Its core takes ``value`` laid out (B, M, D, S), and the level shapes as Python ints."""

import pytest
import torch
from equivalence import check_patched_equals_unpatched
from rfdetr.config import RFDETRNanoConfig
from rfdetr.models.lwdetr import build_model_from_config

IMAGE_SIZE = 64  # patch size 16: one 4x4 level


def _model():
    torch.manual_seed(0)
    config = RFDETRNanoConfig(resolution=IMAGE_SIZE, positional_encoding_size=IMAGE_SIZE // 16, num_queries=5,
                              num_select=5, dec_layers=1, group_detr=1, pretrain_weights=None, device="cpu")
    return build_model_from_config(config)


def _image():
    return torch.rand(1, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


@pytest.mark.parametrize("path", ["eager", "export"])
def test_patched_rfdetr_equals_its_pytorch_path(path, record):
    model = _model()
    if path == "export":
        model.export()  # forward_export: the core gets rank-5 locations
    inputs = {"samples": _image()} if path == "eager" else {"tensors": _image()}
    result = check_patched_equals_unpatched(model, inputs)
    assert result.mechanisms == ["global"]
    record(f"rfdetr {path}", result)
