"""The call patterns of codebases that are not on PyPI (the original RT-DETR v1/v2 and D-FINE repositories,
BEVFormer) and RF-DETR's core, each as a minimal attention module of our own with that codebase's signature,
layout and mechanism: msda_core.patch must serve what msda computes exactly (outputs and parameter gradients
equal to the module's own PyTorch path in float64, msda calls counted) and leave the rest alone, reported.

The pattern cores below are written from the op's definition (bilinear, zero outside, align_corners=False), each
taking its codebase's arguments:
- RF-DETR: ``ms_deform_attn_core_pytorch(value, shapes, locations, weights, value_spatial_shapes_hw=None)``, value
  (B, M, D, S), locations rank 6 (eager) or rank 5 (export: levels and points folded), weights (B, Q, M, L*P);
- RT-DETR v1: a per-instance ``ms_deformable_attn_core`` of four arguments, value (B, S, M, D);
- RT-DETRv2: the per-instance core ``functools.partial(..._v2, method=...)``, value (B, S, M, D), locations
  (B, Q, M, sum(P_l), 2); ``method="discrete"`` samples the nearest pixel, which msda does not do;
- D-FINE: the same partial, value a tuple of per-level (B, M, D, H_l*W_l);
- BEVFormer: ``MultiScaleDeformableAttnFunction_fp32.apply`` (an autograd Function on mmcv's compiled op, under
  ``custom_fwd(cast_inputs=torch.float32)``) when ``value.is_cuda``, mmcv's PyTorch function otherwise. The CUDA
  branch is forced by a flag; its compiled op is a stand-in that raises, so it passes only through msda.
"""

from __future__ import annotations

import functools

import msda_core
import msda_testkit as kit
import pytest
import torch
import torch.nn.functional as F
from equivalence import KNOT_DISTANCE, Recording, Result, forward_backward, randomize
from torch import nn

FORWARD, GRADIENT = kit.tolerance(torch.float64, "forward"), kit.tolerance(torch.float64, "gradient")
B, Q, M, D, P = 2, 5, 2, 4, 3  # M != D, so a value in the wrong layout cannot pass the layout check by chance
C = M * D
SHAPES = [(6, 5), (3, 2)]
L, S = len(SHAPES), sum(h * w for h, w in SHAPES)
SHAPES_TENSOR, STARTS = torch.tensor(SHAPES), torch.tensor([0, SHAPES[0][0] * SHAPES[0][1]])


def _bilinear(value, shapes, locations, weights):
    """The op from its definition: value (B, S, M, D), shapes [(H, W)], locations (B, Q, M, L, P, 2) as (x, y) in
    [0, 1], weights (B, Q, M, L, P) -> (B, Q, M*D)."""
    output = 0
    for level, (v, (h, w)) in enumerate(zip(value.split([h * w for h, w in shapes], dim=1), shapes)):
        v = v.permute(0, 2, 3, 1).reshape(B * M, D, h, w)
        grid = 2 * locations[:, :, :, level].transpose(1, 2).flatten(0, 1) - 1  # (B*M, Q, P, 2)
        sampled = F.grid_sample(v, grid, mode="bilinear", padding_mode="zeros", align_corners=False)  # (B*M, D, Q, P)
        output = output + (sampled * weights[:, :, :, level].transpose(1, 2).flatten(0, 1)[:, None]).sum(-1)
    return output.view(B, M * D, Q).transpose(1, 2)


def ms_deform_attn_core_pytorch(value, value_spatial_shapes, sampling_locations, attention_weights,
                                value_spatial_shapes_hw=None):
    """RF-DETR's core."""
    shapes = value_spatial_shapes.tolist() if value_spatial_shapes_hw is None else value_spatial_shapes_hw
    if sampling_locations.dim() == 5:
        sampling_locations = sampling_locations.unflatten(3, (L, -1))
    return _bilinear(value.permute(0, 3, 1, 2), shapes, sampling_locations,
                     attention_weights.unflatten(3, sampling_locations.shape[3:5]))


def deformable_attention_core_func(value, value_spatial_shapes, sampling_locations, attention_weights):
    """RT-DETR v1's core."""
    return _bilinear(value, value_spatial_shapes, sampling_locations, attention_weights)


def deformable_attention_core_func_v2(value, value_spatial_shapes, sampling_locations, attention_weights,
                                      num_points_list, method="default"):
    """RT-DETRv2's core (equal points per level here); "discrete" samples the pixel each location falls in."""
    locations = sampling_locations.unflatten(3, (L, -1))
    if method == "discrete":
        size = torch.tensor([(w, h) for h, w in value_spatial_shapes], dtype=locations.dtype)[:, None]
        locations = ((locations * size).floor() + 0.5) / size
    return _bilinear(value, value_spatial_shapes, locations, attention_weights.unflatten(3, (L, -1)))


