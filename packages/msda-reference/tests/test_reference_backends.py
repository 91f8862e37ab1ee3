"""The CPU reference backends, the first link of the tests' chain of trust (naive -> grid_sample -> triton):
the naive loops against grid_sample in float64, gather against the naive loops, the op's gradients against
finite differences, and the op's registration against torch.library's, torch.compile's and export's checks."""

import pytest
import torch

import msda_core
import msda_testkit as kit


@pytest.mark.parametrize("case", kit.EDGE_CASES, ids=lambda c: c.name)
def test_naive_matches_grid_sample_in_float64(case):
    inputs = kit.make_inputs(case, torch.float64)
    kit.assert_parity(inputs, "naive", "grid_sample")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", kit.EDGE_CASES, ids=lambda c: c.name)
def test_gather_matches_naive(case, dtype):
    kit.assert_parity(kit.make_inputs(case, dtype), "gather", "naive")


def test_gather_replays_bitwise_as_it_declares():
    """Its backward is grid_sample's CPU backward, which adds in a fixed order: it declares itself
    deterministic on the CPU (so its grad_value is judged without an atomics allowance), and must be."""
    assert "cpu" in msda_core.backends()["gather"].reproducible_on
    inputs = kit.make_inputs(kit.case("decoder_small"), torch.float32)
    grad_output = kit.grad_output_for(inputs)
    outputs = kit.assert_replays_bit_exact(lambda **i: kit.run(i, "gather", grad_output), inputs, replays=3)
    assert set(outputs) == {"output", *kit.GRAD_NAMES}


@pytest.mark.parametrize("head_dim", kit.GRADCHECK_HEAD_DIMS)
@pytest.mark.parametrize("backend", ["naive", "grid_sample", "gather"])
def test_gradcheck(backend, head_dim):
    """Finite differences of the op itself; samples kept away from pixel kinks (docs/math.md)."""
    case = kit.Case(f"gradcheck_d{head_dim}", head_dim=head_dim, layout="away_from_pixels", loc_range=(-0.2, 1.2))
    inputs = kit.make_inputs(case, torch.float64)
    value, loc, weights = (inputs[k].requires_grad_() for k in ("value", "sampling_locations", "attention_weights"))

    def op(value, loc, weights):
        return torch.ops.msda.deform_attn(value, inputs["spatial_shapes"], inputs["level_start_index"], loc, weights,
                                          backend=backend)

    assert torch.autograd.gradcheck(op, (value, loc, weights), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("case", [kit.case("tiny"), kit.case("no_level_start"), kit.case("non_contiguous")],
                         ids=lambda c: c.name)
def test_opcheck_both_ops(case):
    inputs = kit.make_inputs(case, torch.float64)
    for k in ("value", "sampling_locations", "attention_weights"):
        inputs[k].requires_grad_()
    args = tuple(inputs.values())
    grad = kit.grad_output_for(inputs)
    detached = tuple(a.detach() if a is not None else None for a in args)
    for backend in ("grid_sample", "gather"):
        torch.library.opcheck(torch.ops.msda.deform_attn.default, args, {"backend": backend})
        torch.library.opcheck(torch.ops.msda.deform_attn_backward.default, (grad,) + detached,
                              {"backend": backend, "grad_accum": "auto", "deterministic": None})


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_precision_keeps_location_precision(dtype):
    """Half value with fp32 locations: locations are not rounded to half on the way."""
    inputs = kit.make_inputs(kit.case("out_of_bounds"), dtype, location_dtype=torch.float32)
    results = kit.assert_parity(inputs, "grid_sample", "naive")
    assert [r.name for r in results][:1] == ["output"]
    # the same inputs with the locations rounded to half must be measurably worse: the dtype mattered
    rounded = dict(inputs, sampling_locations=inputs["sampling_locations"].to(dtype).float())
    exact = kit.run(kit.upcast(inputs), "naive")["output"]
    err_mixed = (kit.run(inputs, "grid_sample")["output"].double() - exact).abs().max()
    err_rounded = (kit.run(rounded, "grid_sample")["output"].double() - exact).abs().max()
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
