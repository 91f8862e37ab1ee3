"""The Triton kernels against float64 (the second link of the chain: naive -> grid_sample -> triton), beyond the
conformance suite (test_triton_conformance.py: every edge case in every dtype and mode): head dims, the
accumulation paths against each other, the deterministic mode's own rules, launch layouts, the level table.

On CPU (TRITON_INTERPRET=1) the reference is the naive loops; on a GPU it is grid_sample in float64 on the
same device, which the conformance suite ties to the naive loops.
"""

import dataclasses
import itertools

import msda_core
import msda_testkit as kit
import pytest
import torch
import triton
from helpers import BF16, CROWDED, F16, F32, REFERENCE, assert_triton_parity, wrong_level_table
from msda_triton import backend
from msda_triton.backend import BACKEND, accumulates_in_fp32, launch_forward
from triton_env import DEVICE, needs_kernels

pytestmark = needs_kernels


@pytest.mark.parametrize("head_dim", kit.GRADCHECK_HEAD_DIMS + (96,))
def test_head_dims(head_dim):
    case = kit.with_head_dim(kit.case("out_of_bounds"), head_dim)
    assert_triton_parity(kit.make_inputs(case, F32, device=DEVICE), "native")


@pytest.mark.parametrize("dtype", [F32, F16])
def test_accumulation_paths_agree(dtype):
    """fp32 values: both paths do the same fp32 arithmetic, only the atomics' order differs. Half values:
    only grad_value differs, by the native path's per-add rounding."""
    inputs = kit.make_inputs(kit.case("out_of_bounds"), dtype, device=DEVICE)
    grad_output = kit.grad_output_for(inputs)
    native = kit.run(inputs, "triton", grad_output, grad_accum="native")
    fp32 = kit.run(inputs, "triton", grad_output, grad_accum="fp32")
    for name in ("output", "grad_sampling_locations", "grad_attention_weights"):
        assert torch.equal(native[name], fp32[name]), name
    kit.assert_close("grad_value", native["grad_value"], fp32["grad_value"], kit.tolerance(dtype, "atomic"))


def _shaped(dtype, device, queries, pixels, levels=4, points=4):
    """Empty value and sampling_locations of these sizes: all the accumulation rule reads."""
    value = torch.empty(1, pixels, 1, 2, dtype=dtype, device=device)
    return value, torch.empty(1, queries, 1, levels, points, 2, dtype=dtype, device=device)