def dfine_core_func_v2(value, value_spatial_shapes, sampling_locations, attention_weights, num_points_list,
                       method="default"):
    """D-FINE's core: ``value`` one (B, M, D, H_l*W_l) per level."""
    return deformable_attention_core_func_v2(torch.cat(value, dim=-1).permute(0, 3, 1, 2), value_spatial_shapes,
                                             sampling_locations, attention_weights, num_points_list, method)


class _CompiledOp:
    """Stands for mmcv's compiled extension, which no CPU run reaches: patch must route the Function to msda."""

    def ms_deform_attn_forward(self, *args, **kwargs):
        raise AssertionError("BEVFormer's Function reached the compiled op: patch did not replace it")


ext_module = _CompiledOp()


class MultiScaleDeformableAttnFunction_fp32(torch.autograd.Function):  # noqa: N801 (BEVFormer's name)
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
                im2col_step):
        return ext_module.ms_deform_attn_forward(value, value_spatial_shapes, value_level_start_index,
                                                 sampling_locations, attention_weights, im2col_step=im2col_step)


class MultiScaleDeformableAttnFunction_fp16(MultiScaleDeformableAttnFunction_fp32):  # noqa: N801
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float16)
    def forward(ctx, value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
                im2col_step):
        return ext_module.ms_deform_attn_forward(value, value_spatial_shapes, value_level_start_index,
                                                 sampling_locations, attention_weights, im2col_step=im2col_step)


def multi_scale_deformable_attn_pytorch(value, value_spatial_shapes, sampling_locations, attention_weights):
    """mmcv's PyTorch function, BEVFormer's CPU branch."""
    return _bilinear(value, value_spatial_shapes.tolist(), sampling_locations, attention_weights)


class _Attention(nn.Module):
    """A deformable attention layer of our own; each subclass's forward calls the core as its codebase does."""

    def __init__(self):
        super().__init__()
        self.sampling_offsets = nn.Linear(C, M * L * P * 2)
        self.attention_weights = nn.Linear(C, M * L * P)
        self.value_proj = nn.Linear(C, C)
        self.output_proj = nn.Linear(C, C)

    def project(self, query, reference_points, input_flatten):
        """value (B, S, M, D), locations (B, Q, M, L, P, 2), weights (B, Q, M, L, P)."""
        value = self.value_proj(input_flatten).view(B, S, M, D)
        offsets = self.sampling_offsets(query).view(B, Q, M, L, P, 2)
        normalizer = torch.tensor([(w, h) for h, w in SHAPES], dtype=query.dtype)[:, None]
        locations = reference_points[:, :, None, :, None] + offsets / normalizer
        weights = self.attention_weights(query).view(B, Q, M, L * P).softmax(-1).view(B, Q, M, L, P)
        return value, locations, weights


class RFDETR(_Attention):
    def __init__(self, rank=6, shapes_hw=True):
        super().__init__()
        self.rank, self.shapes_hw = rank, SHAPES if shapes_hw else None

    def forward(self, query, reference_points, input_flatten):
        value, locations, weights = self.project(query, reference_points, input_flatten)
        value = value.flatten(2).transpose(1, 2).contiguous().view(B, M, D, S)
        locations = locations if self.rank == 6 else locations.flatten(3, 4)
        output = ms_deform_attn_core_pytorch(value, SHAPES_TENSOR, locations, weights.flatten(3),
                                             value_spatial_shapes_hw=self.shapes_hw)
        return self.output_proj(output)


class RTDETR(_Attention):
    def __init__(self):
        super().__init__()
        self.ms_deformable_attn_core = deformable_attention_core_func

    def forward(self, query, reference_points, input_flatten):
        value, locations, weights = self.project(query, reference_points, input_flatten)
        return self.output_proj(self.ms_deformable_attn_core(value, SHAPES, locations, weights))


class RTDETRv2(_Attention):
    def __init__(self, method="default", core=deformable_attention_core_func_v2):
        super().__init__()
        self.num_points_list, self.method = [P] * L, method
        self.ms_deformable_attn_core = functools.partial(core, method=method)

    def forward(self, query, reference_points, input_flatten):
        value, locations, weights = self.project(query, reference_points, input_flatten)
        output = self.ms_deformable_attn_core(self.value(value), SHAPES, locations.flatten(3, 4), weights.flatten(3),
                                              self.num_points_list)
        return self.output_proj(output)

    def value(self, value):
        return value


