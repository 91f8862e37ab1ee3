"""The Triton backend under torch.compile, CUDA graphs, torch.export and AOTInductor, and with no host sync (GPU)."""

import msda_testkit as kit
import pytest
import torch
from helpers import wrong_level_table
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code
from triton_env import gpu_only

pytestmark = gpu_only
F32, BF16 = torch.float32, torch.bfloat16
DECODER = kit.case("decoder_b4_q300")


def _layer():
    return kit.deploy.Layer(heads=8, head_dim=32)


def _layer_inputs(case=DECODER, dtype=F32, seed=0):
    return list(kit.deploy.layer_inputs(case, dtype, device="cuda", seed=seed))


def _fresh_compile():
    torch._dynamo.reset()
    counters.clear()


def test_compile_inlines_the_triton_kernels_in_inference_and_training():
    """fullgraph=True, and the generated code launches our kernels itself: the op is no opaque call."""
    layer = _layer().cuda()
    args = _layer_inputs()
    _fresh_compile()
    with torch.no_grad():
        eager = layer(*args)
        compiled, (code,) = run_and_get_code(torch.compile(layer, fullgraph=True), *args)
    assert "forward_kernel" in code and "msda.deform_attn" not in code and "_triton_forward" not in code
    kit.assert_close("output", compiled, eager, kit.tolerance(F32, "forward"))

    _fresh_compile()
    step = torch.compile(lambda *a: layer(*a).square().mean(), fullgraph=True)
    loss, codes = run_and_get_code(lambda: torch.autograd.grad(step(*args), list(layer.parameters())))
    assert any("backward_kernel" in c for c in codes) and not any("_triton_backward" in c for c in codes)
    expected = torch.autograd.grad(layer(*args).square().mean(), list(layer.parameters()))
    for got, want in zip(loss, expected):
        kit.assert_close("grad", got, want, kit.tolerance(F32, "atomic"))


def test_compiled_training_with_leaf_inputs_needs_no_copies_of_them():
    """The op alone, compiled, differentiated into leaf inputs that require grad: Inductor's analysis of the
    kernels finds they write only their outputs, so no leaf is copied into (which autograd forbids)."""
    inputs = kit.make_inputs(DECODER, F32, device="cuda")
    grad_output = kit.grad_output_for(inputs)
    _fresh_compile()
    compiled = torch.compile(lambda **kw: torch.ops.msda.deform_attn(**kw), fullgraph=True)
    leaves = {k: (v.detach().requires_grad_() if k in kit.DIFFERENTIABLE else v) for k, v in inputs.items()}
    grads = torch.autograd.grad(compiled(**leaves), [leaves[k] for k in kit.DIFFERENTIABLE], grad_output)
    expected = kit.run(inputs, "triton", grad_output)
    for name, grad in zip(kit.GRAD_NAMES, grads):
        kit.assert_close(name, grad, expected[name], kit.tolerance(F32, "atomic"))


def test_reduce_overhead_runs_a_decoder_training_step_with_no_cudagraph_skips():
    """The layer and its loss compiled with CUDA graphs (forward and backward graphs), trained under bf16
    autocast for a few steps: no graph is skipped, and the losses match eager's."""
    layer = _layer().cuda()
    optimizer = torch.optim.SGD(layer.parameters(), lr=1e-3)

    def loss_of(*args):
        return layer(*args).float().square().mean()

    _fresh_compile()
    compiled = torch.compile(loss_of, mode="reduce-overhead", fullgraph=True)
    for seed in range(4):
        args = _layer_inputs(seed=seed)
        optimizer.zero_grad()
        with torch.autocast("cuda", BF16):
            loss = compiled(*args)
            expected = loss_of(*args).detach()
        loss.backward()
        optimizer.step()
        kit.assert_close("loss", loss.detach(), expected, kit.tolerance(BF16, "forward"))
    assert counters["inductor"]["cudagraph_skips"] == 0