def test_grad_accum_auto_rule():
    """"auto": native half adds while the shapes expect at most NATIVE_ADDS_UP_TO terms per element of
    grad_value (4*Q*L*P/S per head), fp32 accumulation beyond; bf16 only where it has native atomics (sm_90+);
    "fp32" and "native" as asked; fp32 gradients in fp32 whatever is asked."""
    limit = backend.NATIVE_ADDS_UP_TO * 22223  # Deformable DETR's S
    decoder, past, encoder = (_shaped(F16, "meta", q, 22223) for q in (300, limit // 16 + 1, 22223))
    assert 4 * 300 * 16 <= limit < 4 * (limit // 16 + 1) * 16
    assert not accumulates_in_fp32("auto", *decoder)
    assert accumulates_in_fp32("auto", *past) and accumulates_in_fp32("auto", *encoder)
    for shapes in (decoder, encoder):
        assert accumulates_in_fp32("fp32", *shapes) and not accumulates_in_fp32("native", *shapes)
    for queries in (300, 22223):  # fp32 gradients, decoder and encoder
        shapes = _shaped(F32, "meta", queries, 22223)
        assert not any(accumulates_in_fp32(mode, *shapes) for mode in ("auto", "native", "fp32"))
    assert accumulates_in_fp32("auto", *_shaped(BF16, "meta", 300, 22223))  # no device with bf16 atomics
    if DEVICE == "cuda":
        native_bf16 = torch.cuda.get_device_capability() >= (9, 0)
        assert accumulates_in_fp32("auto", *_shaped(BF16, DEVICE, 300, 22223)) != native_bf16


# grad_value receives 0.8 terms per element from 3 queries on these 60 pixels (the rule takes native adds in
# fp16, and in bf16 on sm_90), 16 from 60 queries, one per pixel (encoder-like: fp32 accumulation)
_LEVELS = ((6, 8), (3, 4))
SHAPE_CLASSES = (kit.Case("decoder_like", batch=2, queries=3, heads=2, head_dim=8, levels=_LEVELS),
                 kit.Case("encoder_like", batch=2, queries=60, heads=2, head_dim=8, levels=_LEVELS))


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("layout", ["random", "model_like"])
@pytest.mark.parametrize("case", SHAPE_CLASSES, ids=lambda c: c.name)
def test_default_accumulation_within_the_dtype_bound(case, layout, dtype):
    """The default's grad_value against float64 within the "accumulated" entry (norm-wise, the dtype's unit
    roundoff) on both sides of the rule, model-like and uniform locations (kit.assert_parity judges it so)."""
    inputs = kit.make_inputs(dataclasses.replace(case, layout=layout), dtype, device=DEVICE)
    assert kit.grad_value_effect("triton", inputs) == "accumulated"
    assert_triton_parity(inputs, "auto")


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter only")
def test_interpreter_refuses_bf16_native_atomics_by_name():
    inputs = kit.make_inputs(kit.case("tiny"), BF16)
    with pytest.raises(msda_core.BackendUnavailableError, match="no bf16 atomic add"):
        msda_core.deform_attn(**inputs, backend="triton", grad_accum="native")


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter only")
def test_auto_never_picks_the_interpreter():
    inputs = kit.make_inputs(kit.case("tiny"), F32)
    assert msda_core.resolve_backend(inputs["value"], inputs["sampling_locations"]) == "gather"
    assert msda_core.resolve_backend(inputs["value"], inputs["sampling_locations"], "triton") == "triton"


def test_opcheck_of_the_private_ops():
    """The private triton_ops the backend runs (their gradients come from the public op's autograd: checked with
    inputs that need none); the public ops are opchecked by the conformance suite."""
    inputs = kit.make_inputs(kit.case("out_of_bounds"), F32, device=DEVICE)
    # Triton's interpreter cannot be traced (wrap_triton hands back the kernel itself): on CPU the AOT-dispatch
    # check is left to the GPU suite, which runs every check
    checks = {"test_utils": ("test_schema", "test_autograd_registration", "test_faketensor")} if DEVICE == "cpu" else {}
    torch.library.opcheck(torch.ops.msda._triton_forward.default, tuple(inputs.values()), **checks)
    grad_output = kit.grad_output_for(inputs)
    torch.library.opcheck(torch.ops.msda._triton_backward.default, (grad_output, *inputs.values(), "auto", False),
                          **checks)


def test_forward_is_deterministic():
    inputs = kit.make_inputs(kit.case("out_of_bounds"), F32, device=DEVICE)
    kit.assert_replays_bit_exact(lambda **inp: kit.run(inp, "triton")["output"], inputs, replays=5,
                                 contention=True)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy, on NaN
def test_deterministic_mode_makes_all_of_grad_value_nan_for_a_nonfinite_grad_output():
    """A non-finite max|g| leaves no finite bound, so no exact scale: NaN everywhere, never garbage."""
    inputs = kit.make_inputs(CROWDED, F32, device=DEVICE)
    grad_output = kit.grad_output_for(inputs)
    grad_output[0, 0, 0] = float("inf")
    result = kit.run(inputs, "triton", grad_output, deterministic=True)
    assert result["grad_value"].isnan().all()


def test_deterministic_mode_refuses_more_terms_than_its_exact_sums_hold():
    meta = msda_core.Metadata(torch.device(DEVICE), F32, F32, batch=1, queries=2 ** 19, heads=1, head_dim=8,
                              levels=4, points=4, grad_accum="auto", deterministic=True)
    assert BACKEND.not_supported_reasons(meta) == [
        "the deterministic mode's exact fp32 sums need Q*L*P < 2^23 terms per element, got 8388608"]
    assert BACKEND.not_supported_reasons(meta._replace(queries=2 ** 19 - 1)) == []


def test_deterministic_none_follows_torch_and_takes_the_fixed_point_path():
    inputs = kit.make_inputs(CROWDED, F16, device=DEVICE)
    grad_output = kit.grad_output_for(inputs)
    explicit = kit.run(inputs, "triton", grad_output, deterministic=True)["grad_value"]
    torch.use_deterministic_algorithms(True)
    try:
        implicit = kit.run(inputs, "triton", grad_output)["grad_value"]
    finally:
        torch.use_deterministic_algorithms(False)
    atomic = kit.run(inputs, "triton", grad_output, grad_accum="native")["grad_value"]
    assert torch.equal(kit.replay.bits(implicit), kit.replay.bits(explicit))
    # fp16 atomics round ~400 running sums per element; the fixed-point sum is exact, rounded once
    assert not torch.equal(kit.replay.bits(atomic), kit.replay.bits(explicit))


@pytest.mark.parametrize("block_p", [1, 2, 4])  # each rule's points per step
@pytest.mark.parametrize("case", ["out_of_bounds", "non_contiguous", "nonfinite", "many_levels_points"])
def test_forward_row_orders_and_offset_widths_agree_bitwise(case, block_p):
    """Head-major and row-major blocks (kernels._block_rows), with int32 or int64 offsets, compute every row
    with the same arithmetic, so the outputs agree bit for bit. Blocks of 2 queries: programs split a head's
    queries, and the last block of each head is partial where Q is odd; with 4 points per step,
    many_levels_points' 5 points per level end in a partial step."""
    inputs = kit.make_inputs(kit.case(case), F32, device=DEVICE)
    value, shapes, starts, loc, weights = (inputs[k].contiguous() for k in kit.ARGUMENTS)
    outputs = []
    for head_major, wide in itertools.product((False, True), (False, True)):
        outputs.append(value.new_empty(msda_core.output_shape(value, loc)))
        launch_forward(value, shapes, starts, loc, weights, outputs[-1], ({
            "BLOCK_R": 2, "BLOCK_P": block_p, "BLOCK_D": triton.next_power_of_2(value.shape[3]),
            "HEAD_MAJOR": head_major, "WIDE": wide}, 1))
    first = outputs[0]
    for other in outputs[1:]:
        assert torch.equal(first.isnan(), other.isnan()) and torch.equal(first.nan_to_num(), other.nan_to_num())
    assert first.isnan().any() == (case == "nonfinite")


def test_a_level_outside_value_contributes_nothing():
    """The kernels check each level against value's rows, whatever the table says: with level 1 reaching past
    value's end, output and gradients are level 0's, and nothing is read or written outside value."""
    inputs = kit.make_inputs(kit.case("out_of_bounds"), F32, device=DEVICE)
    wrong, level_0 = wrong_level_table(inputs)
    args = [wrong[k].contiguous() for k in kit.ARGUMENTS]
    got = torch.ops.msda._triton_forward(*args)
    grad_output = kit.grad_output_for(inputs)
    grad_value, grad_locations, grad_weights = torch.ops.msda._triton_backward(grad_output, *args, "auto", False)
    expected = kit.run(kit.upcast(level_0), REFERENCE, grad_output.double())
    kit.assert_close("output", got, expected["output"], kit.tolerance(F32, "forward"))
    kit.assert_close("grad_value", grad_value[:, :24], expected["grad_value"], kit.tolerance(F32, "atomic"))
    assert not grad_value[:, 24:].any() and not grad_locations[:, :, :, 1:].any()
    assert not grad_weights[:, :, :, 1:].any()
    kit.assert_close("grad_attention_weights", grad_weights[:, :, :, :1], expected["grad_attention_weights"],
                     kit.tolerance(F32, "gradient"))
