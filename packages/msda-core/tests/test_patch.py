"""patch / unpatch on a plain-torch model: a Deformable-DETR-style fork (its forward calls a
``MSDeformAttnFunction`` global, as the forks do), msda's own module and an unrecognised one; the report,
float64 equality before and after, untouched parameters, exact restoration, and the errors. Then the first-call
verification (forks.py: forks with other math sent back), the report of every mechanism, per-module counts,
deep copies, threads, TorchScript and unhashable modules."""

import copy
import functools
import gc
import io
import pickle
import sys
import threading
import warnings

import forks
import msda_core
import msda_testkit as kit
import pytest
import torch
from msda_core.adapters import patching
from msda_core.adapters.patching import replace, verify
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
    assert text.splitlines()[0] == "msda_core.patch(Detector, backend='auto', verify=True): 1 patched, 2 left alone"
    assert "patched fork (test_patch.MSDeformAttn): global: test_patch.MSDeformAttnFunction" in text


def test_patched_model_equals_the_original_and_keeps_its_parameters():
    model = Detector()
    before = model.state_dict(keep_vars=True)
    expected, expected_grads = _run(model)
    original = MSDeformAttnFunction
    report = msda_core.patch(model)
    assert isinstance(MSDeformAttnFunction, replace.GlobalName)
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)
    assert report.patched[0].verification == ["not yet called"]
    output, grads = _run(model)
    assert report.calls == report.patched[0].calls == 1  # the fork ran through msda
    [verification] = report.patched[0].verification
    assert verification.startswith("verified on its first call: max |msda - original| "), verification
    kit.assert_close("output", output, expected, FORWARD)
    for name in expected_grads:
        kit.assert_close(f"grad {name}", grads[name], expected_grads[name], GRADIENT)
    msda_core.unpatch(model)
    assert MSDeformAttnFunction is original and patching.report_of(model) is None
    assert all(model.state_dict(keep_vars=True)[k] is before[k] for k in before)


def test_a_global_stays_patched_until_its_last_model_is_unpatched():
    first, second = Detector(), Detector(seed=5)
    original = MSDeformAttnFunction
    msda_core.patch(first)
    msda_core.patch(second)
    msda_core.unpatch(first)
    assert isinstance(MSDeformAttnFunction, replace.GlobalName)
    msda_core.unpatch(second)
    assert MSDeformAttnFunction is original


def test_a_patched_model_pickles_deep_copies_and_releases_its_globals_when_collected():
    model = Detector()
    original = MSDeformAttnFunction
    report = msda_core.patch(model)
    copy_ = copy.deepcopy(model)  # e.g. an EMA copy: it runs as patched, while the original is
    _run(copy_)
    assert report.calls == 0 and MSDeformAttnFunction.outside.calls == 1  # the copy's call, not the model's
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
        assert patching.report_of(second) is None
    assert not isinstance(MSDeformAttnFunction, replace.GlobalName)


def test_backend_reaches_the_op(marker_backend):
    model = Detector()
    with msda_core.patch(model, backend="marker", verify=False):  # marker computes zeros: verification would revert
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
    assert patching.report_of(model) is None
    with msda_core.patch(model):  # and it can be patched again
        assert patching.report_of(model) is not None


def test_errors():
    plain = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"model: expected a multi-scale deformable attention msda can serve "
                                         r"\(strict=True\), found none in Sequential"):
        msda_core.patch(plain, strict=True)
    assert patching.report_of(plain) is None
    with pytest.warns(UserWarning, match="msda_core.patch: nothing in Sequential runs through msda; it computes as "
                                         "before"):
        assert not msda_core.patch(plain).patched
    with pytest.raises(ValueError, match="model: expected a model not patched yet, got a patched Sequential"):
        msda_core.patch(plain)
    msda_core.unpatch(plain)
    with pytest.raises(ValueError, match="model: expected a model patched by msda_core.patch, got an unpatched"):
        msda_core.unpatch(plain)


def _v2_original(value, value_spatial_shapes, sampling_locations, attention_weights, num_points_list,
                 method="default"):
    """Stands for a v2 core function: the published formula where msda serves the call; "original" for a call msda
    passes on (another method, value laid out (B, M, D, S)), so a test sees where each call went."""
    if method != "default" or value.shape[2] != sampling_locations.shape[2]:
        return "original"
    levels = len(value_spatial_shapes)
    return deformable_attention(value, value_spatial_shapes, sampling_locations.unflatten(3, (levels, -1)),
                                attention_weights.unflatten(3, (levels, -1)))


