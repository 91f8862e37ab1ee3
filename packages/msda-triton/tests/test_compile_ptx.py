"""compile_ptx's command line: --help and an unknown architecture answer at once, compiling nothing."""

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
