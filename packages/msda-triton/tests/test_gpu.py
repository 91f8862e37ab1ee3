"""What only a GPU can show: realistic shapes, 64-bit offsets, other devices, graph capture, compile."""

from dataclasses import replace

import msda_core
import msda_testkit as kit
import pytest
import torch
from helpers import CROWDED, VARIANTS, _id, assert_triton_parity
from msda_triton import backend, compile_ptx, kernels, launcher
from triton_env import gpu_only

pytestmark = gpu_only
F16, F32 = torch.float16, torch.float32


@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
@pytest.mark.parametrize("case", kit.STANDARD_CASES[:2], ids=lambda c: c.name)
def test_standard_shapes_match_float64(case, variant):
    dtype, loc_dtype, grad_accum = variant
    assert_triton_parity(kit.make_inputs(case, dtype, loc_dtype, device="cuda"), grad_accum)


@pytest.mark.parametrize("head_dim", [1024, 1025, 2048])
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_large_head_dims(head_dim, dtype):
    case = kit.with_head_dim(kit.case("out_of_bounds"), head_dim)
    assert_triton_parity(kit.make_inputs(case, dtype, device="cuda"), "auto")


@pytest.mark.parametrize("head_dim", [64, 71])
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_many_rows_with_wide_heads(head_dim, dtype):
    """The forward's many-rows shape with D > 32 (8 warps; two channel blocks at 71): 2^17 rows."""
    case = kit.Case("many_rows", batch=2, queries=8192, heads=8, head_dim=head_dim, levels=((6, 4), (3, 2)),
                    loc_range=(-0.5, 1.5))
    rows = case.batch * case.queries * case.heads
    assert rows >= kernels.FEW_ROWS and kernels.launch_config(head_dim, backward=False) == (
        {"BLOCK_R": 32, "BLOCK_P": 1, "BLOCK_D": 64, "HEAD_MAJOR": True}, 8)
    assert_triton_parity(kit.make_inputs(case, dtype, device="cuda"), "auto")


def test_auto_picks_triton_on_cuda():
    inputs = kit.make_inputs(kit.case("tiny"), F32, device="cuda")
    assert msda_core.resolve_backend(inputs["value"], inputs["sampling_locations"]) == "triton"


@pytest.mark.parametrize("dtype", [F32, F16])
def test_misaligned_inputs_after_aligned_ones_of_the_same_shapes(dtype):
    """A launch is replayed for tensors of the same key (launcher.key). The kernels compiled for 16-byte
    aligned tensors use 16-byte loads, so tensors starting one element later must get kernels of their own."""
    inputs = kit.make_inputs(kit.case("out_of_bounds"), dtype, device="cuda")
    assert_triton_parity(inputs, "fp32")
    shifted = dict(inputs)
    for name in ("value", "sampling_locations", "attention_weights"):
        storage = torch.empty(inputs[name].numel() + 1, dtype=dtype, device="cuda")
        shifted[name] = storage[1:].view(inputs[name].shape).copy_(inputs[name])
        assert shifted[name].data_ptr() % 16 != 0
    assert_triton_parity(shifted, "fp32")


@pytest.mark.parametrize("deterministic", [False, True])
def test_replayed_launches_read_the_new_tensors(deterministic):
    """A second call with the same shapes launches every kernel through the first call's plan
    (launcher.launch), on its own tensors: its results match float64 for its own inputs."""
    case = replace(kit.case("out_of_bounds"), queries=37)  # a shape no other test launches
    first, second = (kit.make_inputs(case, F32, device="cuda", seed=seed) for seed in (0, 1))
    launcher._plans.clear()
    kit.run(first, "triton", kit.grad_output_for(first), deterministic=deterministic)
    plans = dict(launcher._plans)
    assert len(plans) == (4 if deterministic else 2)  # forward, backward (+ anchor mass, finish)
    assert_triton_parity(second, "auto", deterministic=deterministic)
    assert launcher._plans == plans  # nothing derived again


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_a_replayed_launch_gives_the_bits_of_a_plain_one(dtype, monkeypatch):
    """Every kernel of a deterministic forward+backward, launched through the JIT with the replay off and then
    replayed from a plan (launcher.launch says it ran one): the same bits."""
    inputs = kit.make_inputs(replace(kit.case("out_of_bounds"), queries=41), dtype, device="cuda")
    grad_output = kit.grad_output_for(inputs)
    monkeypatch.setattr(launcher, "ENABLED", False)
    plain = kit.run(inputs, "triton", grad_output, deterministic=True)
    monkeypatch.setattr(launcher, "ENABLED", True)
    launcher._plans.clear()
    kit.run(inputs, "triton", grad_output, deterministic=True)  # leaves the plans
    replayed = []
    monkeypatch.setattr(launcher, "_plans", {k: launcher._Plan(_counting(plan.runner, replayed), plan.trailing)
                                             for k, plan in launcher._plans.items()})
    again = kit.run(inputs, "triton", grad_output, deterministic=True)
    assert len(replayed) == 4  # forward, anchor mass, backward, finish
    for name in plain:
        assert torch.equal(kit.replay.bits(plain[name]), kit.replay.bits(again[name])), name


