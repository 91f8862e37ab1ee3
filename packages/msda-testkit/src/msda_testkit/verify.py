"""``python -m msda_testkit.verify``: the five-stage verification of a backend, one table.

1. correctness on the standard shapes against the float64 reference;
2. every dtype, and half values with fp32 locations;
3. edge cases: the catalog, all-zero inputs, inf/NaN in each input (NaN where the reference has NaN),
   shapes no block size divides;
4. determinism: 10 runs bit-identical (the forward always, the backward in deterministic mode);
5. stress (CUDA): 1000 forward+backward iterations of the largest encoder batch within ~2 GB, allocated
   memory flat after warm-up and results unchanged.

On a CPU (the slice ``nox -s cpu`` runs; Triton's kernels then run in its interpreter, where one check of a
small case takes minutes) it keeps what no test covers and takes about a minute: the standard dims (M 8,
D 32, L 4, P 4) on 2 queries of the small decoder in stages 1, 2 and 4; stage 3's own checks on an uneven
shape of 27 rows; no catalog (the conformance suite runs it on every backend in every dtype and accumulation
path); no stage 5. Each check prints as it finishes.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import replace

import torch
from tabulate import tabulate

from . import cli
from .cases import EDGE_CASES, SMALL_CASES, STANDARD_CASES, Case, grad_output_for, make_inputs
from .parity import check_parity, run
from .replay import assert_replays_bit_exact

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
UNEVEN = Case("uneven", batch=3, queries=37, heads=3, head_dim=7, levels=((5, 3), (2, 7)), points=3)
# the CPU slice's cases: the small decoder on 2 queries, and an uneven shape whose 27 rows fill no block either
CPU_STANDARD = replace(SMALL_CASES[0], name="decoder_small_q2", queries=2)
CPU_UNEVEN = replace(UNEVEN, queries=3)


class Stage:
    """Collects one stage's checks: how many ran, passed, and the worst error against its allowance."""

    def __init__(self, name: str, log=None):
        self.name, self.cases, self.passed, self.worst, self.allowed, self.failures = name, 0, 0, 0.0, None, []
        self.log = log or (lambda stage, label, ok: None)

    def add(self, label: str, comparisons: list):
        self.cases += 1
        failed = [c for c in comparisons if not c.passed]
        self.passed += not failed
        self.failures += [f"{label}: {c}" for c in failed]
        for c in comparisons:
            if c.max_rel_err >= self.worst:
                self.worst, self.allowed = c.max_rel_err, c.tolerance
        self.log(self.name, label, not failed)

    def check(self, label: str, fn):
        """A check that raises AssertionError on failure (replays, memory)."""
        self.cases += 1
        try:
            fn()
            self.passed += 1
            self.log(self.name, label, True)
        except AssertionError as err:
            self.failures.append(f"{label}: {err}")
            self.log(self.name, label, False)

    def row(self):
        """worst: the largest error as a fraction of its tensor's scale; allowed: that check's tolerance."""
        worst = f"{self.worst:.2g}" if self.allowed else "-"
        if self.allowed:
            allowed = f"{self.allowed.atol:.2g} of scale + {self.allowed.rtol:g} x |expected|"
        else:
            allowed = "bit-exact" if self.cases else "-"
        return [self.name, self.cases, self.passed, worst, allowed]


def _compare(stage, label, inputs, backend, grad_output=None, nonfinite_kind_matters=True, **op_kwargs):
    """One parity check against grid_sample in float64 (check_parity; see it for ``nonfinite_kind_matters``)."""
    stage.add(label, check_parity(inputs, backend, "grid_sample", grad_output=grad_output,
                                  nonfinite_kind_matters=nonfinite_kind_matters, **op_kwargs))


