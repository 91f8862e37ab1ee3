"""mmdet 3.3's own DINO and Deformable DETR configs on mmcv-lite (no compiled ops), made small (ResNet-18 with no
pretrained weights, 2 encoder and 2 decoder layers, 64x64 images), random weights off the knots
(equivalence.randomize), one training step (``model.loss`` and backward) in float64 on the CPU: through msda
against mmcv's own PyTorch path, loss and every parameter gradient, every msda call counted.

Two ways in. ``shim``: conftest.py's ``install_extension_shim(mmcv=True)`` made ``mmcv.ops`` importable; mmcv takes
its compiled path (``MultiScaleDeformableAttnFunction`` over ``mmcv._ext``) only for CUDA tensors, so on the CPU
the test sends the module's call to that Function, which is what runs on a GPU. ``patch``: ``msda_core.patch``
replaces the module's ``multi_scale_deformable_attn_pytorch``.
"""

import os

import mmdet
import msda_core
import msda_testkit as kit
import pytest
import torch
from equivalence import OUTPUT, Recording, Result, _gradient_error, randomize, verified_sites
from mmcv.ops import multi_scale_deform_attn
from mmdet.registry import MODELS
from mmdet.structures import DetDataSample
from mmdet.utils import register_all_modules
from mmengine.config import Config
from mmengine.structures import InstanceData

CONFIGS = os.path.join(os.path.dirname(mmdet.__file__), ".mim", "configs")
SIZE = 64


def build(config: str):
    cfg = Config.fromfile(os.path.join(CONFIGS, config)).model
    cfg.backbone.update(depth=18, init_cfg=None, frozen_stages=-1)
    cfg.neck.in_channels = [128, 256, 512]  # ResNet-18's stages 2-4
    cfg.encoder.num_layers = cfg.decoder.num_layers = 2
    cfg.num_queries = 20
    if "dn_cfg" in cfg:
        cfg.dn_cfg.group_cfg.num_dn_queries = 10
    torch.manual_seed(0)  # what randomize() leaves alone (embeddings, level_embed) is drawn from the global generator
    model = MODELS.build(cfg)
    model.init_weights()  # mmdet's own: level_embed is uninitialized memory until then
    model.double().train()
    randomize(model)
    return model


def batch():
    g = torch.Generator().manual_seed(0)
    images = torch.rand(2, 3, SIZE, SIZE, generator=g, dtype=torch.float64) * 2 - 1
    samples = []
    objects = [([[4.0, 6.0, 40.0, 50.0], [20.0, 10.0, 60.0, 30.0]], [1, 5]), ([[8.0, 8.0, 56.0, 44.0]], [3])]
    for boxes, labels in objects:
        sample = DetDataSample(metainfo=dict(img_shape=(SIZE, SIZE), pad_shape=(SIZE, SIZE),
                                             batch_input_shape=(SIZE, SIZE), scale_factor=(1.0, 1.0)))
        sample.gt_instances = InstanceData(bboxes=torch.tensor(boxes, dtype=torch.float64), labels=torch.tensor(labels))
        samples.append(sample)
    return images, samples


def training_step(model):
    """The summed losses and every parameter's gradient; DINO's denoising queries drawn from the same seed."""
    torch.manual_seed(0)
    losses = model.loss(*batch())
    loss = sum(v if isinstance(v, torch.Tensor) else sum(v) for k, v in losses.items() if "loss" in k)
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return loss.detach(), {name: g for name, g in zip(params, grads) if g is not None}


def through_mmcv_function(value, spatial_shapes, sampling_locations, attention_weights):
    """mmcv's compiled-path call, as its module makes it for CUDA tensors."""
    starts = torch.cat([spatial_shapes.new_zeros(1), spatial_shapes.prod(1).cumsum(0)[:-1]])
    return multi_scale_deform_attn.MultiScaleDeformableAttnFunction.apply(
        value, spatial_shapes, starts, sampling_locations, attention_weights, 64)


@pytest.mark.parametrize("route", ["shim", "patch"])
@pytest.mark.parametrize("config", ["dino/dino-4scale_r50_8xb2-12e_coco.py",
                                    "deformable_detr/deformable-detr_r50_16xb2-50e_coco.py"])
def test_training_step_through_msda_equals_mmcvs_pytorch_path(config, route, monkeypatch, request, record):
    register_all_modules()
    torch.set_default_dtype(torch.float64)  # DINO's denoising queries are made with the default dtype
    request.addfinalizer(lambda: torch.set_default_dtype(torch.float32))
    model = build(config)
    attention = [m for m in model.modules() if isinstance(m, multi_scale_deform_attn.MultiScaleDeformableAttention)]
    assert len(attention) == 4  # mmcv's own class: mmdet's isinstance checks keep working
    expected_loss, expected_grads = training_step(model)
    with Recording() as recording, msda_core.use_backend(recording.name):
        if route == "shim":
            monkeypatch.setattr(multi_scale_deform_attn, "multi_scale_deformable_attn_pytorch", through_mmcv_function)
            loss, grads = training_step(model)
            mechanisms, verified = ["shim"], "-"
        else:
            with msda_core.patch(model) as report:
                loss, grads = training_step(model)
            assert report.calls == recording.calls, str(report)
            assert len(report.patched) == 4, str(report)  # one entry per module, with a site per name it calls
            verified = verified_sites(report)
            mechanisms = sorted({p.mechanism.split(":")[0] for p in report.patched})
    assert (recording.calls, recording.backward_calls) == (4, 4)  # 2 encoder + 2 decoder layers, once each
    assert recording.min_knot_distance > 1e-12, recording.min_knot_distance
    loss_error = kit.assert_close("loss", loss, expected_loss, OUTPUT).max_rel_err
    assert grads.keys() == expected_grads.keys()
    gradient_error = _gradient_error(grads, expected_grads)
    record(f"mmdet {config.split('/')[0]} {route}",
           Result(mechanisms, loss_error, gradient_error, recording.calls, recording.min_knot_distance, verified))
