"""The CPU reference backends, the first link of the tests' chain of trust (naive -> grid_sample -> triton):
the naive loops against grid_sample in float64, gather against the naive loops, the op's gradients against
finite differences, and the op's registration against torch.library's, torch.compile's and export's checks."""

import itertools
from dataclasses import replace

import msda_core
import msda_testkit as kit
import pytest
import torch
from msda_reference import gather

# torch's own deprecation, raised inside Inductor and opcheck on these valid calls: nothing this code can change
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


@pytest.mark.parametrize("case", kit.EDGE_CASES, ids=lambda c: c.name)
def test_naive_matches_grid_sample_in_float64(case):
    inputs = kit.make_inputs(case, torch.float64)
    kit.assert_parity(inputs, "naive", "grid_sample")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", kit.EDGE_CASES, ids=lambda c: c.name)
def test_gather_matches_naive(case, dtype):
    kit.assert_parity(kit.make_inputs(case, dtype), "gather", "naive")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["decoder_small", "encoder_small"])
def test_gather_matches_float64_on_model_like_locations(name, dtype):
    """Deformable DETR's sampling: neighbouring queries share corners, many locations lie off the coarse maps."""
    kit.assert_parity(kit.make_inputs(replace(kit.case(name), layout="model_like"), dtype), "gather")


def test_gather_backward_replays_bitwise():
    """Its backward sums in a fixed order (a stable sort, sequential bags): it declares itself deterministic
    on the CPU, and replays must agree bit for bit, with one thread or two."""
    inputs = kit.make_inputs(kit.case("decoder_small"), torch.float32)
    grad_output = kit.grad_output_for(inputs)
    assert "cpu" in msda_core.backends()["gather"].reproducible_on
    threads = torch.get_num_threads()
    counts = iter([1, 2, 1, 2])

    def run(**inp):
        torch.set_num_threads(next(counts))
        return kit.run(inp, "gather", grad_output)

    try:
        kit.assert_replays_bit_exact(run, inputs, replays=4)
    finally:
        torch.set_num_threads(threads)


def _gather_results(inputs, grad_output):
    leaves = {k: (v.detach().requires_grad_() if k in kit.DIFFERENTIABLE else v) for k, v in inputs.items()}
    out = torch.ops.msda.deform_attn(**leaves, backend="gather")
    return (out, *torch.autograd.grad(out, [leaves[k] for k in kit.DIFFERENTIABLE], grad_output))


@pytest.mark.parametrize("case", [kit.case("decoder_small"), kit.case("nonfinite"), kit.case("non_contiguous")],
                         ids=lambda c: c.name)
def test_gather_chunks_give_the_bits_of_one_piece(case, monkeypatch):
    """Eager mode works through the queries in chunks, and gathers the backward's corner rows in smaller
    pieces: every sum keeps its order, so chunked results are those of one piece, bit for bit."""
    inputs = kit.make_inputs(case, torch.float32)
    grad_output = kit.grad_output_for(inputs)
    whole = _gather_results(inputs, grad_output)
    monkeypatch.setattr(gather, "_CHUNK_TAPS", 3 * 4 * len(case.levels) * case.points)  # a few outputs per chunk
    monkeypatch.setattr(gather, "_GATHER_TAPS", 1)
    assert len(gather._chunks(case.batch * case.queries, case.heads * 4 * len(case.levels) * case.points,
                              gather._CHUNK_TAPS)) > 2
    for name, a, b in zip(("output", *kit.GRAD_NAMES), _gather_results(inputs, grad_output), whole):
        assert torch.equal(kit.replay.bits(a), kit.replay.bits(b)), name


