"""Backend selection: per call, scoped, by environment variable, and auto; errors that list every backend."""

import os
import subprocess
import sys
from importlib.metadata import EntryPoint

import msda_core
import pytest
import torch
from core_inputs import tiny_inputs
from msda_core import BackendUnavailableError, output_shape, registry


def _toy(name, priority=0, dtypes=(torch.float64,), auto_devices=("cpu",), limits=None, scale=1.0,
         reproducible_on=()):
    """A backend whose output tells which backend ran: every element equals ``scale``."""
    def forward(inputs):
        return inputs.value.new_full(output_shape(inputs.value, inputs.sampling_locations), scale)

    def backward(grad, inputs, grad_accum, deterministic):
        return tuple(torch.full_like(t, scale) for t in (inputs.value, inputs.sampling_locations,
                                                          inputs.attention_weights))

    kwargs = {"limits": limits} if limits else {}
    return msda_core.Backend(name, forward, backward, devices=frozenset({"cpu"}), dtypes=frozenset(dtypes),
                             auto_devices=frozenset(auto_devices), priority=priority,
                             reproducible_on=frozenset(reproducible_on), **kwargs)


@pytest.fixture
def toys(monkeypatch):
    """A registry holding only toy backends, with one entry point that fails to import."""
    monkeypatch.setattr(registry, "_backends", {})
    monkeypatch.setattr(registry, "_lazy", {})
    monkeypatch.setattr(registry, "_load_errors", {})
    monkeypatch.setattr(registry, "_discovered", False)
    monkeypatch.setattr(registry, "_resolved", {})
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    broken = EntryPoint("broken", "msda_no_such_module_for_tests:BACKEND", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: [broken])
    for toy in (_toy("slow", priority=1, scale=1.0), _toy("fast", priority=5, scale=2.0),
                _toy("manual", priority=9, auto_devices=(), scale=3.0),
                _toy("fp32_only", priority=20, dtypes=(torch.float32,), scale=4.0)):
        msda_core.register(toy)


def _ran(**kwargs):
    return torch.ops.msda.deform_attn(**tiny_inputs(), **kwargs).flatten()[0].item()


def test_auto_takes_the_highest_priority_backend_that_supports_the_inputs(toys):
    # fp32_only (20) cannot take float64, manual (9) is never chosen by auto, fast (5) wins over slow (1)
    assert _ran() == 2.0
    assert msda_core.resolve_backend(tiny_inputs()["value"], tiny_inputs()["sampling_locations"]) == "fast"


def test_selection_is_remembered_until_the_registry_changes(toys):
    assert _ran() == 2.0
    assert len(registry._resolved) == 1  # the second call of a training step reuses the first's choice
    msda_core.register(_toy("fast", priority=5, scale=5.0))  # replaced under the same name
    assert _ran() == 5.0
    msda_core.unregister("fast")
    assert _ran() == 1.0


def test_per_call_scope_and_environment_precedence(toys, monkeypatch):
    monkeypatch.setenv("MSDA_BACKEND", "slow")
    assert _ran() == 1.0
    with msda_core.use_backend("manual"):
        assert _ran() == 3.0  # the scope beats the environment
        assert _ran(backend="fast") == 2.0  # the call beats the scope
        with msda_core.use_backend("slow"):
            assert _ran() == 1.0
        assert _ran() == 3.0
    monkeypatch.setenv("MSDA_BACKEND", "auto")
    assert _ran() == 2.0


def test_unsupported_request_lists_every_backend_and_why(toys):
    with pytest.raises(BackendUnavailableError) as info:
        _ran(backend="fp32_only")
    message = str(info.value)
    assert "'fp32_only' (asked for by the backend= argument) cannot run these inputs" in message
    assert "dtype torch.float64 not supported" in message
    for name in ("slow", "fast", "manual"):
        assert f"  {name}: supports these inputs" in message
    assert "broken: failed to import: ModuleNotFoundError" in message


def test_unknown_request_names_the_known_backends_and_where_it_came_from(toys, monkeypatch):
    known = r"expected 'auto' or one of \['broken', 'fast', 'fp32_only', 'manual', 'slow'\], got 'nope'"
    with pytest.raises(BackendUnavailableError, match=known + r" \(asked for by the backend= argument\)"):
        _ran(backend="nope")
    with msda_core.use_backend("fp32_only"), pytest.raises(BackendUnavailableError,
                                                          match="by a use_backend\\(\\) scope"):
        _ran()  # a name the scope checked, on inputs it cannot run
    monkeypatch.setenv("MSDA_BACKEND", "nope")
    with pytest.raises(BackendUnavailableError, match="by the MSDA_BACKEND environment variable"):
        _ran()


def test_a_first_party_backend_that_is_not_installed_names_its_package(toys):
    with pytest.raises(BackendUnavailableError, match="'triton' .* provided by the package msda-triton, which is not "
                                                      "installed"):
        _ran(backend="triton")


