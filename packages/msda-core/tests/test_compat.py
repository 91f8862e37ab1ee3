"""The drop-in functions and the extension shim: the published formula in float64, every accepted input form,
backend selection, and the extension's own calling convention."""

import importlib.util
import sys

import msda_core
import msda_testkit as kit
import pytest
import torch
from msda_core import compat
from msda_core.adapters import shims
from published import deformable_attention

FORWARD, GRADIENT = kit.tolerance(torch.float64, "forward"), kit.tolerance(torch.float64, "gradient")


def _inputs(name="out_of_bounds"):
    """Random locations, some off the maps; in float64 none sits on a pixel knot (probability 0)."""
    inputs = kit.make_inputs(kit.case(name), torch.float64)
    for arg in kit.DIFFERENTIABLE:
        inputs[arg].requires_grad_()
    return inputs


def _check_against_published(output, inputs):
    """Output and the three gradients equal the published formula's, through autograd on both sides."""
    shapes = [tuple(s) for s in inputs["spatial_shapes"].tolist()]
    expected = deformable_attention(inputs["value"], shapes, inputs["sampling_locations"], inputs["attention_weights"])
    kit.assert_close("output", output, expected, FORWARD)
    grad_output = kit.grad_output_for(inputs)
    leaves = [inputs[arg] for arg in kit.DIFFERENTIABLE]
    for name, actual, wanted in zip(kit.DIFFERENTIABLE, torch.autograd.grad(output, leaves, grad_output),
                                    torch.autograd.grad(expected, leaves, grad_output)):
        kit.assert_close(f"grad {name}", actual, wanted, GRADIENT)


@pytest.mark.parametrize("level_start", ["tensor", "none"])
def test_function_apply_matches_the_published_formula(level_start):
    inputs = _inputs()
    starts = inputs["level_start_index"] if level_start == "tensor" else None
    output = compat.MSDeformAttnFunction.apply(inputs["value"], inputs["spatial_shapes"], starts,
                                               inputs["sampling_locations"], inputs["attention_weights"], 7)
    _check_against_published(output, inputs)  # im2col_step 7 divides no batch size: ignored


def test_function_aliases_are_one_object():
    assert compat.MultiScaleDeformableAttnFunction is compat.MSDeformAttnFunction
    assert compat.MultiScaleDeformableAttentionFunction is compat.MSDeformAttnFunction
    assert compat.ms_deform_attn_core_pytorch is compat.multi_scale_deformable_attn_pytorch
    assert compat.multi_scale_deformable_attention is compat.multi_scale_deformable_attn_pytorch


@pytest.mark.parametrize("shapes_as", ["tensor", "list"])
@pytest.mark.parametrize("rank", [6, 5])
def test_pytorch_function_takes_shape_lists_and_folded_levels(shapes_as, rank):
    inputs = _inputs("many_levels_points")
    shapes = inputs["spatial_shapes"] if shapes_as == "tensor" else inputs["spatial_shapes"].tolist()
    loc, weights = inputs["sampling_locations"], inputs["attention_weights"]
    if rank == 5:  # ultralytics 8.4 and RT-DETRv2: (B, Q, M, L*P, 2), level-major; weights (B, Q, M, L*P)
        loc, weights = loc.flatten(3, 4), weights.flatten(3, 4)
    _check_against_published(compat.multi_scale_deformable_attn_pytorch(inputs["value"], shapes, loc, weights), inputs)


def test_folded_locations_must_split_evenly_into_levels():
    inputs = kit.make_inputs(kit.case("tiny"), torch.float64)
    loc = inputs["sampling_locations"].flatten(3, 4)[:, :, :, :3]  # L = 2 levels, 3 points
    with pytest.raises(ValueError, match=r"sampling_locations: expected shape \(B, Q, M, L\*P, 2\) with L\*P a "
                                         r"multiple of L = 2, got \(1, 2, 2, 3, 2\)"):
        compat.multi_scale_deformable_attn_pytorch(inputs["value"], inputs["spatial_shapes"], loc,
                                                   inputs["attention_weights"].flatten(3, 4)[..., :3])