def test_dynamic_batch_and_queries_compile_once():
    """With batch and queries marked dynamic, new batch and query counts reuse the graph: no launch rule guards on
    them. (Marked, not dynamic=True: that would also make the level and point counts symbols, which duck sizing
    merges with an equal batch.)"""
    layer = _layer().cuda()
    counter = CompileCounterWithBackend("inductor")
    _fresh_compile()
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    with torch.no_grad():
        for batch, queries in ((2, 300), (3, 300), (4, 500), (2, 123), (5, 900)):
            case = kit.Case("dyn", batch=batch, queries=queries, heads=8, head_dim=32, levels=kit.DETR_LEVELS[2:],
                            points=4)
            args = _layer_inputs(case)
            for tensor, dims in zip(args, ((0,), (), (), (0, 1), (0, 1))):
                for dim in dims:
                    torch._dynamo.mark_dynamic(tensor, dim)
            kit.assert_close("output", compiled(*args), layer(*args), kit.tolerance(F32, "forward"))
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times"


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "training"])
def test_no_call_synchronizes_the_host(mode):
    """Under torch.cuda.set_sync_debug_mode("error") any host sync raises: none may happen in any mode, with the
    level starts passed or derived, in the forward and the backward, atomic or deterministic."""
    inputs = kit.make_inputs(DECODER, BF16, F32, device="cuda")
    grad_output = kit.grad_output_for(inputs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for starts in (inputs["level_start_index"], None):
            call = dict(inputs, level_start_index=starts)
            if mode == "training":
                for deterministic in (False, True):
                    kit.run(call, "triton", grad_output, deterministic=deterministic)
            else:
                with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
                    for _ in range(3):
                        torch.ops.msda.deform_attn(**call)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_a_wrong_level_table_on_the_gpu_reads_nothing_outside_value():
    """CUDA tables are not read on the host; a level the table places past value's end contributes nothing,
    through the public op too (helpers.wrong_level_table)."""
    inputs = kit.make_inputs(kit.case("out_of_bounds"), F32, device="cuda")
    wrong, level_0 = wrong_level_table(inputs)
    got = torch.ops.msda.deform_attn(**wrong, backend="triton")
    expected = kit.run(kit.upcast(level_0), "grid_sample")["output"]
    kit.assert_close("output", got, expected, kit.tolerance(F32, "forward"))


def test_launches_follow_the_current_stream():
    """On a side stream, the op's kernels run after that stream's earlier work: the value they read is written by
    the side stream after a long sleep, and was NaN before."""
    inputs = kit.make_inputs(DECODER, F32, device="cuda")
    expected = kit.run(dict(inputs, value=inputs["value"] * 2), "triton")["output"]
    value = torch.full_like(inputs["value"], float("nan"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # ~50 ms of the side stream's time before value is written
        value.copy_(inputs["value"] * 2)
        out = torch.ops.msda.deform_attn(**dict(inputs, value=value), backend="triton")
    side.synchronize()
    assert torch.equal(out, expected)


def test_aoti_package_runs_in_cpp_with_no_python(tmp_path):
    """torch.export -> aoti_compile_and_package -> a C++ program (msda_testkit.deploy) that loads the package
    with no Python, at a batch and query count other than the exported ones: it matches eager."""
    layer = _layer().cuda().eval()
    args = _layer_inputs()
    with torch.no_grad():
        program = torch.export.export(layer, tuple(args), dynamic_shapes=kit.deploy.dynamic_batch_and_queries())
        package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "layer.pt2"))
    runner = kit.deploy.build_aoti_runner(tmp_path)
    case = kit.Case("other", batch=3, queries=177, heads=8, head_dim=32, levels=kit.DETR_LEVELS, points=4,
                    loc_range=(-0.2, 1.2))
    other = _layer_inputs(case, seed=5)
    (got,) = kit.deploy.run_aoti_package(runner, package, other, "cuda")
    with torch.no_grad():
        expected = layer(*other).cpu()
    kit.assert_close("output", got, expected, kit.tolerance(F32, "forward"))
