"""msda_core.compat.install_extension_shim against the code that imports the compiled extensions: mmcv's own
``mmcv.ops`` (2.x, and 1.7 in the session's second pass), a BEVFormer-style Function on mmcv's ``ext_loader``,
GroundingDINO's ``_C`` calls, and a compiled module that is installed but does not import. conftest.py installs
the shim (mmcv=True) before anything imports mmcv.ops, as a user's first line does. Float64 on the CPU: each
result against the grid_sample backend's float64 reference of the same inputs (kit.reference)."""

import subprocess
import sys
import textwrap

import msda_core
import msda_testkit as kit
import pytest
import torch
from equivalence import Recording, Result
from msda_core import compat
from msda_core.adapters import shims

FORWARD, GRADIENT = kit.tolerance(torch.float64, "forward"), kit.tolerance(torch.float64, "gradient")


def _check_function(function, *extra) -> Result:
    """``function.apply(value, shapes, starts, locations, weights, *extra)`` and its three gradients against the
    reference, with msda's calls counted: a call that did not reach msda would count none."""
    inputs = kit.make_inputs(kit.case("out_of_bounds"), torch.float64)
    expected = kit.reference(inputs)
    leaves = {k: (v.detach().requires_grad_() if k in kit.DIFFERENTIABLE else v) for k, v in inputs.items()}
    with Recording() as recording, msda_core.use_backend(recording.name):
        output = function.apply(*(leaves[arg] for arg in kit.ARGUMENTS), *extra)
        grads = torch.autograd.grad(output, [leaves[k] for k in kit.DIFFERENTIABLE], kit.grad_output_for(inputs))
    assert (recording.calls, recording.backward_calls) == (1, 1)
    output_error = kit.assert_close("output", output, expected["output"], FORWARD).max_rel_err
    gradient_error = max(kit.assert_close(name, grad, expected[name], GRADIENT).max_rel_err
                         for name, grad in zip(kit.GRAD_NAMES, grads))
    return Result(["shim"], output_error, gradient_error, recording.calls, recording.min_knot_distance, "-")


def test_mmcv_ext_is_msda_and_mmcv_ops_imports(record):
    import mmcv
    import mmcv.ops
    from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttnFunction

    ext = sys.modules["mmcv._ext"]
    assert ext.ms_deform_attn_forward is shims._ms_deform_attn_forward, mmcv.__version__
    assert ext.ms_deform_attn_backward is shims._mmcv_ms_deform_attn_backward
    # mmcv's own Function (its CUDA branch's code, here on CPU tensors): forward, then a backward that allocates
    # three zero tensors and has ext_module fill them in place
    record(f"mmcv {mmcv.__version__} Function", _check_function(MultiScaleDeformableAttnFunction, 64))
    assert isinstance(mmcv.ops.MultiScaleDeformableAttention(embed_dims=32, num_heads=2),
                      mmcv.ops.multi_scale_deform_attn.MultiScaleDeformableAttention)  # mmcv's class, kept


def test_other_mmcv_ops_raise_a_clear_error():
    from mmcv.ops import get_compiler_version, nms

    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
    with pytest.raises(NotImplementedError, match="mmcv op 'nms': msda's stand-in for mmcv._ext provides only "
                                                  "multi-scale deformable attention"):
        nms(boxes, torch.tensor([0.9, 0.8]), 0.5)
    assert get_compiler_version().startswith("n/a")  # mmcv.utils.collect_env reads it


