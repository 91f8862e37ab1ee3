"""The testkit's commands (msda-benchmarks' test_cli checks the timing tools alike): --help names the command to
type and shows no reST, every option says what it does and its default, and a CUDA device that is not there ends
in one line, not a traceback."""

import pytest
from msda_testkit import cli, distributed, verify

TOOLS = {"verify": verify, "distributed": distributed}


@pytest.mark.parametrize("name", TOOLS)
def test_help_names_the_command_and_every_option(name, capsys, monkeypatch):
    cli.assert_help_is_complete(TOOLS[name].main, f"msda_testkit.{name}", monkeypatch, capsys)


@pytest.mark.parametrize("name", ["verify"])
def test_a_cuda_device_that_is_not_there_is_one_line(name, monkeypatch):
    cli.assert_absent_cuda_is_one_line(TOOLS[name].main, f"msda_testkit.{name}", monkeypatch)


def test_a_device_torch_does_not_know_is_one_line():
    with pytest.raises(SystemExit, match="--device gpu0: not a device torch knows"):
        verify.main(["--device", "gpu0"])
