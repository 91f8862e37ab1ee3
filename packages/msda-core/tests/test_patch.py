"""patch / unpatch on a plain-torch model: a Deformable-DETR-style fork (its forward calls a
``MSDeformAttnFunction`` global, as the forks do), msda's own module and an unrecognised one; the report,
float64 equality before and after, untouched parameters, exact restoration, and the errors."""

import copy
import functools
import gc
import io

import msda_core
import msda_testkit as kit
import pytest
import torch
from msda_core.adapters import patching
from published import checkpoint, deformable_attention, sampling_inputs
from torch import nn

FORWARD, GRADIENT = kit.tolerance(torch.float64, "forward"), kit.tolerance(torch.float64, "gradient")
C, L, M, P = 16, 2, 4, 2
SHAPES = [(5, 6), (3, 2)]


class MSDeformAttnFunction:
    """Stands for the compiled extension's Function the forks import (here the published formula on the CPU)."""

    @staticmethod
    def apply(value, value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
              im2col_step):
        shapes = [tuple(s) for s in value_spatial_shapes.tolist()]
        return deformable_attention(value, shapes, sampling_locations, attention_weights)


class MSDeformAttn(nn.Module):
    """A Deformable DETR fork's module: its own parameters, and a forward that calls the global above."""

    def __init__(self):
        super().__init__()
        self.im2col_step, self.n_heads, self.n_levels, self.n_points = 64, M, L, P
        self.sampling_offsets = nn.Linear(C, M * L * P * 2)
        self.attention_weights = nn.Linear(C, M * L * P)
        self.value_proj = nn.Linear(C, C)
        self.output_proj = nn.Linear(C, C)

    def forward(self, query, reference_points, input_flatten, shapes, starts):
        value, loc, weights = sampling_inputs(dict(self.named_parameters()), M, L, P, query, reference_points,
                                              input_flatten, SHAPES)
        return self.output_proj(MSDeformAttnFunction.apply(value, shapes, starts, loc, weights, self.im2col_step))


class Unrecognised(MSDeformAttn):
    """Deformable DETR's layout, but a forward that calls nothing msda knows."""

    def forward(self, query, reference_points, input_flatten, shapes, starts):
        value, loc, weights = sampling_inputs(dict(self.named_parameters()), M, L, P, query, reference_points,
                                              input_flatten, SHAPES)
        return self.output_proj(deformable_attention(value, SHAPES, loc, weights))


class Detector(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        self.fork, self.ours, self.unknown = MSDeformAttn(), msda_core.nn.MSDeformAttn(C, L, M, P), Unrecognised()
        for i, module in enumerate((self.fork, self.ours, self.unknown)):
            module.load_state_dict(checkpoint(C, L, M, P, seed=seed + i))  # offsets spread off the pixel knots
        self.double()

    def forward(self, query, reference_points, input_flatten, shapes, starts):
        args = (query, reference_points, input_flatten, shapes, starts)
        return self.fork(*args) + self.ours(*args) + self.unknown(*args)


def _inputs(N=2, Len_q=4):
    g = torch.Generator().manual_seed(7)
    S = sum(h * w for h, w in SHAPES)
    return (torch.randn(N, Len_q, C, generator=g, dtype=torch.float64),
            torch.rand(N, Len_q, L, 2, generator=g, dtype=torch.float64),
            torch.randn(N, S, C, generator=g, dtype=torch.float64),
            torch.tensor(SHAPES), torch.tensor([0, 30]))


def _run(model):
    output = model(*_inputs())
    grads = torch.autograd.grad(output, list(model.parameters()), torch.ones_like(output))
    return output, dict(zip((name for name, _ in model.named_parameters()), grads))


def test_patch_reports_what_it_patched_and_what_it_left_alone():
    model = Detector()
    with msda_core.patch(model) as report:
        assert [(p.name, p.mechanism) for p in report.patched] == [("fork", "global: test_patch.MSDeformAttnFunction")]
        assert [(e.name, e.reason) for e in report.left_alone] == [
            ("ours", "already msda (its backend= applies)"),
            ("unknown", "Deformable DETR's layout, but its forward calls nothing msda recognises")]
        text = str(report)
    assert text.splitlines()[0] == "msda_core.patch(Detector, backend='auto'): 1 patched, 2 left alone"
    assert "patched fork (test_patch.MSDeformAttn): global: test_patch.MSDeformAttnFunction" in text


def test_patched_model_equals_the_original_and_keeps_its_parameters():
    model = Detector()
    before = model.state_dict(keep_vars=True)
    expected, expected_grads = _run(model)
    original = MSDeformAttnFunction
    report = msda_core.patch(model)
    assert isinstance(MSDeformAttnFunction, patching._Counted)
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)
    output, grads = _run(model)
    assert report.calls == report.patched[0].calls == 1  # the fork ran through msda
    kit.assert_close("output", output, expected, FORWARD)
    for name in expected_grads:
        kit.assert_close(f"grad {name}", grads[name], expected_grads[name], GRADIENT)
    msda_core.unpatch(model)
    assert MSDeformAttnFunction is original and model not in patching._reports
    assert all(model.state_dict(keep_vars=True)[k] is before[k] for k in before)


