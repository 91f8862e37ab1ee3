"""msda_testkit.distributed under torchrun, two gloo ranks on the CPU; and its checks failing when they must."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from msda_testkit import distributed as dd
from msda_testkit import tolerance


def test_two_gloo_ranks_pass_every_check():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "msda_testkit.distributed", "--backend", "gloo"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 ranks on gloo, 3 steps" in result.stdout and "all checks passed" in result.stdout
    for check in ("devices (DDP, deterministic): 12 op tensors on cpu", "devices (FSDP2): 12 op tensors on cpu",
                  "step 2 local gradients before all-reduce: bitwise identical on 2 ranks",
                  "parameters after 3 steps: bitwise identical on 2 ranks",
                  "step 0 local gradients differ between the 2 ranks",
                  "different data vs one process: step 0 averaged gradient: 18 tensors within",
                  "different data vs one process: parameters after 3 steps: 18 tensors within", "FSDP2 vs DDP"):
        assert check in result.stdout, result.stdout


def test_identical_fails_on_one_flipped_bit():
    a = torch.randn(100)
    b = a.clone()
    b.view(torch.int32)[7] ^= 1
    assert "bitwise identical on 2 ranks" in dd.check_identical("x", [a, a.clone()])
    with pytest.raises(dd.CheckFailed, match=r"not bitwise identical across ranks; .*\{1: 1\}"):
        dd.check_identical("x", [a, b])


def test_close_fails_beyond_the_table_entry():
    tol = tolerance(torch.float32, "data_parallel")
    expected = torch.randn(1000, dtype=torch.float64).float()
    dd.check_close("g", [("w", expected * (1 + tol.rtol / 2), expected)], tol)
    with pytest.raises(dd.CheckFailed, match="g w: max abs err"):
        dd.check_close("g", [("w", expected + 3 * tol.atol * expected.abs().max(), expected)], tol)


def test_probe_sees_the_op_forward_and_backward_and_refuses_another_device():
    model = dd.new_model("cpu")
    probe = dd.DeviceProbe(model)
    shapes = torch.tensor(dd.LEVELS)
    x, ref, target = dd.batch(1, slice(None), "cpu")
    out = model(x, ref, shapes)
    with pytest.raises(dd.CheckFailed, match=r"saw \['op output'\]"):  # no backward yet
        probe.check(torch.device("cpu"), "forward only")
    F.mse_loss(out, target).backward()
    with pytest.raises(dd.CheckFailed, match="expected the op's forward and backward on meta"):
        probe.check(torch.device("meta"), "elsewhere")
    assert probe.check(torch.device("cpu"), "here") == f"{2 * dd.LAYERS} op tensors on cpu"