@pytest.mark.parametrize("table", ["starts past the end", "levels larger than value"])
def test_gather_wrong_level_table_reads_and_writes_only_value(table):
    """Compiled code skips the op's validation of the level table: the backend itself must keep every corner
    row inside value (embedding_bag and index_add_ raise on a row outside their table)."""
    inputs = kit.make_inputs(kit.case("out_of_bounds"), torch.float32)
    value, shapes, starts, loc, weights = (inputs[k] for k in kit.ARGUMENTS)
    S = value.shape[1]
    if table == "starts past the end":
        starts = starts + S
    else:
        shapes = shapes * 4
    wrong = msda_core.Inputs(value, shapes, starts, loc, weights)
    out = gather.forward(wrong)
    grads = gather.backward(kit.grad_output_for(inputs), wrong, "auto", False)
    assert out.shape == kit.grad_output_for(inputs).shape
    assert [g.shape for g in grads] == [value.shape, loc.shape, weights.shape]


def test_gather_traces_whole():
    """Its forward and backward are tensor operations that read no values on the host: torch.compile
    (fullgraph) and torch.export trace them and give eager's results. Traced only (aot_eager): Inductor's code
    for them is built and run by test_deploy_cpu."""
    inputs = kit.make_inputs(kit.case("nonfinite"), torch.float32)
    value, shapes, starts, loc, weights = (inputs[k] for k in kit.ARGUMENTS)
    grad_output = kit.grad_output_for(inputs)
    args = (value, shapes, starts, loc, weights)

    def forward(*args):
        return gather.forward(msda_core.Inputs(*args))

    def backward(grad_output, *args):
        return gather.backward(grad_output, msda_core.Inputs(*args), "auto", False)

    eager = (forward(*args), *backward(grad_output, *args))
    torch._dynamo.reset()
    compiled = (torch.compile(forward, fullgraph=True, backend="aot_eager")(*args),
                *torch.compile(backward, fullgraph=True, backend="aot_eager")(grad_output, *args))

    class Forward(torch.nn.Module):
        def forward(self, *args):
            return forward(*args)

    class Backward(torch.nn.Module):
        def forward(self, grad_output, *args):
            return backward(grad_output, *args)

    exported = (torch.export.export(Forward(), args).module()(*args),
                *torch.export.export(Backward(), (grad_output, *args)).module()(grad_output, *args))
    for results in (compiled, exported):
        for name, actual, expected in zip(("output", *kit.GRAD_NAMES), results, eager):
            kit.assert_close(name, actual, expected, kit.tolerance(torch.float32, "gradient"))


@pytest.mark.parametrize("head_dim", kit.GRADCHECK_HEAD_DIMS)
@pytest.mark.parametrize("backend", ["naive", "grid_sample", "gather"])
def test_gradcheck(backend, head_dim):
    """Finite differences of the op itself; samples kept away from pixel kinks (docs/math.md). The full Jacobian
    at the head dims of a few channels; past them a head dim changes only how many channels the same formulas
    run over, so fast_mode (the Jacobian against random vectors on both sides, which a wrong entry fails) suffices."""
    case = kit.Case(f"gradcheck_d{head_dim}", head_dim=head_dim, layout="away_from_pixels", loc_range=(-0.2, 1.2))
    inputs = kit.make_inputs(case, torch.float64)
    value, loc, weights = (inputs[k].requires_grad_() for k in ("value", "sampling_locations", "attention_weights"))

    def op(value, loc, weights):
        return torch.ops.msda.deform_attn(value, inputs["spatial_shapes"], inputs["level_start_index"], loc, weights,
                                          backend=backend)

    assert torch.autograd.gradcheck(op, (value, loc, weights), eps=1e-6, atol=1e-7, rtol=1e-5,
                                    fast_mode=head_dim > FULL_JACOBIAN_HEAD_DIM)


FULL_JACOBIAN_HEAD_DIM = 3  # gradcheck compares the whole Jacobian up to this head dim
OPCHECK_AOT_CASES = ("tiny", "no_level_start", "non_contiguous")  # every check, on both backends
OPCHECK_FAST = ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.mark.parametrize(("case", "backend"), list(zip(kit.EDGE_CASES, itertools.cycle(("grid_sample", "gather")))),
                         ids=lambda x: getattr(x, "name", x))