def test_a_global_stays_patched_until_its_last_model_is_unpatched():
    first, second = Detector(), Detector(seed=5)
    original = MSDeformAttnFunction
    msda_core.patch(first)
    msda_core.patch(second)
    msda_core.unpatch(first)
    assert isinstance(MSDeformAttnFunction, patching._Counted)
    msda_core.unpatch(second)
    assert MSDeformAttnFunction is original


def test_a_patched_model_pickles_deep_copies_and_releases_its_globals_when_collected():
    model = Detector()
    original = MSDeformAttnFunction
    report = msda_core.patch(model)
    copy_ = copy.deepcopy(model)  # e.g. an EMA copy: it runs as patched, while the original is
    _run(copy_)
    assert report.calls == 1
    buffer = io.BytesIO()
    torch.save(model, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    del model, copy_, loaded
    gc.collect()
    assert MSDeformAttnFunction is original and report.model is None


def test_a_global_runs_one_backend_per_process():
    first, second = Detector(), Detector()
    with msda_core.patch(first, backend="gather"):
        with pytest.raises(ValueError, match="backend: expected 'gather', the backend another patched model runs "
                                             "test_patch.MSDeformAttnFunction with"):
            msda_core.patch(second, backend="grid_sample")
        assert second not in patching._reports
    assert not isinstance(MSDeformAttnFunction, patching._Counted)


def test_backend_reaches_the_op(marker_backend):
    model = Detector()
    with msda_core.patch(model, backend="marker"):
        model.fork(*_inputs())
    assert marker_backend == [1]


def test_patch_checks_its_arguments_where_they_are_given():
    """patch("a string") said "cannot create weak reference"; a bad backend name was accepted until a call."""
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module, got str"):
        msda_core.patch("a string")
    with pytest.raises(ValueError, match="backend: expected 'auto' or one of"):
        msda_core.patch(Detector(), backend="nope")


def test_unpatch_inside_the_block_then_exit():
    """`with patch(m): unpatch(m)` raised on exit: the block ends with the model unpatched either way."""
    model = Detector()
    with msda_core.patch(model):
        msda_core.unpatch(model)
    assert model not in patching._reports
    with msda_core.patch(model):  # and it can be patched again
        assert model in patching._reports


def test_errors():
    plain = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"model: expected a multi-scale deformable attention msda can serve "
                                         r"\(strict=True\), found none in Sequential"):
        msda_core.patch(plain, strict=True)
    assert plain not in patching._reports
    with pytest.warns(UserWarning, match="msda_core.patch: nothing in Sequential runs through msda; it computes as "
                                         "before"):
        assert not msda_core.patch(plain).patched
    with pytest.raises(ValueError, match="model: expected a model not patched yet, got a patched Sequential"):
        msda_core.patch(plain)
    msda_core.unpatch(plain)
    with pytest.raises(ValueError, match="model: expected a model patched by msda_core.patch, got an unpatched"):
        msda_core.unpatch(plain)


class _V2Caller(nn.Module):
    """D-FINE's arrangement: the core function is an instance attribute, the settings beside it."""

    def __init__(self, num_points_list, method="default"):
        super().__init__()
        self.num_points_list, self.decoder_method = num_points_list, method
        self.ms_deformable_attn_core = self.original

    @staticmethod
    def original(value, value_spatial_shapes, sampling_locations, attention_weights, num_points_list,
                 method="default"):
        return "original"


def test_v2_callers_are_patched_only_where_msda_can_serve_them():
    served, points, discrete = _V2Caller([2, 2]), _V2Caller([3, 1]), _V2Caller([2, 2], "discrete")
    model = nn.ModuleList([served, points, discrete])
    report = msda_core.patch(model)
    assert [(p.name, p.mechanism) for p in report.patched] == [("0", "attribute: ms_deformable_attn_core")]
    assert [(e.name, e.reason) for e in report.left_alone] == [
        ("1", "num_points_list=[3, 1]: msda needs the same number of points on every level"),
        ("2", "method='discrete': msda samples bilinearly (method='default') only")]
    inputs = kit.make_inputs(kit.case("tiny"), torch.float64)
    args = (inputs["value"], [(6, 4), (3, 2)], inputs["sampling_locations"].flatten(3, 4),
            inputs["attention_weights"].flatten(3, 4))
    assert served.ms_deformable_attn_core(*args, [2, 2], "discrete") == "original"  # decided per call too
    assert report.calls == 0
    expected = deformable_attention(inputs["value"], [(6, 4), (3, 2)], inputs["sampling_locations"],
                                    inputs["attention_weights"])
    kit.assert_close("output", served.ms_deformable_attn_core(*args, [2, 2], "default"), expected, FORWARD)
    assert report.calls == 1
    msda_core.unpatch(model)
    assert served.ms_deformable_attn_core == served.original