def _with_bad(t: torch.Tensor, bad: float) -> torch.Tensor:
    """A copy of t with one element, a third of the way in, replaced by ``bad``."""
    t = t.clone()
    t.view(-1)[t.numel() // 3] = bad
    return t


def progress(out=None):
    """A Stage log that prints each check as it finishes, with the seconds since the previous one."""
    last = [time.perf_counter()]

    def log(stage: str, label: str, ok: bool):
        now = time.perf_counter()
        print(f"{stage}: {label}: {'ok' if ok else 'FAILED'} ({now - last[0]:.1f} s)", file=out, flush=True)
        last[0] = now

    return log


def verify(backend: str, device: str, replays: int = 10, log=None) -> list:
    """The five stages' results (module docstring); ``log(stage, label, ok)`` hears of each check."""
    on_gpu = device.startswith("cuda")
    sized, catalog, uneven = (STANDARD_CASES[:2], EDGE_CASES, UNEVEN) if on_gpu else ((CPU_STANDARD,), (), CPU_UNEVEN)
    stages = [Stage(n, log) for n in ("1 correctness", "2 dtypes", "3 edge cases", "4 determinism", "5 stress")]
    one, dtypes, edges, determinism, stress = stages

    for case in sized:
        _compare(one, case.name, make_inputs(case, F32, device=device), backend)

    for dtype, loc_dtype in ((F32, F32), (F16, F16), (BF16, BF16), (F16, F32), (BF16, F32)):
        inputs = make_inputs(sized[0], dtype, loc_dtype, device=device)
        _compare(dtypes, f"{sized[0].name} {dtype} {loc_dtype}", inputs, backend)

    for case in catalog + (uneven,):
        _compare(edges, case.name, make_inputs(case, F32, device=device), backend)
    base = make_inputs(replace(uneven, name="special"), F32, device=device)
    zeros = {k: (torch.zeros_like(v) if v is not None and v.is_floating_point() else v) for k, v in base.items()}
    _compare(edges, "all zeros", zeros, backend, torch.zeros_like(grad_output_for(base)))
    with warnings.catch_warnings():  # Triton's interpreter computes in numpy, which warns of every inf - inf
        warnings.filterwarnings("ignore", "invalid value encountered", RuntimeWarning)
        for bad in (math.nan, math.inf):
            strict = math.isnan(bad)
            for name in ("value", "sampling_locations", "attention_weights"):
                _compare(edges, f"{bad} in {name}", {**base, name: _with_bad(base[name], bad)}, backend,
                         nonfinite_kind_matters=strict)
            _compare(edges, f"{bad} in grad_output", base, backend, _with_bad(grad_output_for(base), bad),
                     nonfinite_kind_matters=strict)

    for case in sized:
        inputs = make_inputs(case, F32, device=device)
        grad_output = grad_output_for(inputs)
        determinism.check(f"{case.name} forward", lambda: assert_replays_bit_exact(
            lambda **i: run(i, backend)["output"], inputs, replays=replays, contention=on_gpu))
        determinism.check(f"{case.name} backward (deterministic)", lambda: assert_replays_bit_exact(
            lambda **i: run(i, backend, grad_output, deterministic=True), inputs, replays=replays,
            contention=on_gpu))

    if on_gpu:
        stress.check("1000 iterations", lambda: _stress(backend, device))
    return stages


def _stress(backend: str, device: str, budget_bytes: int = 2 << 30, iterations: int = 1000):
    """The largest encoder batch whose inputs, output and gradients fit the budget (~6x value's size),
    run ``iterations`` times: allocated memory must not grow after warm-up and results must not change."""
    encoder = STANDARD_CASES[1]
    per_batch = encoder.spatial_size * encoder.heads * encoder.head_dim * 4 * 6
    case = replace(encoder, name="stress", batch=max(1, budget_bytes // per_batch))
    inputs = make_inputs(case, F32, device=device)
    grad_output = grad_output_for(inputs)
    def step():
        return run(inputs, backend, grad_output, deterministic=True)
    first = step()
    for _ in range(3):
        last = step()  # one set of results held at both readings, as in the loop
    torch.cuda.synchronize(device)
    allocated = torch.cuda.memory_allocated(device)
    for _ in range(iterations):
        last = step()
    torch.cuda.synchronize(device)
    grown = torch.cuda.memory_allocated(device) - allocated
    assert grown <= 0, f"allocated memory grew by {grown} bytes over {iterations} iterations (B={case.batch})"
    for name in first:
        assert torch.equal(first[name], last[name]), f"{name} changed after {iterations} iterations"


def main(argv=None) -> int:
    parser = cli.parser("msda_testkit.verify", __doc__)
    parser.add_argument("--backend", default="triton", help="the backend to verify")
    cli.add_device(parser)
    parser.add_argument("--replays", type=int, default=10, help="stage 4's runs per check")
    args = parser.parse_args(argv)
    stages = verify(args.backend, str(cli.device(parser.prog, args.device)), args.replays, progress())
    print(tabulate([s.row() for s in stages], headers=["stage", "cases", "passed", "worst error", "allowed"]))
    failures = [f for s in stages for f in s.failures]
    for line in failures:
        print("FAILED", line)
    print(f"{sum(s.passed for s in stages)} passed, {sum(s.cases - s.passed for s in stages)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