def _counting(runner, calls: list):
    def run(*args):
        calls.append(args)
        return runner(*args)
    return run


def test_offsets_past_2_pow_31():
    """value has 2.4e9 elements: batch 1's pixels sit past 2^31; its results must match batch 1 alone."""
    B, H, W, M, D, Q, P = 2, 768, 768, 1, 2048, 64, 4
    assert B * H * W * M * D > 2 ** 31
    g = torch.Generator(device="cuda").manual_seed(0)
    value = torch.randn(B, H * W, M, D, device="cuda", dtype=F16, generator=g)
    loc = 0.9 + 0.1 * torch.rand(B, Q, M, 1, P, 2, device="cuda", generator=g)  # the far corner of the map
    inputs = {"value": value, "spatial_shapes": torch.tensor([[H, W]], device="cuda"), "level_start_index": None,
              "sampling_locations": loc.to(F16), "attention_weights": torch.rand(B, Q, M, 1, P, device="cuda",
                                                                                generator=g).to(F16)}
    grad_output = kit.grad_output_for(inputs)
    full = kit.run(inputs, "triton", grad_output, grad_accum="native")
    last = {k: (v[1:] if v is not None and k != "spatial_shapes" else v) for k, v in inputs.items()}
    alone = kit.run(last, "triton", grad_output[1:].contiguous(), grad_accum="native")
    del inputs, value
    for name in alone:
        assert torch.equal(full[name][1:].isnan(), alone[name].isnan()), name
        kit.assert_close(name, full[name][1:], alone[name], kit.tolerance(F16, "atomic"))
    assert full["output"][1].abs().sum() > 0


@pytest.mark.parametrize("dtype, Q, blocks", [(F32, 2048, (4, 2, False)), (torch.bfloat16, 2048, (4, 4, False)),
                                             (F32, 16384, (32, 1, True))])
