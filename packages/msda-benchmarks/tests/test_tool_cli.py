"""The timing tools: --help names the command to type, gives the whole first paragraph of the tool's docstring and
shows no reST, every option says what it does and its default, a CUDA device that is not there ends in one line,
not a traceback, and no tool leaves files behind."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from msda_benchmarks import bench, deploy_bench, locality, model_bench, overhead, peers, report, tune
from msda_testkit import cli

TOOLS = {"report": report, "bench": bench, "peers": peers, "overhead": overhead, "deploy_bench": deploy_bench,
         "model_bench": model_bench, "locality": locality,
         "tune": tune}


@pytest.mark.parametrize("name", TOOLS)
def test_help_names_the_command_and_every_option(name, capsys, monkeypatch):
    cli.assert_help_is_complete(TOOLS[name].main, f"msda_benchmarks.{name}", monkeypatch, capsys)


@pytest.mark.parametrize("name", ["report", "bench", "overhead", "deploy_bench"])
def test_a_cuda_device_that_is_not_there_is_one_line(name, monkeypatch):
    cli.assert_absent_cuda_is_one_line(TOOLS[name].main, f"msda_benchmarks.{name}", monkeypatch)


def test_a_device_torch_does_not_know_is_one_line():
    with pytest.raises(SystemExit, match="--device gpu0: not a device torch knows"):
        report.main(["--device", "gpu0"])


def test_tune_without_a_gpu_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=r"^python -m msda_benchmarks.tune: times Triton kernels on a CUDA GPU"):
        tune.main([])


def test_help_as_a_command_prints_no_warning():
    """``python -m`` of a module that its package's __init__ imports warns (runpy's RuntimeWarning), as deploy_bench
    did when the testkit held it."""
    result = subprocess.run([sys.executable, "-m", "msda_benchmarks.deploy_bench", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_deploy_bench_removes_its_temporary_folder(monkeypatch):
    folders = []

    def build(folder):
        folders.append(Path(folder))
        raise RuntimeError("stop here")

    monkeypatch.setattr(deploy_bench, "build_aoti_runner", build)
    with pytest.raises(RuntimeError, match="stop here"):
        deploy_bench.main(["--device", "cpu"])
    (folder,) = folders
    assert folder.name.startswith("msda-deploy-") and not folder.exists()