class DFINE(RTDETRv2):
    def __init__(self):
        super().__init__(core=dfine_core_func_v2)

    def value(self, value):
        return value.permute(0, 2, 3, 1).split([h * w for h, w in SHAPES], dim=-1)


class BEVFormer(_Attention):
    def __init__(self, patched_on_cuda=False):
        super().__init__()
        self.cuda_branch = False  # stands for BEVFormer's test: torch.cuda.is_available() and value.is_cuda
        self.patched_on_cuda = patched_on_cuda  # _check runs the patched model on the CUDA branch

    def forward(self, query, reference_points, input_flatten):
        value, locations, weights = self.project(query, reference_points, input_flatten)
        if self.cuda_branch or (torch.cuda.is_available() and value.is_cuda):
            output = MultiScaleDeformableAttnFunction_fp32.apply(value, SHAPES_TENSOR, STARTS, locations, weights, 64)
        else:
            output = multi_scale_deformable_attn_pytorch(value, SHAPES_TENSOR, locations, weights)
        return self.output_proj(output)


class BEVFormerFp16(BEVFormer):
    def forward(self, query, reference_points, input_flatten):
        value, locations, weights = self.project(query, reference_points, input_flatten)
        if self.cuda_branch or (torch.cuda.is_available() and value.is_cuda):
            output = MultiScaleDeformableAttnFunction_fp16.apply(value, SHAPES_TENSOR, STARTS, locations, weights, 64)
        else:
            output = multi_scale_deformable_attn_pytorch(value, SHAPES_TENSOR, locations, weights)
        return self.output_proj(output)


PATTERNS = {  # name -> (module builder, the mechanism and name patch must report)
    "rfdetr rank-6": (RFDETR, "global: test_patterns.ms_deform_attn_core_pytorch"),
    "rfdetr rank-5": (lambda: RFDETR(rank=5), "global: test_patterns.ms_deform_attn_core_pytorch"),
    "rfdetr no hw": (lambda: RFDETR(shapes_hw=False), "global: test_patterns.ms_deform_attn_core_pytorch"),
    "rt-detr v1": (RTDETR, "attribute: ms_deformable_attn_core"),
    "rt-detrv2": (RTDETRv2, "attribute: ms_deformable_attn_core"),
    "d-fine": (DFINE, "attribute: ms_deformable_attn_core"),
    "bevformer cuda fp32": (lambda: BEVFormer(patched_on_cuda=True),
                            "global: test_patterns.MultiScaleDeformableAttnFunction_fp32"),
    "bevformer cuda fp16": (lambda: BEVFormerFp16(patched_on_cuda=True),
                            "global: test_patterns.MultiScaleDeformableAttnFunction_fp16"),
    "bevformer cpu": (BEVFormer, "global: test_patterns.multi_scale_deformable_attn_pytorch"),
}


def _inputs():
    g = torch.Generator().manual_seed(0)
    return dict(query=torch.randn(B, Q, C, generator=g, dtype=torch.float64),
                reference_points=torch.rand(B, Q, L, 2, generator=g, dtype=torch.float64) * 0.8 + 0.1,
                input_flatten=torch.randn(B, S, C, generator=g, dtype=torch.float64))