def test_a_shape_list_becomes_one_reusable_tensor_made_outside_inference_mode():
    shapes = [(6, 4), (3, 2)]
    with torch.inference_mode():
        first = compat.level_shapes(shapes, "cpu")
    assert not first.is_inference()  # it may be saved for backward by a later training call
    assert compat.level_shapes([[6, 4], [3, 2]], torch.device("cpu")) is first
    assert first.dtype == torch.int64 and first.tolist() == [[6, 4], [3, 2]]


def test_v2_function_serves_equal_points_and_default_method_only():
    inputs = _inputs("tiny")
    args = (inputs["value"], inputs["spatial_shapes"].tolist(), inputs["sampling_locations"].flatten(3, 4),
            inputs["attention_weights"].flatten(3, 4))
    _check_against_published(compat.multi_scale_deformable_attention_v2(*args, [2, 2], "default"), inputs)
    with pytest.raises(ValueError, match=r"num_points_list=\[3, 1\]: msda needs the same number of points"):
        compat.multi_scale_deformable_attention_v2(*args, [3, 1])
    with pytest.raises(ValueError, match="method='discrete': msda samples bilinearly"):
        compat.multi_scale_deformable_attention_v2(*args, [2, 2], "discrete")



@pytest.mark.parametrize("rank", [6, 5])
def test_rfdetr_core_takes_value_heads_first_and_int_shapes(rank):
    """RF-DETR's core: value (B, M, D, S), weights (B, Q, M, L*P), shapes as a tensor or as (H, W) ints."""
    inputs = _inputs("many_levels_points")
    loc, weights = inputs["sampling_locations"], inputs["attention_weights"].flatten(3, 4)
    loc = loc if rank == 6 else loc.flatten(3, 4)
    value = inputs["value"].permute(0, 2, 3, 1)
    for shapes_hw in (None, inputs["spatial_shapes"].tolist()):
        output = compat.ms_deform_attn_core_pytorch_bmds(value, inputs["spatial_shapes"], loc, weights,
                                                         value_spatial_shapes_hw=shapes_hw)
        _check_against_published(output, inputs)


def test_v2_function_takes_dfine_per_level_value():
    inputs = _inputs("tiny")
    sizes = [h * w for h, w in inputs["spatial_shapes"].tolist()]
    levels = inputs["value"].permute(0, 2, 3, 1).split(sizes, dim=-1)  # one (B, M, D, H_l*W_l) per level
    output = compat.multi_scale_deformable_attention_v2(levels, inputs["spatial_shapes"].tolist(),
                                                        inputs["sampling_locations"].flatten(3, 4),
                                                        inputs["attention_weights"].flatten(3, 4), [2, 2])
    _check_against_published(output, inputs)


def _folded(inputs):
    return (inputs["value"], inputs["sampling_locations"].flatten(3, 4), inputs["attention_weights"].flatten(3, 4))


