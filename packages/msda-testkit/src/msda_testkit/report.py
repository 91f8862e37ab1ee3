"""``python -m msda_testkit.report``: every available backend on the standard and edge cases, one table.

Errors are against float64 (the naive loops where they can run, else grid_sample) on the same inputs
upcast; times are medians of wall-clock runs including host overhead, for orientation only (the benchmarks
measure speed properly). On a CPU-only machine the encoder-size cases are replaced by the small ones.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tabulate import tabulate

import msda_core

from .cases import EDGE_CASES, SMALL_CASES, STANDARD_CASES, grad_output_for, make_inputs
from .parity import compare_results, grad_value_effect, reference, run

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _timed(fn, device, repeats):
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return result, statistics.median(times) * 1e3


def _reference_backend(inputs):
    try:
        msda_core.resolve_backend(inputs["value"].double(), inputs["sampling_locations"].double(), "naive")
        return "naive"
    except msda_core.BackendUnavailableError:
        return "grid_sample"


def rows_for(case, dtype, device, repeats):
    inputs = make_inputs(case, dtype, device=device)
    expected = reference(inputs, backend=_reference_backend(inputs))
    grad_output = grad_output_for(inputs)
    rows = []
    device_ = inputs["value"].device
    for name, backend in sorted(msda_core.backends().items()):
        # backends that scatter with atomics are shown with both accumulation paths, and their
        # deterministic mode when they have one
        paths = [(mode, mode, False) for mode in (("native", "fp32") if backend.honors_grad_accum else ("auto",))]
        if backend.deterministic_on_request:
            paths.append(("deterministic", "auto", True))
        for path, grad_accum, deterministic in paths:
            label = f"{name} ({path})" if len(paths) > 1 else name
            reasons = backend.not_supported_reasons(msda_core.Inputs.of(inputs["value"], inputs["sampling_locations"],
                                                                        grad_accum, deterministic))
            if reasons:
                rows.append([case.name, str(dtype)[6:], label, "-", "-", "skipped: " + "; ".join(reasons)[:60]])
                continue
            kwargs = {"grad_accum": grad_accum, "deterministic": deterministic}
            _, fwd_ms = _timed(lambda: run(inputs, name, **kwargs), device_, repeats)
            actual, both_ms = _timed(lambda: run(inputs, name, grad_output, **kwargs), device_, repeats)
            effect = grad_value_effect(name, inputs, grad_accum, deterministic)
            results = compare_results(inputs, actual, expected, grad_value_effect=effect)
            worst = max(results, key=lambda r: r.max_rel_err)
            verdict = "ok" if all(r.passed for r in results) else "FAIL: " + ", ".join(
                r.name for r in results if not r.passed)
            rows.append([case.name, str(dtype)[6:], label, f"{fwd_ms:.3g}", f"{both_ms - fwd_ms:.3g}",
                         f"{verdict} (worst {worst.name} {worst.max_rel_err:.2g} of scale)"])
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sized = STANDARD_CASES if device.type == "cuda" else SMALL_CASES + STANDARD_CASES[:1]
    rows, failed = [], 0
    for case in sized + EDGE_CASES:
        for dtype in DTYPES:
            for row in rows_for(case, dtype, device, args.repeats):
                failed += row[-1].startswith("FAIL")
                rows.append(row)
                print("  ".join(row), flush=True)  # progress; the table follows
    print(f"msda report on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, "
          f"torch {torch.__version__}, backends {sorted(msda_core.backends())}")
    print(tabulate(rows, headers=["case", "dtype", "backend", "fwd ms", "bwd ms", "against float64"]))
    print(f"{len(rows)} rows, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
