"""On a CUDA machine: a training step (forward and backward) of a transformers Deformable DETR of the published
size, patched to msda's Triton backend, against its own PyTorch path, in fp32 and under bf16 autocast. Both are
measured against the unpatched model in float64; prints the errors and the step times. Skips without CUDA."""

import copy
import time

import msda_core
import pytest
import torch
import transformers as T
from equivalence import forward_backward, randomize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BATCH, IMAGE_SIZE = 2, 640  # levels 80x80, 40x40, 20x20, 10x10: S = 8500 encoder queries per image
STEPS = 5  # timed steps, after as many warm-up ones


def _model():
    backbone = T.ResNetConfig(out_features=["stage2", "stage3", "stage4"])  # ResNet-50, random weights
    config = T.DeformableDetrConfig(backbone_config=backbone, use_timm_backbone=False, dropout=0.0)
    torch.manual_seed(0)
    model = T.DeformableDetrModel(config).eval()
    randomize(model)  # samples off the pixel knots (equivalence.py)
    return model


def _relative_error(actual: list, expected: list) -> float:
    """||actual - expected|| / ||expected|| over all the tensors together, in float64."""
    num = sum(((a.double() - e.double()) ** 2).sum() for a, e in zip(actual, expected))
    return (num / sum((e.double() ** 2).sum() for e in expected)).sqrt().item()


def _step(model, inputs, autocast: bool):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        outputs, grads = forward_backward(model, inputs)
    return outputs, [g for g in grads.values() if g is not None]


def _median_ms(model, inputs, autocast: bool) -> float:
    times = []
    for i in range(2 * STEPS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        _step(model, inputs, autocast)
        torch.cuda.synchronize()
        if i >= STEPS:
            times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def test_patched_deformable_detr_training_step_on_the_gpu():
    model = _model().cuda()
    image = torch.randn(BATCH, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0)).cuda()
    reference = copy.deepcopy(model).double()
    expected, expected_grads = _step(reference, {"pixel_values": image.double()}, autocast=False)
    del reference
    rows = []
    for mode, autocast in (("fp32", False), ("bf16 autocast", True)):
        errors = {}
        for path in ("pytorch", "msda triton"):
            if path == "msda triton":
                report = msda_core.patch(model, backend="triton")
            outputs, grads = _step(model, {"pixel_values": image}, autocast)
            errors[path] = (_relative_error(outputs, expected), _relative_error(grads, expected_grads))
            rows.append((mode, path, *errors[path], _median_ms(model, {"pixel_values": image}, autocast)))
            if path == "msda triton":
                assert report.calls > 0
                msda_core.unpatch(model)
        # Both paths round the same layers in the same dtype and msda accumulates in fp32 as grid_sample does, so its
        # error against float64 is of the same size as PyTorch's own; twice allows the two roundings to add.
        for which, name in ((0, "output"), (1, "gradient")):
            assert errors["msda triton"][which] <= 2 * errors["pytorch"][which], (mode, name, errors)
    print(f"\nDeformable DETR (ResNet-50, d_model 256, 6+6 layers), batch {BATCH}, {IMAGE_SIZE}x{IMAGE_SIZE}, "
          f"{torch.cuda.get_device_name()}; errors: ||x - float64 PyTorch|| / ||float64 PyTorch||, step: forward + "
          f"backward, median of {STEPS}")
    print(f"{'mode':<14} {'path':<12} {'output err':>11} {'grad err':>10} {'step ms':>9}")
    for mode, path, out_err, grad_err, ms in rows:
        print(f"{mode:<14} {path:<12} {out_err:>11.3e} {grad_err:>10.3e} {ms:>9.2f}")