def test_counting_does_not_recompile_under_torch_compile():
    """The call counters are eager-only: one dynamo sees changing would recompile the graph on every call."""
    model = Detector()
    torch.compiler.reset()
    core = msda_core.nn.MultiScaleDeformableAttention()  # what replaces transformers' cores
    inputs = kit.make_inputs(kit.case("tiny"), torch.float64)
    core_args = (inputs["value"], inputs["spatial_shapes"], None, inputs["level_start_index"],
                 inputs["sampling_locations"], inputs["attention_weights"])
    with msda_core.patch(model) as report, torch._dynamo.config.patch(error_on_recompile=True):
        compiled, compiled_core = torch.compile(model.fork, backend="eager"), torch.compile(core, backend="eager")
        for _ in range(3):
            compiled(*_inputs())
            compiled_core(*core_args)
        assert report.calls == core.calls == 0
    torch.compiler.reset()


def _v2_original(value, value_spatial_shapes, sampling_locations, attention_weights, num_points_list,
                 method="default"):
    """Stands for a v2 core function: the published formula, bilinear whatever ``method`` says (so a call that
    reached it instead of msda is seen only through the counters)."""
    return deformable_attention(value, value_spatial_shapes, sampling_locations.unflatten(3, (2, -1)),
                                attention_weights.unflatten(3, (2, -1)))


class _PartialCaller(nn.Module):
    """The original RT-DETRv2 / D-FINE arrangement: the core bound with its method through functools.partial, and
    no settings msda reads."""

    def __init__(self, method):
        super().__init__()
        self.ms_deformable_attn_core = functools.partial(_v2_original, method=method)


def _v2_args():
    inputs = kit.make_inputs(kit.with_head_dim(kit.case("tiny"), 3), torch.float64)  # M = 2, D = 3
    return (inputs["value"], [(6, 4), (3, 2)], inputs["sampling_locations"].flatten(3, 4),
            inputs["attention_weights"].flatten(3, 4), [2, 2])


def test_a_partial_binding_another_method_is_left_alone():
    default, discrete = _PartialCaller("default"), _PartialCaller("discrete")
    model = nn.ModuleList([default, discrete])
    with msda_core.patch(model) as report:
        assert [(p.name, p.mechanism) for p in report.patched] == [("0", "attribute: ms_deformable_attn_core")]
        assert [(e.name, e.reason) for e in report.left_alone] == [
            ("1", "ms_deformable_attn_core: method='discrete' bound (a functools.partial keyword or a default), msda "
                  "serves only method='default'")]
        assert isinstance(discrete.ms_deformable_attn_core, functools.partial)
        default.ms_deformable_attn_core(*_v2_args())
        assert report.calls == 1


def ms_deform_attn_core_pytorch(value, value_spatial_shapes, sampling_locations, attention_weights, scale):
    """A known name with a signature msda does not know (one parameter more)."""
    raise AssertionError("not called")


class _RefusedCaller(nn.Module):
    def forward(self, *args):
        return ms_deform_attn_core_pytorch(*args)


def test_a_signature_msda_does_not_serve_is_left_alone():
    model = _RefusedCaller()
    with pytest.warns(UserWarning, match="nothing in _RefusedCaller runs through msda"):
        report = msda_core.patch(model)
    assert not report.patched
    assert [e.reason for e in report.left_alone] == [
        "test_patch.ms_deform_attn_core_pytorch(value, value_spatial_shapes, sampling_locations, attention_weights, "
        "scale): not a signature msda serves"]
    assert globals()["ms_deform_attn_core_pytorch"].__doc__.startswith("A known name")
    msda_core.unpatch(model)
    assert patching._form(object, "m.f") == "m.f: type <class 'object'> is not a function msda recognises"


def test_a_call_msda_cannot_serve_goes_to_the_original_and_is_counted():
    caller = _V2Caller([2, 2])
    with msda_core.patch(caller) as report:
        value, shapes, locations, weights, points = _v2_args()
        core = caller.ms_deformable_attn_core
        expected = _v2_original(value, shapes, locations, weights, points)
        kit.assert_close("served", core(value, shapes, locations, weights, points), expected, FORWARD)
        assert core(value, shapes, locations, weights, points, "discrete") == "original"  # msda: bilinear only
        assert core(value.permute(0, 2, 3, 1), shapes, locations, weights, points) == "original"  # (B, M, D, S)
        assert (report.calls, report.patched[0].fallbacks) == (1, 2)
        assert str(report).splitlines()[1] == (
            "  patched <model> (test_patch._V2Caller): attribute: ms_deformable_attn_core: 1 calls through msda, 2 "
            "to the original (value: expected (B, S, M, D) with M = 2, got (1, 2, 3, 30))")