def _compat_errors():
    """Each malformed drop-in call (issue 31), the error it must raise and the message's start."""
    inputs = kit.make_inputs(kit.case("tiny"), torch.float64)  # levels (6, 4), (3, 2); P = 2
    value, loc, weights = _folded(inputs)
    pytorch = compat.multi_scale_deformable_attn_pytorch
    v2 = compat.multi_scale_deformable_attention_v2
    shapes = [(6, 4), (3, 2)]
    return [
        ("empty shapes, rank-5 locations", lambda: pytorch(value, [], loc, weights), ValueError,
         "value_spatial_shapes: expected (H, W) pairs of one or more levels, got []"),  # was ZeroDivisionError
        ("empty shape tensor", lambda: pytorch(value, torch.zeros(0, 2, dtype=torch.int64), loc, weights),
         ValueError, "value_spatial_shapes: expected (H, W) of one or more levels"),
        ("weights of the wrong size", lambda: pytorch(value, shapes, inputs["sampling_locations"], weights[..., :3]),
         ValueError, "attention_weights: expected shape (B, Q, M, L*P) with L*P = 4"),  # was unflatten's error
        ("3-tuple shapes", lambda: pytorch(value, [(6, 4, 1), (3, 2, 1)], loc, weights), ValueError,
         "value_spatial_shapes: expected (H, W) pairs"),  # was "too many values to unpack"
        ("float shapes", lambda: pytorch(value, [(6.5, 4), (3, 2)], loc, weights), TypeError,
         "value_spatial_shapes: expected integer sizes"),  # was truncated silently
        ("int locations", lambda: pytorch(value, shapes, loc.long(), weights), TypeError,
         "sampling_locations: expected a floating dtype, got torch.int64"),  # was cast silently
        ("bool weights", lambda: pytorch(value, shapes, loc, weights.bool()), TypeError,
         "attention_weights: expected a floating dtype, got torch.bool"),
        ("complex locations", lambda: pytorch(value, shapes, loc.to(torch.complex128), weights), TypeError,
         "sampling_locations: expected a floating dtype, got torch.complex128"),  # lost the imaginary part
        ("v2 counts past P", lambda: v2(value, shapes, loc, weights, [4, 4]), ValueError,
         "num_points_list: expected one count per level (2)"),  # all three ran
        ("v2 no counts", lambda: v2(value, shapes, loc, weights, []), ValueError, "num_points_list:"),
        ("v2 one count", lambda: v2(value, shapes, loc, weights, [3]), ValueError, "num_points_list:"),
    ]


@pytest.mark.parametrize("index", range(len(_compat_errors())), ids=[c[0] for c in _compat_errors()])
def test_drop_in_functions_refuse_malformed_calls_naming_the_argument(index):
    _, call, error, start = _compat_errors()[index]
    with pytest.raises(error) as info:
        call()
    assert str(info.value).startswith(start), str(info.value)


def test_autocast_dtypes_are_brought_to_a_pair_the_op_takes():
    """bf16 value and weights beside fp32 locations (as autocast leaves them): the weights go to fp32."""
    inputs = kit.make_inputs(kit.case("tiny"), torch.float64)
    value = inputs["value"].to(torch.bfloat16)
    out = compat.multi_scale_deformable_attn_pytorch(value, inputs["spatial_shapes"],
                                                     inputs["sampling_locations"].float(),
                                                     inputs["attention_weights"].to(torch.bfloat16))
    expected = deformable_attention(value.double(), [(6, 4), (3, 2)], inputs["sampling_locations"].float().double(),
                                    inputs["attention_weights"].to(torch.bfloat16).double())
    assert out.dtype == torch.bfloat16
    kit.assert_close("output", out, expected, kit.tolerance(torch.bfloat16, "forward"))


def test_backend_selection_applies():
    """use_backend and backend= both reach the op: a recording backend sees the calls."""
    ran = []
    gather = msda_core.backends()["gather"]

    def forward(inputs):
        ran.append("forward")
        return gather.forward(inputs)

    msda_core.register(msda_core.Backend("recording", forward, gather.backward, devices=frozenset({"cpu"}),
                                         dtypes=gather.dtypes))
    try:
        inputs = kit.make_inputs(kit.case("tiny"), torch.float64)
        args = (inputs["value"], inputs["spatial_shapes"], inputs["sampling_locations"], inputs["attention_weights"])
        with msda_core.use_backend("recording"):
            compat.multi_scale_deformable_attn_pytorch(*args)
        compat.multi_scale_deformable_attn_pytorch(*args, backend="recording")
        compat.MSDeformAttnFunction.apply(*args[:2], None, *args[2:], 64, backend="recording")
        assert ran == ["forward"] * 3
    finally:
        msda_core.unregister("recording")


