"""The op on CPU under torch.compile, torch.export and AOTInductor (the package run from C++)."""

import msda_testkit as kit
import pytest
import torch

# torch's own warnings on these valid calls (its exporter's renaming of dynamic axes, its internal
# deprecations): nothing this code can change
pytestmark = [
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

F32 = torch.float32


def _args(case="out_of_bounds", seed=0, **changes):
    return kit.deploy.layer_inputs(kit.case(case) if isinstance(case, str) else case, F32, seed=seed, **changes)


@pytest.mark.parametrize("backend", ["gather", "grid_sample"])
def test_compile_fullgraph_inference_and_training(backend):
    torch.manual_seed(0)
    layer, args = kit.deploy.Layer(heads=2, head_dim=2, backend=backend), _args()
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        kit.assert_close("output", compiled(*args), layer(*args), kit.tolerance(F32, "forward"))
    grads = torch.autograd.grad(compiled(*args).square().sum(), list(layer.parameters()))
    expected = torch.autograd.grad(layer(*args).square().sum(), list(layer.parameters()))
    for got, want in zip(grads, expected):
        kit.assert_close("grad", got, want, kit.tolerance(F32, "gradient"))


def test_export_keeps_the_public_op_and_decompositions_bake_in_the_backend():
    """The exported program holds msda.deform_attn (what the ONNX table keys on); run_decompositions replaces it
    with the backend chosen on this machine: gather's aten ops, or the opaque op naming grid_sample."""
    args = _args()
    for backend, expected in (("gather", "embedding_bag"), ("grid_sample", "msda._opaque_forward")):
        layer = kit.deploy.Layer(heads=2, head_dim=2, backend=backend)
        program = torch.export.export(layer, args, dynamic_shapes=kit.deploy.dynamic_batch_and_queries())
        before = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
        after = {str(n.target) for n in program.run_decompositions().graph.nodes if n.op == "call_function"}
        assert "msda.deform_attn.default" in before, before
        assert "msda.deform_attn.default" not in after and any(expected in t for t in after), after


def test_aoti_cpu_package_runs_in_cpp_with_no_python(tmp_path):
    """On CPU the gather backend lowers to aten ops, so AOTInductor packages the whole model: a C++ program with no
    Python runs it (msda_testkit.deploy), at a batch and query count other than the exported ones."""
    torch.manual_seed(0)
    layer, args = kit.deploy.Layer(heads=2, head_dim=2).eval(), _args()
    with torch.no_grad():
        program = torch.export.export(layer, args, dynamic_shapes=kit.deploy.dynamic_batch_and_queries())
        package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "layer.pt2"))
    runner = kit.deploy.build_aoti_runner(tmp_path)
    other = _args(kit.Case("other", batch=3, queries=17, loc_range=(-0.5, 1.5)), seed=3)
    (got,) = kit.deploy.run_aoti_package(runner, package, list(other), "cpu")
    with torch.no_grad():
        kit.assert_close("output", got, layer(*other), kit.tolerance(F32, "forward"))
