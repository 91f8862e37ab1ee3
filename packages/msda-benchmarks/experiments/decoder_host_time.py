"""``python experiments/decoder_host_time.py`` (from packages/msda-benchmarks) (GPU): host time of the decoder B4
Q300 op called from Python.

Sections, all unless some are named on the command line: ``replay``, the launch replay on and off by turns
(msda_triton.launcher.ENABLED, 6 rounds of 1000 calls, medians); ``layers``, the op with its layers peeled off
one at a time beside each peer that ``python -m msda_benchmarks.peers`` finds installed (fp32, the same loops,
taking turns), also with the backward on the calling thread, and where a bare Function's call spends its time;
``profile``, a cProfile of forward+grad (its top functions, then its self time per call summed by package; from
Python 3.12 cProfile also sees the backward that autograd's device thread runs) and a torch.profiler breakdown;
``compile``, torch.compile's figure beside eager's (BENCHMARKS.md, "The decoder call from Python")."""
import collections
import cProfile
import pstats
import statistics
import sys
import threading
import time

import msda_testkit as kit
import torch
from msda_benchmarks.bench import GPU_CASES
from msda_benchmarks.peers import installed_peers
from msda_core import op as core_op
from msda_core import registry
from msda_triton import backend as triton_backend
from msda_triton import launcher

N = 1000
SECTIONS = set(sys.argv[1:]) or {"replay", "layers", "profile", "compile"}  # which parts run


def host_ms(fn, n=N):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def calls(dtype):
    inputs = kit.make_inputs(GPU_CASES[0], dtype, device="cuda")
    leaves = {k: (v.detach().requires_grad_() if k in kit.DIFFERENTIABLE else v) for k, v in inputs.items()}
    g = kit.grad_output_for(inputs)
    diff = [leaves[k] for k in kit.DIFFERENTIABLE]

    def fwd():
        return torch.ops.msda.deform_attn(**leaves)

    def both():
        return torch.autograd.grad(fwd(), diff, g)
    return fwd, both, leaves, diff, g


if "replay" in SECTIONS:
    for dtype in (torch.float32, torch.bfloat16):
        fwd, both, *_ = calls(dtype)
        for fn in (fwd, both):
            fn()
        res = {(on, name): [] for on in (True, False) for name in ("fwd", "both")}
        for _ in range(6):
            for on in (True, False):
                launcher.ENABLED = on
                res[(on, "fwd")].append(host_ms(fwd))
                res[(on, "both")].append(host_ms(both))
        launcher.ENABLED = True
        for name in ("fwd", "both"):
            on, off = (statistics.median(res[(o, name)]) for o in (True, False))
            print(f"replay {str(dtype)[6:]:9s} {name:5s} on {on:.4f} off {off:.4f} ms  saves {1 - on / off:.0%}",
                  flush=True)

fwd, both, leaves, diff, g = calls(torch.float32)
inputs = registry.Inputs(*(leaves[k] for k in kit.ARGUMENTS))
chosen = core_op._BackendCall(registry.get("triton"), "auto", False)
stamps = []  # perf_counter() at the entry and the exit of Bare.backward, wherever autograd runs it


class Bare(torch.autograd.Function):
    """The least an autograd.Function over the backend's bodies does: where the op's layers end."""

    @staticmethod
    def forward(ctx, *tensors):
        ctx.save_for_backward(*tensors)
        return triton_backend._forward(*tensors)

    @staticmethod
    def backward(ctx, grad_output):
        stamps.append((time.perf_counter(), threading.get_ident()))
        grad_value, grad_locations, grad_weights = triton_backend._backward(grad_output, *ctx.saved_tensors, "auto",
                                                                            False)
        stamps.append((time.perf_counter(), threading.get_ident()))
        return grad_value, None, None, grad_locations, grad_weights


def one_thread(fn):
    """fn with autograd's device threads off: the backward runs on the calling thread."""
    def call():
        with torch.autograd.set_multithreading_enabled(False):
            return fn()
    return call


def package(file, name):
    """Where a profiled function's self time goes: its package, or a C function's own name."""
    if file == "~":
        return name
    return next((p for p in ("msda_core", "msda_triton", "triton", "torch") if f"/{p}/" in file), "other Python")