class _DeformableDetrFunction(torch.autograd.Function):
    """The calling convention of Deformable DETR's Function over its compiled extension, as its source has it:
    forward and backward of the extension module imported by name."""

    @staticmethod
    def forward(ctx, value, shapes, starts, loc, weights, im2col_step):
        import MultiScaleDeformableAttention as MSDA
        ctx.im2col_step = im2col_step
        ctx.save_for_backward(value, shapes, starts, loc, weights)
        return MSDA.ms_deform_attn_forward(value, shapes, starts, loc, weights, im2col_step)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        import MultiScaleDeformableAttention as MSDA
        value, shapes, starts, loc, weights = ctx.saved_tensors
        grad_value, grad_loc, grad_weights = MSDA.ms_deform_attn_backward(value, shapes, starts, loc, weights,
                                                                          grad_output.contiguous(), ctx.im2col_step)
        return grad_value, None, None, grad_loc, grad_weights, None


@pytest.fixture
def clean_modules():
    """Leave sys.modules as it was: the shim registers names for the whole process (and its finder, for packages
    not imported yet)."""
    before, pending = dict(sys.modules), dict(shims._FINDER.modules)
    yield
    for name in set(sys.modules) - set(before):
        del sys.modules[name]
    shims._FINDER.modules.clear()
    shims._FINDER.modules.update(pending)


# These expect the shim to register MultiScaleDeformableAttention, which it does only where no build of it imports
# (as on the GPU machine where the peers' build is installed beside msda).
needs_no_extension_build = pytest.mark.skipif(
    importlib.util.find_spec("MultiScaleDeformableAttention") is not None,
    reason="a build of MultiScaleDeformableAttention imports here, which the shim leaves as it is")


@needs_no_extension_build
def test_extension_shim_runs_deformable_detr_code_unmodified(clean_modules):
    assert "MultiScaleDeformableAttention" not in sys.modules
    assert compat.install_extension_shim() == ["MultiScaleDeformableAttention"]
    assert compat.install_extension_shim() == []  # present now: left as it is
    inputs = _inputs()
    output = _DeformableDetrFunction.apply(*(inputs[arg] for arg in kit.ARGUMENTS), 64)
    _check_against_published(output, inputs)


