"""The CPU reference backends, the first link of the tests' chain of trust (naive -> grid_sample -> triton): the
naive loops against grid_sample in float64, and what is gather's own (model-like locations, replays across thread
counts, chunking, a wrong level table, tracing its functions). Every backend against float64 naive on the edge
cases, gradcheck, opcheck, compile and export: the conformance suite (test_reference_conformance.py)."""

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
    for them is built and run by the conformance suite's compile check and test_deploy_cpu."""
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