def _check(model: nn.Module):
    """Run the model on its own PyTorch path (BEVFormer's CPU branch), patch it, run it again (BEVFormer on the
    CUDA branch where ``patched_on_cuda``), unpatch; assert equal outputs and gradients. Returns the report's
    (name, mechanism) -> (msda calls, calls to the original), its left-alone reasons and an equivalence.Result."""
    model.double()
    randomize(model)
    expected, expected_grads = forward_backward(model, _inputs())
    for module in model.modules():
        if isinstance(module, BEVFormer):
            module.cuda_branch = module.patched_on_cuda
    with Recording() as recording, msda_core.use_backend(recording.name), msda_core.patch(model) as report:
        outputs, grads = forward_backward(model, _inputs())
        calls = {(p.name, site.label): (site.calls, site.fallbacks) for p in report.patched for site in p.sites}
        states = {(p.name, site.label): site.state for p in report.patched for site in p.sites}
        left_alone = [(e.name, e.reason) for e in report.left_alone]
        total = report.calls
    assert recording.calls == total and recording.min_knot_distance > KNOT_DISTANCE
    for key, state in states.items():  # each site msda served was verified against its original's output
        if calls[key][0] == 0:
            assert state == "not yet called", (key, state)
        elif "Function_fp" in key[1]:  # BEVFormer's CUDA branch: its compiled op, a stand-in that raises
            assert state.startswith("not verified: the original could not run (AssertionError: BEVFormer's "), state
        else:
            assert state.startswith("verified on its first call: max |msda - original| "), (key, state)
    output_error = max(kit.assert_close(f"output {i}", actual, wanted, FORWARD).max_rel_err
                       for i, (actual, wanted) in enumerate(zip(outputs, expected, strict=True)))
    gradient_error = max(kit.assert_close(f"grad {name}", grads[name], wanted, GRADIENT).max_rel_err
                         for name, wanted in expected_grads.items())
    mechanisms = sorted({mechanism.split(":")[0] for _, mechanism in calls})
    served = [state for key, state in states.items() if calls[key][0]]
    verified = f"{sum(state.startswith('verified') for state in served)}/{len(served)}"
    return calls, left_alone, Result(mechanisms, output_error, gradient_error, total, recording.min_knot_distance,
                                     verified)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_patched_pattern_equals_its_pytorch_path(pattern, record):
    build, mechanism = PATTERNS[pattern]
    torch.manual_seed(0)
    calls, left_alone, result = _check(build())
    assert not left_alone
    assert calls[("", mechanism)] == (1, 0), calls  # msda ran once, nothing went to the original
    assert all(n == (0, 0) for key, n in calls.items() if key[1] != mechanism)  # BEVFormer's other branch
    assert len({name for name, _ in calls}) == 1  # one module: one report entry, with a site per name it calls
    record(pattern, result)


def test_rtdetrv2_discrete_is_left_alone_and_unchanged():
    """method="discrete" bound through functools.partial: msda samples bilinearly only, so patch leaves it."""
    model = RTDETRv2("discrete")
    with pytest.warns(UserWarning, match="nothing in RTDETRv2 runs through msda"):
        calls, left_alone, result = _check(model)
    assert not calls and result.calls == 0
    assert left_alone == [("", "ms_deformable_attn_core: method='discrete' bound (a functools.partial keyword or a "
                                "default), msda serves only method='default'")]


class _Every(nn.Module):
    """Every pattern above in one model, BEVFormer on both branches, RT-DETRv2's discrete method included."""

    def __init__(self):
        super().__init__()
        self.patterns = nn.ModuleList([build() for build, _ in PATTERNS.values()] + [RTDETRv2("discrete")])

    def forward(self, **inputs):
        return sum(module(**inputs) for module in self.patterns)


def test_patch_changes_no_pattern_output():
    torch.manual_seed(0)
    calls, left_alone, _ = _check(_Every())
    served = {name: 0 for name, _ in calls}
    for (name, _), (n, fallbacks) in calls.items():
        served[name] += n
        assert fallbacks == 0, calls
    assert len(served) == len(PATTERNS) and all(served.values()), calls  # every module ran through msda
    assert [name for name, _ in left_alone] == ["patterns.9"]  # the discrete one


@pytest.mark.parametrize("function, dtype", [(MultiScaleDeformableAttnFunction_fp32, torch.float32),
                                             (MultiScaleDeformableAttnFunction_fp16, torch.float16)])
def test_bevformer_functions_keep_their_autocast_casts(function, dtype):
    """Under autocast, custom_fwd(cast_inputs=dtype) casts the floating inputs and runs with autocast off: the
    patched Function returns ``dtype``, equal to msda on the inputs cast to it; outside autocast nothing is cast."""
    model = nn.ModuleList([BEVFormer(), BEVFormerFp16()])
    g = torch.Generator().manual_seed(0)
    value = torch.randn(B, S, M, D, generator=g).bfloat16()
    locations = torch.rand(B, Q, M, L, P, 2, generator=g).bfloat16()
    weights = torch.rand(B, Q, M, L, P, generator=g).softmax(-1).bfloat16()
    args = (SHAPES_TENSOR, STARTS)
    with msda_core.patch(model) as report:
        name = f"test_patterns.{function.__name__}"
        patched = globals()[function.__name__]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = patched.apply(value, *args, locations, weights, 64)
        assert output.dtype == dtype
        expected = msda_core.compat.MSDeformAttnFunction.apply(value.to(dtype), *args, locations.to(dtype),
                                                               weights.to(dtype))
        kit.assert_close("autocast output", output, expected, kit.tolerance(dtype, "forward"))
        assert patched.apply(value, *args, locations, weights, 64).dtype == torch.bfloat16
        assert patched.outside.calls == 2  # called here, not from a patched module's forward
        assert all(site.calls == 0 for p in report.patched for site in p.sites if site.label == f"global: {name}")