class _BEVFormerFunction(torch.autograd.Function):
    """BEVFormer's MultiScaleDeformableAttnFunction_fp32 calling convention (mmcv 1.x lineage): mmcv's ext_loader,
    inputs cast to fp32 under CUDA autocast, mmcv's in-place backward."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def forward(ctx, value, shapes, starts, locations, weights, im2col_step):
        from mmcv.utils import ext_loader
        ext = ext_loader.load_ext("_ext", ["ms_deform_attn_backward", "ms_deform_attn_forward"])
        ctx.im2col_step = im2col_step
        ctx.save_for_backward(value, shapes, starts, locations, weights)
        return ext.ms_deform_attn_forward(value, shapes, starts, locations, weights, im2col_step=ctx.im2col_step)

    @staticmethod
    @torch.autograd.function.once_differentiable
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_output):
        from mmcv.utils import ext_loader
        ext = ext_loader.load_ext("_ext", ["ms_deform_attn_backward", "ms_deform_attn_forward"])
        value, shapes, starts, locations, weights = ctx.saved_tensors
        grad_value, grad_locations, grad_weights = (torch.zeros_like(t) for t in (value, locations, weights))
        ext.ms_deform_attn_backward(value, shapes, starts, locations, weights, grad_output.contiguous(), grad_value,
                                    grad_locations, grad_weights, im2col_step=ctx.im2col_step)
        return grad_value, None, None, grad_locations, grad_weights, None


def test_bevformer_function_runs_on_the_mmcv_shim(record):
    import mmcv
    record(f"BEVFormer-style on mmcv {mmcv.__version__}", _check_function(_BEVFormerFunction, 64))


class _GroundingDinoFunction(torch.autograd.Function):
    """GroundingDINO's MultiScaleDeformableAttnFunction calling convention: its package's ``_C``, positional
    arguments, a backward returning the three gradients."""

    @staticmethod
    def forward(ctx, value, shapes, starts, locations, weights, im2col_step):
        from groundingdino import _C
        ctx.im2col_step = im2col_step
        ctx.save_for_backward(value, shapes, starts, locations, weights)
        return _C.ms_deform_attn_forward(value, shapes, starts, locations, weights, ctx.im2col_step)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        from groundingdino import _C
        grad_value, grad_locations, grad_weights = _C.ms_deform_attn_backward(*ctx.saved_tensors, grad_output,
                                                                              ctx.im2col_step)
        return grad_value, None, None, grad_locations, grad_weights, None


@pytest.fixture
def fresh_modules(monkeypatch):
    """The names these tests register, out of sys.modules before and after: the Deformable DETR extension name
    (conftest's stand-in restored after) and the fake groundingdino package. Nothing else is removed: a module
    imported for the first time during the test (numpy's, torch's) cannot be loaded twice."""
    monkeypatch.delitem(sys.modules, "MultiScaleDeformableAttention", raising=False)
    yield
    for name in [n for n in sys.modules if n in ("MultiScaleDeformableAttention", "groundingdino")
                 or n.startswith("groundingdino.")]:
        del sys.modules[name]


def test_groundingdino_c_installed_without_its_build(tmp_path, monkeypatch, fresh_modules, record):
    """GroundingDINO installed from source with its CUDA build skipped: the package, no ``_C``."""
    (tmp_path / "groundingdino").mkdir()
    (tmp_path / "groundingdino" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert compat.install_extension_shim(groundingdino=True) == ["MultiScaleDeformableAttention", "groundingdino._C"]
    record("GroundingDINO _C", _check_function(_GroundingDinoFunction, 64))


def test_a_broken_build_is_replaced_with_a_warning_naming_its_error(tmp_path, monkeypatch, fresh_modules, record):
    """Installed compiled modules that fail to import, as a build for another torch or CUDA does: real files on a
    tmp sys.path, raising on import the errors such builds raise."""
    (tmp_path / "groundingdino").mkdir()
    (tmp_path / "groundingdino" / "__init__.py").write_text("")
    (tmp_path / "groundingdino" / "_C.py").write_text(
        "raise ImportError('_C.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n")
    (tmp_path / "MultiScaleDeformableAttention.py").write_text(
        "raise ImportError('libcudart.so.12: cannot open shared object file: No such file or directory')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(RuntimeWarning) as warned:
        assert compat.install_extension_shim(groundingdino=True) == ["MultiScaleDeformableAttention",
                                                                     "groundingdino._C"]
    messages = [str(w.message) for w in warned]
    assert any("MultiScaleDeformableAttention is installed but does not import (ImportError: libcudart.so.12" in m
               for m in messages), messages
    assert any("groundingdino._C is installed but does not import (ImportError: _C.so: undefined symbol" in m
               for m in messages), messages
    record("broken groundingdino._C", _check_function(_GroundingDinoFunction, 64))
    import MultiScaleDeformableAttention as MSDA
    assert MSDA.ms_deform_attn_backward is shims._ms_deform_attn_backward


@pytest.mark.parametrize("first", ["import mmcv.cnn.bricks.transformer", "import mmcv.ops"])
def test_the_mmcv_shim_refuses_to_come_after_mmcv_ops(first):
    """In a fresh process: mmcv.cnn.bricks.transformer swallows the failed import of mmcv.ops and goes on without
    MultiScaleDeformableAttention; or mmcv.ops was imported over the stand-in, then the stand-in removed."""
    script = textwrap.dedent(f"""
        import sys, warnings
        warnings.simplefilter("ignore")
        from msda_core import compat
        if {first!r} == "import mmcv.ops":
            compat.install_extension_shim(mmcv=True)
            import mmcv.ops
            del sys.modules["mmcv._ext"]
        else:
            {first}
        try:
            compat.install_extension_shim(mmcv=True)
        except RuntimeError as error:
            print(error)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert "install_extension_shim(mmcv=True) was called too late" in result.stdout, result.stdout + result.stderr
    assert "Call it before `import mmcv.ops`" in result.stdout