def test_opcheck_both_ops(case, backend):
    """torch.library.opcheck of both public ops over every edge case, the backends taking turns: the schema (no
    mutation or aliasing it does not declare), the autograd registration and the fake-tensor kernel; on
    OPCHECK_AOT_CASES, on both backends, also the AOT dispatch check, which compiles."""
    inputs = kit.make_inputs(case, torch.float64)
    for k in kit.DIFFERENTIABLE:
        inputs[k].requires_grad_()
    args = tuple(inputs.values())
    grad = kit.grad_output_for(inputs)
    detached = tuple(a.detach() if a is not None else None for a in args)
    every = case.name in OPCHECK_AOT_CASES
    checks = {} if every else {"test_utils": OPCHECK_FAST}
    for name in ("grid_sample", "gather") if every else (backend,):
        torch.library.opcheck(torch.ops.msda.deform_attn.default, args, {"backend": name}, **checks)
        torch.library.opcheck(torch.ops.msda.deform_attn_backward.default, (grad,) + detached,
                              {"backend": name, "grad_accum": "auto", "deterministic": None}, **checks)


def test_compile_fullgraph_matches_eager():
    inputs = kit.make_inputs(kit.case("out_of_bounds"), torch.float32)

    def layer(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        out = torch.ops.msda.deform_attn(value * 2, spatial_shapes, level_start_index, sampling_locations,
                                         attention_weights.softmax(-1))
        return out.relu().sum(-1)

    eager = layer(**inputs)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)(**inputs)
    kit.assert_close("compiled output", compiled, eager, kit.tolerance(torch.float32, "forward"))


def test_compile_fullgraph_backward():
    inputs = kit.make_inputs(kit.case("tiny"), torch.float64)
    value = inputs["value"].requires_grad_()

    def loss(value):
        return torch.ops.msda.deform_attn(value, inputs["spatial_shapes"], inputs["level_start_index"],
                                          inputs["sampling_locations"], inputs["attention_weights"]).square().sum()

    (expected,) = torch.autograd.grad(loss(value), value)
    torch._dynamo.reset()
    (actual,) = torch.autograd.grad(torch.compile(loss, fullgraph=True)(value), value)
    kit.assert_close("compiled grad_value", actual, expected, kit.tolerance(torch.float64, "gradient"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", [kit.case("out_of_bounds"), kit.case("head_dim_71"), kit.case("nonfinite")],
                         ids=lambda c: c.name)
def test_grid_sample_low_precision_against_float64(case, dtype):
    kit.assert_parity(kit.make_inputs(case, dtype), "grid_sample", "naive")


@pytest.mark.parametrize("backend", ["grid_sample", "gather"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_precision_keeps_location_precision(dtype, backend):
    """Half value with fp32 locations: locations are not rounded to half on the way."""
    inputs = kit.make_inputs(kit.case("out_of_bounds"), dtype, location_dtype=torch.float32)
    results = kit.assert_parity(inputs, backend, "naive")
    assert [r.name for r in results][:1] == ["output"]
    # the same inputs with the locations rounded to half must be measurably worse: the dtype mattered
    rounded = dict(inputs, sampling_locations=inputs["sampling_locations"].to(dtype).float())
    exact = kit.run(kit.upcast(inputs), "naive")["output"]
    err_mixed = (kit.run(inputs, backend)["output"].double() - exact).abs().max()
    err_rounded = (kit.run(rounded, backend)["output"].double() - exact).abs().max()
    assert err_rounded > 2 * err_mixed


def test_export_records_the_op_and_matches_eager():
    inputs = kit.make_inputs(kit.case("out_of_bounds"), torch.float32)

    class Layer(torch.nn.Module):
        def forward(self, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
            return torch.ops.msda.deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                                              attention_weights)

    exported = torch.export.export(Layer(), tuple(inputs.values()))
    assert "msda.deform_attn" in str(exported.graph)
    kit.assert_close("exported output", exported.module()(*inputs.values()), Layer()(**inputs),
                     kit.tolerance(torch.float32, "forward"))
