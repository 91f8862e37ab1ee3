"""examples/deploy.py, the README's three deploy routes on the CPU (torch.compile, AOTInductor, ONNX), and its
AOTInductor package run from C++ with no Python: the one AOTInductor build of a CI run; and the export
decomposition table. (torch.compile and torch.export of the op with each backend: the conformance suite,
test_reference_conformance.py.)"""

import contextlib
import re
import runpy
import sys
from pathlib import Path

import msda_testkit as kit
import pytest
import torch

EXAMPLE = Path(__file__).parents[3] / "examples" / "deploy.py"

# torch's own warnings on these valid calls (its exporter's renaming of dynamic axes, its internal
# deprecations): nothing this code can change
pytestmark = [
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


def test_deploy_example_routes_and_its_package_in_cpp(tmp_path, monkeypatch, capsys):
    """Each route of the example within the fp32 forward entry of eager (its atol is relative to the output's
    scale, which is what the example prints); then its package, exported with dynamic batch and queries, run by a
    C++ program with no Python (msda_testkit.deploy) at a batch and query count other than the exported ones."""
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), str(tmp_path)])
    example = runpy.run_path(str(EXAMPLE), run_name="__main__")
    printed = capsys.readouterr().out
    found = dict(re.findall(r"^(.+): max \|difference\| / max \|eager\| = (\S+)$", printed, flags=re.M))
    assert sorted(found) == ["AOTInductor", "ONNX", "torch.compile"], printed
    allowed = kit.tolerance(torch.float32, "forward")
    assert all(float(error) <= allowed.atol for error in found.values()), found

    attn, (query, reference_points, features, levels) = example["attn"], example["args"]
    g = torch.Generator().manual_seed(3)
    other = [torch.randn(3, 17, query.shape[2], generator=g), torch.rand(3, 17, *reference_points.shape[2:],
                                                                            generator=g),
             torch.randn(3, features.shape[1], features.shape[2], generator=g), levels]
    runner = kit.deploy.build_aoti_runner(tmp_path)
    (got,) = kit.deploy.run_aoti_package(runner, tmp_path / "attn.pt2", other, "cpu")
    with torch.no_grad():
        kit.assert_close("output", got, attn(*other), allowed)


F32 = torch.float32


def _args(case="out_of_bounds", seed=0, **changes):
    return kit.deploy.layer_inputs(kit.case(case) if isinstance(case, str) else case, F32, seed=seed, **changes)


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


def test_portable_makes_every_tracer_record_plain_aten_ops():
    """Under msda_core.export.portable(), torch.jit.trace (what openvino.convert_model(module) and coremltools
    trace with) and torch.export record the gather arithmetic, no msda op, and compute like eager; outside it both
    keep the op as one node (torch.export's is what AOTInductor compiles to the backend's kernels)."""
    import msda_core

    torch.manual_seed(0)
    layer, args = kit.deploy.Layer(heads=2, head_dim=2).eval(), _args()

    def traced_ops(block):
        with block, torch.no_grad():
            scripted = torch.jit.trace(layer, args, check_trace=False)
            program = torch.export.export(layer, args)
        return ({n.kind() for n in scripted.graph.nodes()} | {str(n.target) for n in program.graph.nodes}), \
            (scripted, program.module())

    kept, _ = traced_ops(contextlib.nullcontext())
    assert {"msda::deform_attn", "msda.deform_attn.default"} <= kept
    plain, modules = traced_ops(msda_core.export.portable())
    assert not any("msda" in op for op in plain) and "aten::index_select" in plain
    with torch.no_grad():
        for module in modules:
            kit.assert_close("output", module(*args), layer(*args), kit.tolerance(F32, "forward"))


def test_portable_checks_the_inputs_as_the_op_does():
    import msda_core

    inputs = kit.make_inputs(kit.EDGE_CASES[0], F32)
    inputs["attention_weights"] = inputs["attention_weights"][..., :1]
    with pytest.raises(ValueError, match="^attention_weights"), msda_core.export.portable():
        torch.ops.msda.deform_attn(**inputs)