class _V2Caller(nn.Module):
    """D-FINE's arrangement: the core function is an instance attribute, the settings beside it."""

    def __init__(self, num_points_list, method="default"):
        super().__init__()
        self.num_points_list, self.decoder_method = num_points_list, method
        self.ms_deformable_attn_core = _v2_original


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
    assert report.patched[0].verification[0].startswith("verified on its first call")
    msda_core.unpatch(model)
    assert served.ms_deformable_attn_core is _v2_original


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
        assert report.patched[0].verification == ["not yet called"]  # verification is eager too
        assert "calls inside torch.compile'd code are neither counted nor verified" in str(report)
    torch.compiler.reset()


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
    assert patching.forms.form(object, "m.f") == "m.f: type <class 'object'> is not a function msda recognises"


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
        assert str(report).splitlines()[1].startswith(
            "  patched <model> (test_patch._V2Caller): attribute: ms_deformable_attn_core: 1 calls through msda, 2 "
            "to the original (value: expected (B, S, M, D) with M = 2, got (1, 2, 3, 30)); verified on its first "
            "call: max |msda - original| ")


# The first-call verification.

def _fork_inputs():
    inputs = kit.make_inputs(kit.with_head_dim(kit.case("tiny"), 3), torch.float64)  # M = 2, D = 3, Q = 2
    return (inputs["value"], inputs["spatial_shapes"], inputs["sampling_locations"], inputs["attention_weights"])


def test_the_bound_is_the_tolerance_tables():
    """msda-core keeps its own copy of the table's forward entries (it does not depend on the testkit)."""
    for dtype, bound in verify.FORWARD_BOUNDS.items():
        entry = kit.tolerance(dtype, "forward")
        assert bound == (entry.rtol, entry.atol), dtype


@pytest.fixture
def forget_refused():
    """A name verification sent back stays back for the process: the tests' forks are forgotten after each."""
    yield
    for key in [k for k in replace.refused if k[0] == id(vars(forks))]:
        del replace.refused[key]


@pytest.mark.parametrize("fork", list(forks.FORKS), ids=lambda fork: fork.__name__)
def test_a_fork_with_other_math_is_sent_back_to_its_original_with_a_warning(fork, forget_refused):
    name = forks.FORKS[fork]
    original = vars(forks)[name]
    model = nn.ModuleList([fork(), fork()])
    args = _fork_inputs()
    expected = model[0](*args)
    report = msda_core.patch(model)
    assert [p.name for p in report.patched] == ["0", "1"]
    with pytest.warns(UserWarning, match=rf"msda_core.patch: global: forks.{name}: the original differs from msda on "
                                         rf"the first call from 0 \(forks.{fork.__name__}\): "):
        output = model[0](*args)
    kit.assert_close("output", output, expected, FORWARD)  # the original's: the caller never sees msda's
    assert vars(forks)[name] is original  # back in its namespace, for every module
    kit.assert_close("output", model[1](*args), expected, FORWARD)
    assert not report.patched and report.calls == 0
    reasons = [(e.name, e.reason) for e in report.left_alone]
    assert [n for n, _ in reasons] == ["0", "1"] and reasons[0][1] == reasons[1][1]
    measured = "the original returned shape (1, 6, 2), msda (1, 2, 6)" if fork is forks.ChannelsFirst else (
        "max |msda - original| ")
    assert reasons[0][1].startswith(f"global: forks.{name}: the original differs from msda on the first call from 0 "
                                    f"(forks.{fork.__name__}): {measured}"), reasons[0][1]
    assert str(report).splitlines()[0].endswith("0 patched, 2 left alone")
    with pytest.warns(UserWarning, match="nothing in"):  # for good: a model patched later leaves it alone too
        later_model = fork()
        later = msda_core.patch(later_model)
    assert [e.reason for e in later.left_alone] == [reasons[0][1].removeprefix("global: ")]
    msda_core.unpatch(model)
    msda_core.unpatch(later_model)


def test_a_fork_measured_far_off_reports_its_difference(forget_refused):
    model = forks.AlignCorners()
    report = msda_core.patch(model)
    with pytest.warns(UserWarning, match="differs from msda"):
        model(*_fork_inputs())
    reason = report.left_alone[0].reason
    ratio = float(reason.rsplit("), ", 1)[1].split(" of the")[0])
    assert ratio > 1e3 and reason.endswith(" of the float64 bound"), reason  # O(1), far above float64's bound
    msda_core.unpatch(model)


def test_an_original_that_cannot_run_is_not_verified_and_msda_serves():
    model = forks.Missing()
    args = _fork_inputs()
    with msda_core.patch(model) as report:
        output = model(*args)
        [entry] = report.patched
        assert entry.verification == ["not verified: the original could not run (RuntimeError: the compiled "
                                       "extension is not built)"]
        assert entry.calls == 1
    value, shapes, locations, weights = args
    kit.assert_close("output", output, deformable_attention(value, shapes.tolist(), locations, weights), FORWARD)


