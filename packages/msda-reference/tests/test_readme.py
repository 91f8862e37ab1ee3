"""The README's recipes as written (issue 31): every ```python block of README.md runs, or is listed here with why it
cannot run in CI and what covers it instead; the quickstart example runs as a script (examples/deploy.py: in
test_deploy_cpu.py, with the C++ run of its package)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[3]
README = ROOT / "README.md"

# A block is known by a line it holds -> None (it runs as written) or why it does not run here.
BLOCKS = {
    "import msda_core  # registers torch.ops.msda.deform_attn": None,
    "torch._inductor.aoti_compile_and_package(program": "a fragment (model and args are the reader's): "
                                                        "examples/deploy.py runs the route (test_deploy_cpu.py)",
    "DeformableDetrForObjectDetection.from_pretrained": "downloads a checkpoint: integrations/ patches tiny "
                                                        "transformers models (nox -s integrations)",
    "ultralytics.RTDETR(": "downloads a checkpoint and an image: integrations/ patches RT-DETR-l (nox -s integrations)",
    "from msda_core.nn import MSDeformAttn    # in place": "a fragment (weights is the reader's checkpoint): "
                                                           "msda-core's test_module loads published checkpoints",
    "from msda_core.compat import MSDeformAttnFunction": "a fragment (the tensors are the caller's): msda-core's "
                                                         "test_compat runs every function",
    "msda_core.compat.install_extension_shim()": "needs Deformable DETR's repository: msda-core's test_compat runs "
                                                 "its calls through the shim",
    "install_extension_shim(mmcv=True)": "needs mmcv and mmdet: integrations/test_mmdet.py builds mmdet's DINO and "
                                         "Deformable DETR through the shim (nox -s integrations)",
    "use_kernel_mapping(msda_core.hub.mapping())": "a fragment (model is the reader's) that needs the kernels "
                                                   "package: integrations/test_kernels.py runs it on a transformers "
                                                   "model (nox -s integrations)",
}


def _blocks() -> list:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def _key(block: str) -> str:
    keys = [key for key in BLOCKS if key in block]
    assert len(keys) == 1, f"README block matched by {keys}: list it in BLOCKS (run it, or say why not)\n{block}"
    return keys[0]


def test_every_block_is_listed():
    assert sorted(_key(block) for block in _blocks()) == sorted(BLOCKS)


@pytest.mark.parametrize("key", list(BLOCKS), ids=lambda key: key.split("(")[0][:40])
def test_block_runs_as_written(key):
    if BLOCKS[key] is not None:
        pytest.skip(BLOCKS[key])
    (block,) = [b for b in _blocks() if key in b]
    exec(compile(block, f"README.md block {key!r}", "exec"), {})


def test_quickstart_example_runs_and_warns_of_nothing():
    """As ci/quickstart runs it, NumPy installed (here through onnxruntime): the output is its one line, with no
    warning (torch's import warned "Failed to initialize NumPy" where NumPy was absent)."""
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "output (2, 100, 256) torch.float32 from backend 'gather'\n", result.stdout
    assert result.stderr == "", result.stderr


def test_onnx_recipe_needs_only_import_msda_core():
    """msda_core.onnx.translation_table() raised AttributeError after a plain `import msda_core` (a fresh process:
    here other tests have imported msda_core.onnx already)."""
    script = "import msda_core, torch; assert torch.ops.msda.deform_attn.default in msda_core.onnx.translation_table()"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