def test_forward_offsets_past_2_pow_31(dtype, Q, blocks):
    """value has 2.2e9 elements: batch 1's heads sit past 2^31, and its output must equal batch 1's alone, bit
    for bit, under each of kernels.launch_config's rules for the forward: (BLOCK_R, BLOCK_P, HEAD_MAJOR). Both
    calls take int64 offsets (backend.needs_int64_offsets)."""
    B, H, W, M, D, P = 2, 2048, 2100, 8, 32, 4
    assert B * H * W * M * D > 2 ** 31
    for rows in (B * Q * M, Q * M):  # the full batch and batch 1 alone
        chosen = kernels.launch_config(D, backward=False, value_fp32=dtype == F32, few_rows=rows < kernels.FEW_ROWS)[0]
        assert (chosen["BLOCK_R"], chosen["BLOCK_P"], chosen["HEAD_MAJOR"]) == blocks
    g = torch.Generator(device="cuda").manual_seed(0)
    value = torch.randn(B, H * W, M, D, device="cuda", generator=g, dtype=dtype)
    shapes, starts = torch.tensor([[H, W]], device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda")
    loc = (0.9 + 0.1 * torch.rand(B, Q, M, 1, P, 2, device="cuda", generator=g)).to(dtype)  # the map's far corner
    weights = torch.rand(B, Q, M, 1, P, device="cuda", generator=g).to(dtype)
    full = backend.forward(msda_core.Inputs(value, shapes, starts, loc, weights))
    alone = backend.forward(msda_core.Inputs(value[1:], shapes, starts, loc[1:], weights[1:]))
    assert torch.equal(full[1:], alone) and alone.abs().sum() > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_second_device():
    inputs = kit.make_inputs(kit.case("out_of_bounds"), F32, device="cuda:1")
    on_1 = kit.run(inputs, "triton")["output"]
    assert on_1.device == torch.device("cuda:1")
    on_0 = kit.run({k: (v.to("cuda:0") if v is not None else v) for k, v in inputs.items()}, "triton")["output"]
    assert torch.equal(on_1.cpu(), on_0.cpu())


def test_cuda_graph_capture_of_forward_and_backward():
    case = kit.case("decoder_b4_q300")
    static = kit.make_inputs(case, F32, device="cuda")
    grad_output = kit.grad_output_for(static)
    leaves = [static[k].requires_grad_() for k in ("value", "sampling_locations", "attention_weights")]

    def step():
        out = torch.ops.msda.deform_attn(**static, backend="triton")
        return (out, *torch.autograd.grad(out, leaves, grad_output))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    fresh = kit.make_inputs(case, F32, device="cuda", seed=7)
    with torch.no_grad():
        for k in ("value", "sampling_locations", "attention_weights"):
            static[k].copy_(fresh[k])
    graph.replay()
    torch.cuda.synchronize()
    expected = kit.run(fresh, "triton", grad_output)
    assert torch.equal(captured[0], expected["output"])
    for got, name in zip(captured[1:], kit.GRAD_NAMES):
        kit.assert_close(name, got, expected[name], kit.tolerance(F32, "atomic"))


def test_compile_fullgraph():
    inputs = kit.make_inputs(kit.case("decoder_b4_q300"), torch.bfloat16, device="cuda")
    value = inputs["value"].requires_grad_()

    def layer(value):
        rest = {k: v for k, v in inputs.items() if k != "value"}
        return torch.ops.msda.deform_attn(value * 2, **rest).float().square().mean()

    eager = layer(value)
    (eager_grad,) = torch.autograd.grad(eager, value)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)(value)
    (compiled_grad,) = torch.autograd.grad(compiled, value)
    kit.assert_close("loss", compiled, eager, kit.tolerance(F32, "forward"))
    kit.assert_close("grad_value", compiled_grad, eager_grad, kit.tolerance(torch.bfloat16, "atomic"))


def _forward_backward(grad_output, **op_kwargs):
    return lambda **inputs: kit.run(inputs, "triton", grad_output, **op_kwargs)


def test_negative_control_atomics_differ_between_replays():
    """The replay check must be able to see nondeterminism: fp32 atomics on a crowded map do differ."""
    inputs = kit.make_inputs(replace(CROWDED, queries=20000, head_dim=32), F32, device="cuda")
    grad_output = kit.grad_output_for(inputs)
    with pytest.raises(AssertionError, match="grad_value: .* elements differ"):
        kit.assert_replays_bit_exact(_forward_backward(grad_output, grad_accum="native"), inputs, replays=10,
                                     contention=True)


@pytest.mark.parametrize("dtype", [F32, F16, torch.bfloat16])
@pytest.mark.parametrize("case", [replace(CROWDED, queries=20000, head_dim=32), kit.case("encoder_b2")],
                         ids=lambda c: c.name)
def test_deterministic_mode_replays_bit_exact(case, dtype):
    inputs = kit.make_inputs(case, dtype, device="cuda")
    grad_output = kit.grad_output_for(inputs)
    kit.assert_replays_bit_exact(_forward_backward(grad_output, deterministic=True), inputs, replays=10,
                                 contention=True)


def test_deterministic_request_refuses_grid_sample_on_cuda():
    inputs = kit.make_inputs(kit.case("tiny"), F32, device="cuda")
    with pytest.raises(msda_core.BackendUnavailableError, match="its backward is not deterministic on 'cuda'"):
        kit.run(inputs, "grid_sample", kit.grad_output_for(inputs), deterministic=True)


def test_kernels_fuse_multiply_adds_whatever_tritons_default(monkeypatch):
    """kernels.COMPILE_OPTIONS asks for FP fusion: with Triton's default off (3.10's), the fp32 forward still
    compiles to FMAs, and without the options it would not."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    fp32_forward = next(v[1:] for v in compile_ptx._variants() if v[0].startswith("forward fp32"))
    assert "fma.rn.f32" in compile_ptx.compile_variant(*fp32_forward, arch=90)
    monkeypatch.setattr(kernels, "COMPILE_OPTIONS", {})
    assert "fma.rn.f32" not in compile_ptx.compile_variant(*fp32_forward, arch=90)