def test_verification_leaves_the_random_generator_and_the_inputs_alone():
    model = forks.SideEffects()
    args = _fork_inputs()
    value = args[0].clone()
    with msda_core.patch(model) as report:
        state = torch.random.get_rng_state()
        model(*args)
        assert torch.equal(torch.random.get_rng_state(), state)
        assert torch.equal(args[0], value)  # the original zeroed its copy only
        assert report.patched[0].verification[0].startswith("verified on its first call")


def test_verify_false_skips_verification():
    model = forks.AlignCorners()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with msda_core.patch(model, verify=False) as report:
            model(*_fork_inputs())
            assert report.patched[0].verification == ["not verified (verify=False)"] and report.calls == 1


# The report: every mechanism, per-module counts, copies, threads, TorchScript, unhashable modules.

class MultiScaleDeformableAttention(nn.Module):
    """transformers' parameter-free core as patch recognises it (this class name in a transformers module, set
    below: the real ones are in integrations/test_transformers.py); its forward is the published formula."""

    def forward(self, value, value_spatial_shapes, value_spatial_shapes_list, level_start_index, sampling_locations,
                attention_weights, im2col_step=None):
        return deformable_attention(value, value_spatial_shapes_list, sampling_locations, attention_weights)


MultiScaleDeformableAttention.__module__ = "transformers.models.deformable_detr.modeling_deformable_detr"