def test_backend_that_failed_to_import_raises_its_error_when_asked_by_name(toys):
    with pytest.raises(BackendUnavailableError, match="'broken' .*failed to import") as info:
        _ran(backend="broken")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    assert _ran() == 2.0  # and auto skips it quietly


def test_auto_with_no_backend_lists_all_reasons(toys):
    inp = tiny_inputs()
    inp = {k: (v.half() if v.is_floating_point() else v) for k, v in inp.items()}
    with pytest.raises(BackendUnavailableError) as info:
        torch.ops.msda.deform_attn(**inp)
    message = str(info.value)
    assert "no backend supports these inputs" in message and "value dtype=torch.float16" in message
    for name in ("slow", "fast", "manual", "fp32_only"):
        assert f"  {name}: dtype torch.float16 not supported" in message


def test_limits_add_reasons(toys):
    def limits(meta):
        return ["needs D >= 8"] if meta.head_dim < 8 else []

    msda_core.register(_toy("picky", priority=50, limits=limits))
    assert _ran() == 2.0
    with pytest.raises(BackendUnavailableError, match="needs D >= 8"):
        _ran(backend="picky")


def test_backward_runs_the_backend_requested_when_the_forward_ran(toys):
    inp = tiny_inputs()
    inp["value"].requires_grad_(True)
    with msda_core.use_backend("manual"):
        out = torch.ops.msda.deform_attn(**inp)
    (grad,) = torch.autograd.grad(out.sum(), inp["value"])
    assert grad.flatten()[0].item() == 3.0


def test_empty_batch_or_queries_return_zeros_without_a_kernel(toys):
    calls = []
    boom = _toy("boom", priority=100)
    msda_core.register(msda_core.Backend("boom", lambda *a: calls.append(a), lambda *a: calls.append(a),
                                         boom.devices, boom.dtypes, boom.auto_devices, 100))
    for B, Q in ((0, 2), (1, 0)):
        inp = tiny_inputs(B=B, Q=Q)
        for k in ("value", "sampling_locations", "attention_weights"):
            inp[k].requires_grad_(True)
        out = torch.ops.msda.deform_attn(**inp)
        assert out.shape == (B, Q, 6) and out.dtype == torch.float64
        grads = torch.autograd.grad(out.sum(), [inp["value"], inp["sampling_locations"], inp["attention_weights"]])
        for g, k in zip(grads, ("value", "sampling_locations", "attention_weights")):
            assert g.shape == inp[k].shape and not g.any()
    assert calls == []