def with_grad(forward):
    return forward, lambda: torch.autograd.grad(forward(), diff, g)


if "layers" in SECTIONS:
    # The call with its layers peeled off one at a time, beside each installed peer (fp32, taking turns): the public
    # op through the dispatcher, the op's Python kernel called directly (no dispatcher), DeformAttn.apply on a chosen
    # backend (no validation or selection), Bare, and the bodies with no autograd (forward, then backward by hand);
    # then the op, Bare and the peers with the backward on the calling thread.
    layers = {"op": (fwd, both),
              "python kernel": with_grad(lambda: core_op._deform_attn(*inputs)),
              "Function": with_grad(lambda: core_op.DeformAttn.apply(chosen, *inputs)),
              "Bare": with_grad(lambda: Bare.apply(*inputs)),
              "bodies": (lambda: triton_backend._forward(*inputs),
                         lambda: (triton_backend._forward(*inputs),
                                  triton_backend._backward(g, *inputs, "auto", False)))}
    peers = installed_peers()
    for name, peer in peers.items():
        layers[name] = with_grad(lambda peer=peer: peer(*inputs).reshape(g.shape))
    for name in ("op", "Bare", *peers):
        layers[f"{name}, one thread"] = tuple(one_thread(f) for f in layers[name])
    res = collections.defaultdict(list)
    for _ in range(6):
        for name, (f, b) in layers.items():
            res[(name, "fwd")].append(host_ms(f))
            res[(name, "both")].append(host_ms(b))
    for name in layers:
        print(f"fp32 {name:28s} fwd {statistics.median(res[(name, 'fwd')]):.4f} "
              f"fwd+grad {statistics.median(res[(name, 'both')]):.4f} ms", flush=True)

    # Where Bare's forward+grad spends its time, call by call: the forward, autograd until the backward starts, the
    # backward's body, and autograd after it until grad returns (medians of 1000 calls).
    for threads, run in (("device thread", lambda fn: fn()), ("one thread", lambda fn: one_thread(fn)())):
        spans = collections.defaultdict(list)
        for _ in range(1000):
            stamps.clear()
            t0 = time.perf_counter()
            out = Bare.apply(*inputs)
            t1 = time.perf_counter()
            run(lambda out=out: torch.autograd.grad(out, diff, g))
            t2 = time.perf_counter()
            (enter, worker), (leave, _) = stamps
            for span, seconds in (("forward", t1 - t0), ("to the backward", enter - t1),
                                  ("backward body", leave - enter), ("back to the caller", t2 - leave)):
                spans[span].append(seconds * 1e3)
        torch.cuda.synchronize()
        ran = "another thread" if worker != threading.get_ident() else "the caller"
        medians = "".join(f" {span} {statistics.median(ms):.4f}" for span, ms in spans.items())
        print(f"Bare, {threads} ({ran} ran the backward):{medians} ms", flush=True)

if "profile" in SECTIONS:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        both()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(22)

    per_call = collections.Counter()
    for (file, _, name), (_, _, self_time, _, _) in stats.stats.items():
        per_call[package(file, name)] += self_time / 2000 * 1e3
    for where, ms in per_call.most_common(12):
        print(f"{ms:.4f} ms per forward+grad  {where}")

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        for _ in range(200):
            both()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))

if "compile" in SECTIONS:
    for dtype in (torch.float32,):
        _, _, leaves, diff, g = calls(dtype)
        op = torch.compile(lambda v, s, i, l, a: torch.ops.msda.deform_attn(v, s, i, l, a), fullgraph=True)
        args = [leaves[k] for k in kit.ARGUMENTS]

        def cfwd():
            return op(*args)

        def cboth():
            return torch.autograd.grad(cfwd(), diff, g)
        for _ in range(3):
            cboth()
        f, b = host_ms(cfwd), host_ms(cboth)
        ef, eb = host_ms(calls(dtype)[0]), host_ms(calls(dtype)[1])
        print(f"compiled {str(dtype)[6:]} fwd {f:.4f} fwd+grad {b:.4f} ms; eager fwd {ef:.4f} fwd+grad {eb:.4f}")