class _ChildCaller(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = MultiScaleDeformableAttention()

    def forward(self, value, shapes, locations, weights):
        return self.attn(value, shapes, shapes.tolist(), None, locations, weights, 64)


class _Every(nn.Module):
    """Each mechanism once: a transformers core as a child, a per-instance core, a fork calling a global."""

    def __init__(self):
        super().__init__()
        self.child, self.attribute, self.fork = _ChildCaller(), _V2Caller([2, 2]), MSDeformAttn()
        self.fork.load_state_dict(checkpoint(C, L, M, P))
        self.double()

    def run(self):
        value, shapes, locations, weights = _fork_inputs()
        self.child(value, shapes, locations, weights)
        self.attribute.ms_deformable_attn_core(*_v2_args())
        self.fork(*_inputs())

    def originals(self):
        return self.child.attn, self.attribute.ms_deformable_attn_core, globals()["MSDeformAttnFunction"]


def test_the_report_prints_for_every_mechanism(capsys):
    model = _Every()
    with msda_core.patch(model) as report:
        print(report)
        model.run()
        print(report)
    before, after = capsys.readouterr().out.split("msda_core.patch(_Every")[1:]
    child = ("patched child.attn (transformers.models.deformable_detr.modeling_deformable_detr."
             "MultiScaleDeformableAttention): child: replaced by msda_core.nn.MultiScaleDeformableAttention")
    attribute = "patched attribute (test_patch._V2Caller): attribute: ms_deformable_attn_core"
    fork = "patched fork (test_patch.MSDeformAttn): global: test_patch.MSDeformAttnFunction"
    for line in (child, attribute, fork):
        assert f"{line}: 0 calls through msda, 0 to the original; not yet called" in before, before
        assert f"{line}: 1 calls through msda, 0 to the original; verified on its first call: max |msda - " in after
    assert 'README.md, "Knots"' in after and "3 patched, 0 left alone" in after


def test_the_warning_and_the_error_print_every_left_alone_mechanism():
    core = MultiScaleDeformableAttention()
    core.register_buffer("table", torch.zeros(1))
    model = nn.ModuleDict({"child": nn.ModuleDict({"attn": core}), "attribute": _V2Caller([3, 1]),
                           "refused": _RefusedCaller()})
    reasons = ["left alone child.attn (transformers.models.deformable_detr.modeling_deformable_detr."
               "MultiScaleDeformableAttention): has parameters or buffers",
               "left alone attribute (test_patch._V2Caller): num_points_list=[3, 1]",
               "left alone refused (test_patch._RefusedCaller): test_patch.ms_deform_attn_core_pytorch("]
    with pytest.warns(UserWarning) as caught:
        msda_core.unpatch(model) if msda_core.patch(model) else None
    assert all(reason in str(caught[0].message) for reason in reasons), caught[0].message
    with pytest.raises(ValueError) as raised:
        msda_core.patch(model, strict=True)
    assert all(reason in str(raised.value) for reason in reasons), raised.value


class _TwoNames(MSDeformAttn):
    """mmcv's arrangement: the forward calls its Function on one branch, its PyTorch function on the other."""

    def forward(self, query, reference_points, input_flatten, shapes, starts, fused=True):
        value, loc, weights = sampling_inputs(dict(self.named_parameters()), M, L, P, query, reference_points,
                                              input_flatten, SHAPES)
        if fused:
            return self.output_proj(MSDeformAttnFunction.apply(value, shapes, starts, loc, weights, 64))
        return self.output_proj(multi_scale_deformable_attn_pytorch(value, shapes, loc, weights))


def multi_scale_deformable_attn_pytorch(value, value_spatial_shapes, sampling_locations, attention_weights):
    return deformable_attention(value, value_spatial_shapes.tolist(), sampling_locations, attention_weights)


def test_calls_are_counted_per_module_with_one_entry_each():
    """Each line showed the calls of every module sharing the name, and mmcv's modules an entry per name."""
    model = nn.ModuleList([_TwoNames(), _TwoNames(), MSDeformAttn()]).double()
    with msda_core.patch(model) as report:
        both = "global: test_patch.MSDeformAttnFunction, global: test_patch.multi_scale_deformable_attn_pytorch"
        assert [(p.name, p.mechanism) for p in report.patched] == [
            ("0", both), ("1", both), ("2", "global: test_patch.MSDeformAttnFunction")]
        model[0](*_inputs())
        model[0](*_inputs(), fused=False)
        model[2](*_inputs())
        assert [p.calls for p in report.patched] == [2, 0, 1] and report.calls == 3
        assert [len(p.verification) for p in report.patched] == [2, 2, 1]
        assert report.patched[1].verification == ["not yet called", "not yet called"]


def test_a_deep_copy_of_a_patched_model_can_be_unpatched_and_patched():
    """unpatch(copy) raised "got an unpatched"; patch(copy) warned that nothing runs through msda."""
    model = _Every()
    originals = model.originals()
    with msda_core.patch(model):
        copy_ = copy.deepcopy(model)
        assert isinstance(copy_.child.attn, replace.PatchedCore)
        msda_core.unpatch(copy_)
        assert type(copy_.child.attn) is MultiScaleDeformableAttention
        assert copy_.attribute.ms_deformable_attn_core is _v2_original
        again = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            report = msda_core.patch(again)
        assert [p.name for p in report.patched] == ["child.attn", "attribute", "fork"]
        again.run()
        assert [p.calls for p in report.patched] == [1, 1, 1]
        msda_core.unpatch(again)
        assert type(again.child.attn) is MultiScaleDeformableAttention
    assert model.originals() == originals
    with pytest.raises(ValueError, match="got an unpatched _Every"):
        msda_core.unpatch(copy_)


def test_a_patched_model_and_its_replacements_pickle():
    model = _V2Caller([2, 2])
    with msda_core.patch(model):
        loaded = pickle.loads(pickle.dumps(model))
    msda_core.unpatch(loaded)
    assert loaded.ms_deformable_attn_core is _v2_original


def test_patch_and_unpatch_from_two_threads_at_once_are_atomic():
    """One model patched from two threads at once stayed patched after unpatch in a third of the rounds."""
    model = _Every()
    originals = model.originals()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(300):
            barrier, refused = threading.Barrier(2), []

            def patch(barrier=barrier, refused=refused):
                barrier.wait()
                try:
                    msda_core.patch(model)
                except ValueError as error:
                    refused.append(error)

            threads = [threading.Thread(target=patch) for _ in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert len(refused) == 1, refused
            msda_core.unpatch(model)
            assert model.originals() == originals
            assert patching.report_of(model) is None
    finally:
        sys.setswitchinterval(interval)


def test_a_torchscript_module_gets_a_clear_error():
    linear = nn.Linear(2, 2)
    for compiled in (torch.jit.script(linear), torch.jit.trace(linear, torch.randn(1, 2))):
        with pytest.raises(TypeError, match="model: expected an eager torch.nn.Module, got the TorchScript module"):
            msda_core.patch(compiled)
    with pytest.warns(UserWarning, match="nothing in Sequential runs through msda"):  # inside an eager model
        msda_core.patch(nn.Sequential(torch.jit.script(linear)))


class _Unhashable(nn.Module):
    __hash__ = None  # type: ignore[assignment]


def test_an_unhashable_module_gets_a_clear_error():
    for model in (_Unhashable(), nn.Sequential(_Unhashable())):
        with pytest.raises(TypeError, match=r"model: expected modules torch.nn.Module.named_modules can list \(it "
                                            r"hashes each\), got \w+ holding one that is not hashable"):
            msda_core.patch(model)
