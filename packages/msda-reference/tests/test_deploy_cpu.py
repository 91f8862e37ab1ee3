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


def test_decomposition_table_leaves_aten_ops_of_rank_5_at_most():
    """run_decompositions(msda_core.export.decomposition_table()) leaves no msda op: the gather arithmetic in aten
    ops (index_select, not the gather backend's embedding_bag), no tensor of rank above 5 (CoreML's limit; the
    rank-6 locations enter as an input and are folded first), batch and queries still dynamic; the program runs like
    eager at a batch and query count the export did not see."""
    import msda_core

    torch.manual_seed(0)
    layer, args = kit.deploy.Layer(heads=2, head_dim=2).eval(), _args()
    program = torch.export.export(layer, args, dynamic_shapes=kit.deploy.dynamic_batch_and_queries())
    program = program.run_decompositions(msda_core.export.decomposition_table())
    nodes = [n for n in program.graph.nodes if n.op == "call_function"]
    targets = {str(n.target) for n in nodes}
    assert not any("msda" in t or "embedding_bag" in t for t in targets) and "aten.index_select.default" in targets
    ranks = {str(n.target): n.meta["val"].dim() for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    assert max(ranks.values()) <= 5, {t: r for t, r in ranks.items() if r > 5}
    other = _args(kit.Case("other", batch=3, queries=17, loc_range=(-0.5, 1.5)), seed=3)
    with torch.no_grad():
        for call in (args, other):
            kit.assert_close("output", program.module()(*call), layer(*call), kit.tolerance(F32, "forward"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_decomposition_matches_the_reference_on_every_edge_case(dtype):
    """msda_core.export.deform_attn_gather, eagerly, against the float64 reference on the same inputs: off-map and
    non-finite locations, odd head dims, one-pixel levels, no level starts, int32 tables, empty calls."""
    import msda_core

    for case in kit.EDGE_CASES:
        inputs = kit.make_inputs(case, dtype)
        got = msda_core.export.deform_attn_gather(**inputs)
        assert got.dtype == dtype
        expected = kit.reference(inputs, backward=False)["output"]
        kit.assert_close(case.name, got, expected, kit.tolerance(dtype, "forward"))
