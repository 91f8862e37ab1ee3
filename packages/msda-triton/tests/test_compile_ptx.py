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
