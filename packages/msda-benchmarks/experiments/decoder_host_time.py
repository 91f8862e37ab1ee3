"""``python experiments/decoder_host_time.py`` (from packages/msda-benchmarks) (GPU): host time of the decoder B4
Q300 op called from Python.

The launch replay on and off by turns (msda_triton.launcher.ENABLED, 6 rounds of 1000 calls, medians), msda beside
each peer that ``python -m msda_benchmarks.peers`` finds installed (fp32, the same loops, taking turns), a cProfile
of forward+grad (its top functions, then its self time per call summed by package: cProfile sees the calling thread
only, so ``run_backward`` holds the backward that autograd's device thread runs), a torch.profiler breakdown, and
torch.compile's figure beside eager's (BENCHMARKS.md, "The decoder call from Python")."""
import collections
import cProfile
import pstats
import statistics
import sys
import time
from dataclasses import replace

import msda_testkit as kit
import torch
from msda_benchmarks.peers import installed_peers
from msda_testkit.cases import STANDARD_CASES
from msda_triton import launcher

GPU_CASES = tuple(replace(c, loc_range=(-0.1, 1.1)) for c in STANDARD_CASES)  # the bench's cases

N = 1000


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
timed = {"msda": (fwd, both)}
for name, peer in installed_peers().items():
    def peer_fwd(peer=peer):
        return peer(*(leaves[k] for k in kit.ARGUMENTS)).reshape(g.shape)

    def peer_both(peer_fwd=peer_fwd):
        return torch.autograd.grad(peer_fwd(), diff, g)
    timed[name] = (peer_fwd, peer_both)
res = collections.defaultdict(list)
for _ in range(6):  # taking turns, as the replay above
    for name, (f, b) in timed.items():
        res[(name, "fwd")].append(host_ms(f))
        res[(name, "both")].append(host_ms(b))
for name in timed:
    print(f"fp32 {name:15s} fwd {statistics.median(res[(name, 'fwd')]):.4f} "
          f"fwd+grad {statistics.median(res[(name, 'both')]):.4f} ms", flush=True)

prof = cProfile.Profile()
prof.enable()
for _ in range(2000):
    both()
torch.cuda.synchronize()
prof.disable()
stats = pstats.Stats(prof, stream=sys.stdout)
stats.sort_stats("tottime").print_stats(22)


def package(file, name):
    """Where a profiled function's self time goes: its package, or a C function's own name."""
    if file == "~":
        return name
    return next((p for p in ("msda_core", "msda_triton", "triton", "torch") if f"/{p}/" in file), "other Python")


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