@needs_no_extension_build
def test_extension_shim_for_detrex_goes_in_before_detrex_imports_it(tmp_path, monkeypatch, clean_modules):
    """A package laid out as detrex (its __init__ imports detrex._C, which was never compiled)."""
    package = tmp_path / "detrex"
    package.mkdir()
    (package / "__init__.py").write_text("from detrex import _C\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert compat.install_extension_shim(detrex=True) == ["MultiScaleDeformableAttention", "detrex._C"]
    import detrex
    assert detrex._C is sys.modules["MultiScaleDeformableAttention"]
    assert detrex._C.ms_deform_attn_forward is shims._ms_deform_attn_forward


def test_extension_shim_never_shadows_a_real_module(tmp_path, monkeypatch, clean_modules):
    (tmp_path / "MultiScaleDeformableAttention.py").write_text("REAL = True\n")
    package = tmp_path / "detrex"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_C.py").write_text("REAL = True\n")  # stands for the compiled _C*.so
    monkeypatch.syspath_prepend(str(tmp_path))
    assert compat.install_extension_shim(detrex=True) == []
    assert "detrex" not in sys.modules  # looked up, not imported


def _mmcv_backward_call():
    """The arguments of mmcv._ext's ms_deform_attn_backward, its three gradient buffers zeros like their inputs."""
    inputs = {k: (v.detach() if v is not None else None) for k, v in _inputs().items()}
    grad_output = kit.grad_output_for(inputs)
    buffers = {"grad_value": torch.zeros_like(inputs["value"]),
               "grad_sampling_loc": torch.zeros_like(inputs["sampling_locations"]),
               "grad_attn_weight": torch.zeros_like(inputs["attention_weights"])}
    return inputs, grad_output, buffers


def test_mmcv_stand_in_backward_fills_the_buffers_it_is_given():
    inputs, grad_output, buffers = _mmcv_backward_call()
    assert shims._mmcv_ms_deform_attn_backward(*(inputs[arg] for arg in kit.ARGUMENTS), grad_output,
                                               *buffers.values(), 64) is None
    expected = msda_core.deform_attn_backward(grad_output, *(inputs[arg] for arg in kit.ARGUMENTS))
    for (name, buffer), grad in zip(buffers.items(), expected):
        assert torch.equal(buffer, grad), name


BUFFER_DEFECTS = {  # how a buffer differs from its input, and what the error must say
    "int64": (lambda b: b.to(torch.int64), TypeError, "dtype torch.float64 .*, got torch.int64"),
    "extra leading dim": (lambda b: b[None], ValueError, r"shape \(2, .*\) .*, got \(1, 2, .*\)"),
    "meta": (lambda b: b.to("meta"), ValueError, "device cpu .*, got meta"),
}


@pytest.mark.parametrize("defect", BUFFER_DEFECTS)
@pytest.mark.parametrize("buffer", ["grad_value", "grad_sampling_loc", "grad_attn_weight"])
def test_mmcv_stand_in_backward_refuses_a_buffer_unlike_its_input(buffer, defect):
    """mmcv's backward writes into its caller's buffers: one of another dtype truncated the gradients, one with more
    leading dims was broadcast into, a meta one received nothing, all silently. Each is refused, naming the buffer,
    before anything is written."""
    inputs, grad_output, buffers = _mmcv_backward_call()
    change, error, message = BUFFER_DEFECTS[defect]
    buffers[buffer] = change(buffers[buffer])
    with pytest.raises(error, match=f"^{buffer}: expected {message}"):
        shims._mmcv_ms_deform_attn_backward(*(inputs[arg] for arg in kit.ARGUMENTS), grad_output, *buffers.values(),
                                            64)
    assert all(b.device.type == "meta" or not b.any() for b in buffers.values())


@pytest.mark.parametrize("error", ["OSError('libcudart.so.12: cannot open shared object file')",
                                   "RuntimeError('The NVIDIA driver on your system is too old')",
                                   "AttributeError('module torch has no attribute _six')"])
def test_extension_shim_replaces_a_build_whose_import_fails_in_any_way(error, tmp_path, monkeypatch, clean_modules):
    """A compiled extension's import fails with more than ImportError: ctypes loading a missing CUDA library
    (OSError), a driver too old (RuntimeError), an API the build's torch had (AttributeError). install_extension_shim
    raised them; each is a broken build: warned, naming its error, and stood in for."""
    (tmp_path / "MultiScaleDeformableAttention.py").write_text(f"raise {error}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(RuntimeWarning, match="MultiScaleDeformableAttention is installed but does not import "
                                            f"\\({error.partition('(')[0]}: "):
        assert compat.install_extension_shim() == ["MultiScaleDeformableAttention"]
    import MultiScaleDeformableAttention as MSDA
    assert MSDA.ms_deform_attn_forward is shims._ms_deform_attn_forward


@needs_no_extension_build
@pytest.mark.parametrize("parent", ["imported before", "imported after"])
def test_extension_shim_binds_the_package_attribute(parent, tmp_path, monkeypatch, clean_modules):
    """``import groundingdino._C`` then ``groundingdino._C``: the attribute was never set (AttributeError), whether
    the package was imported before install_extension_shim or after it."""
    (tmp_path / "groundingdino").mkdir()
    (tmp_path / "groundingdino" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    if parent == "imported before":
        import groundingdino
    assert compat.install_extension_shim(groundingdino=True) == ["MultiScaleDeformableAttention", "groundingdino._C"]
    assert compat.install_extension_shim(groundingdino=True) == []  # present now: left as it is
    import groundingdino._C
    assert groundingdino._C is sys.modules["groundingdino._C"] is sys.modules["MultiScaleDeformableAttention"]
    assert groundingdino._C.ms_deform_attn_forward is shims._ms_deform_attn_forward