def test_double_backward_is_a_clear_error(toys):
    inp = tiny_inputs()
    inp["value"].requires_grad_(True)
    out = torch.ops.msda.deform_attn(**inp)
    (grad,) = torch.autograd.grad(out.square().sum(), inp["value"], create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        grad.sum().backward()


def test_deterministic_request_refuses_backends_whose_backward_is_not(toys):
    """The forward and the backward run one backend, so a call that needs reproducible gradients is refused
    before its forward, and auto passes over backends that cannot give them."""
    msda_core.register(_toy("steady", priority=2, scale=5.0, reproducible_on=("cpu",)))
    inp = tiny_inputs()
    assert _ran(backend="fast", deterministic=True) == 2.0  # no gradient needed: any backend will do
    inp["value"].requires_grad_(True)
    refused = "'fast' .*cannot run .*its backward is not deterministic on 'cpu'"
    with pytest.raises(BackendUnavailableError, match=refused):
        torch.ops.msda.deform_attn(**inp, backend="fast", deterministic=True)
    torch.use_deterministic_algorithms(True)
    try:
        out = torch.ops.msda.deform_attn(**inp)  # None follows torch: auto skips to "steady"
        (grad,) = torch.autograd.grad(out.sum(), inp["value"])
    finally:
        torch.use_deterministic_algorithms(False)
    assert out.flatten()[0].item() == 5.0 and grad.flatten()[0].item() == 5.0


def test_use_backend_scopes_belong_to_their_thread(toys):
    """A scope entered in one thread does not change what another thread's calls ask for."""
    import threading
    entered, release, seen = threading.Event(), threading.Event(), {}

    def scoped():
        with msda_core.use_backend("manual"):
            seen["inside"] = _ran()
            entered.set()
            release.wait(5)

    worker = threading.Thread(target=scoped)
    worker.start()
    assert entered.wait(5)
    try:
        seen["other thread"] = _ran()
    finally:
        release.set()
        worker.join()
    assert seen == {"inside": 3.0, "other thread": 2.0}


def test_discovery_from_several_threads_at_once_sees_every_backend(monkeypatch):
    """Threads that make their first calls together all see the whole registry, never a half-loaded one."""
    import threading
    import time

    class SlowEntryPoint:
        def __init__(self, name):
            self.name = name

        def load(self):
            time.sleep(0.02)
            return _toy(self.name)

    names = [f"slow{i}" for i in range(5)]
    monkeypatch.setattr(registry, "_backends", {})
    monkeypatch.setattr(registry, "_lazy", {})
    monkeypatch.setattr(registry, "_load_errors", {})
    monkeypatch.setattr(registry, "_discovered", False)
    monkeypatch.setattr(registry, "_resolved", {})
    monkeypatch.setattr(registry, "entry_points", lambda group: [SlowEntryPoint(n) for n in names])
    start, seen = threading.Barrier(8), []

    def first_call():
        start.wait()
        seen.append(sorted(msda_core.backends()))

    threads = [threading.Thread(target=first_call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [names] * 8


def test_a_bad_name_is_refused_where_it_is_given(toys):
    """use_backend("nope") was accepted until the first call, whose error blamed the call."""
    with pytest.raises(ValueError, match=r"^name: expected 'auto' or one of \['broken', 'fast', 'fp32_only', "
                                         r"'manual', 'slow'\], got 'nope'"):
        with msda_core.use_backend("nope"):
            pass
    with pytest.raises(ValueError, match="triton is provided by msda-triton, which is not installed"):
        msda_core.use_backend("triton").__enter__()
    with msda_core.use_backend("broken"):  # a name whose import failed is known: its error comes with a call
        with pytest.raises(BackendUnavailableError, match="failed to import"):
            _ran()


def test_a_scope_exited_in_another_thread_ends_everywhere(toys):
    """Exiting a use_backend block from another thread raised there and left the scope active in the first."""
    import threading
    scope = msda_core.use_backend("manual")
    scope.__enter__()
    assert _ran() == 3.0
    errors = []

    def close():
        try:
            scope.__exit__(None, None, None)
        except Exception as err:
            errors.append(err)

    worker = threading.Thread(target=close)
    worker.start()
    worker.join()
    assert errors == [] and _ran() == 2.0
    with msda_core.use_backend("slow"):  # later scopes in this thread still nest
        assert _ran() == 1.0
    assert _ran() == 2.0


def test_a_lazy_backend_is_imported_only_when_a_call_may_run_it(toys, monkeypatch):
    """A LazyBackend entry point (msda-triton's) is imported when asked for by name, or when auto considers a device
    in its auto_devices; auto on another device, and calls asking for another backend, never import it."""
    loads = []

    def load(self):
        loads.append(self.name)
        return _toy(self.name, priority=50, scale=6.0)

    monkeypatch.setattr(registry.LazyBackend, "load", load)
    msda_core.register(registry.LazyBackend("lazy_gpu", "unused:BACKEND", auto_devices=frozenset({"cuda"}),
                                            priority=50))
    msda_core.register(registry.LazyBackend("lazy_cpu", "unused:BACKEND", auto_devices=frozenset({"cpu"}),
                                            priority=50))
    with msda_core.use_backend("lazy_gpu"):  # the name is known without importing it
        assert loads == []
    assert _ran(backend="fast") == 2.0 and loads == []
    assert _ran() == 6.0 and loads == ["lazy_cpu"]  # auto on cpu imports the one that lists cpu, and runs it
    assert _ran(backend="lazy_gpu") == 6.0 and loads == ["lazy_cpu", "lazy_gpu"]
    assert sorted(msda_core.backends()) == ["fast", "fp32_only", "lazy_cpu", "lazy_gpu", "manual", "slow"]


def test_a_lazy_backend_that_fails_to_import_is_as_a_broken_entry_point(toys):
    msda_core.register(registry.LazyBackend("lazy_broken", "msda_no_such_module_for_tests:BACKEND",
                                            auto_devices=frozenset({"cpu"})))
    assert _ran() == 2.0  # auto tried it, skipped it
    with pytest.raises(BackendUnavailableError, match="'lazy_broken' .*failed to import"):
        _ran(backend="lazy_broken")


FORK_AFTER_THREAD = """
import os, sys, threading, time
import torch, msda_core
from msda_core import registry

holding, release = threading.Event(), threading.Event()

def hold():  # as discovery, a registration or a lazy backend's import does
    with registry._lock:
        holding.set()
        release.wait()

threading.Thread(target=hold, daemon=True).start()
holding.wait()
pid = os.fork()
if pid == 0:  # the child: one call with shapes no call had (a miss of the memo takes the lock)
    value = torch.rand(1, 30, 2, 4)
    out = msda_core.deform_attn(value, torch.tensor([(5, 6)]), None, torch.rand(1, 3, 2, 1, 2, 2),
                                torch.rand(1, 3, 2, 1, 2))
    os._exit(0 if out.shape == (1, 3, 8) else 1)
deadline = time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        release.set()
        sys.exit(f"child exit status {os.waitstatus_to_exitcode(status)}" if status else 0)
    time.sleep(0.05)
os.kill(pid, 9)
os.waitpid(pid, 0)
sys.exit("the child was still blocked")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_while_another_thread_holds_the_registry_lock_leaves_a_working_child():
    """DataLoader workers and multiprocessing pools fork. A fork taken while another thread held the registry's lock
    (discovery, registration, a lazy backend's import, a miss of the selection memo) left the child blocked at its
    first call with new shapes: the child's copy of the lock was held by a thread the child does not have."""
    result = subprocess.run([sys.executable, "-c", FORK_AFTER_THREAD, "20"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
