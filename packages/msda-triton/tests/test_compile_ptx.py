"""compile_ptx's command line: --help and an unknown architecture answer at once, compiling nothing; and what the
compiled kernels hold."""

import os
import subprocess
import sys

import pytest
from msda_triton import compile_ptx


def test_help_prints_usage_instead_of_compiling(capsys, monkeypatch):
    monkeypatch.setattr(compile_ptx, "compile_variant", lambda *args: pytest.fail("compiled"))
    with pytest.raises(SystemExit) as exit_:
        compile_ptx.main(["--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m msda_triton.compile_ptx ")
    with pytest.raises(SystemExit) as exit_:
        compile_ptx.main(["--arch", "75"])
    assert exit_.value.code == 2


def test_loop_sizes_count_from_a_label_to_the_branch_back_to_it():
    sass = "\n".join(["--:-:-:-:1\tMOV R1, R2;", "LBB0:", "--:-:-:-:1\tIADD3 R1, R1, 1, RZ;",
                      "--:-:-:-:5\t@P0 BRA LBB1;", "--:-:-:-:1\tFADD R3, R3, R4;", "--:-:-:-:5\t@P1 BRA LBB0;",
                      "LBB1:", "--:-:-:-:1\tEXIT;", "LBB2:", "--:-:-:Y:0\tBRA LBB2;"])
    assert compile_ptx.loop_sizes(sass) == [4]  # the forward branch and the idle loop after EXIT are no loops


def test_compiled_kernels_round_the_coordinate_product_on_its_own():
    """x = loc * W - 0.5 is rounded twice, as the CUDA extension rounds it (the knot convention): the product is a
    mul.rn, never fused into an fma with -0.5 (0fBF000000). Compiled in a process without TRITON_INTERPRET, where
    kernels.ROUNDED_PRODUCT holds, whatever this test process runs under."""
    script = (
        "import re\n"
        "from msda_triton import compile_ptx\n"
        "for name, kernel, pointers, constexprs, warps in compile_ptx._variants():\n"
        "    if name in ('forward fp32 many-rows int32', 'backward bf16 fp32 few-rows', 'anchor mass fp32'):\n"
        "        ptx = compile_ptx.compile_variant(kernel, pointers, constexprs, warps, 90)\n"
        "        print(name, len(re.findall(r'mul\\.rn(?:\\.ftz)?\\.f32', ptx)),\n"
        "              len(re.findall(r'fma\\.rn(?:\\.ftz)?\\.f32[^;]*0fBF000000', ptx)))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    counts = {line.rsplit(" ", 2)[0]: tuple(map(int, line.rsplit(" ", 2)[1:])) for line in result.stdout.splitlines()}
    assert sorted(counts) == ["anchor mass fp32", "backward bf16 fp32 few-rows",
                              "forward fp32 many-rows int32"], result.stdout
    assert all(products >= 2 and fused == 0 for products, fused in counts.values()), counts
