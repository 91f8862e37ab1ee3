"""``python -m msda_benchmarks.report``: every available backend on the standard and edge cases, one table.

Errors are against float64 (the naive loops where they can run, else grid_sample) on the same inputs
upcast. Times are host-time medians (timing.host_ms), host overhead included: for orientation only
(``msda_benchmarks.bench`` measures speed). On a CPU-only machine the encoder-size cases are replaced by the
small ones. The table prints row by row as it runs; what a backend cannot run is listed under it, once per
reason.
"""

from __future__ import annotations

import statistics
import textwrap

import msda_core
import torch
from msda_testkit import cli
from msda_testkit.cases import EDGE_CASES, SMALL_CASES, STANDARD_CASES, grad_output_for, make_inputs
from msda_testkit.parity import check_parity, reference, run

from .timing import host_ms

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
COLUMNS = (("case", 24), ("dtype", 9), ("backend", 23), ("fwd ms", 9), ("bwd ms", 9), ("against float64", 0))
LEGEND = """\
fwd ms: median wall-clock time of one forward call, host overhead included (blocks of calls after a warm-up).
bwd ms: the median of forward+backward calls less the forward's median; "< noise" where that difference is
  not larger than the spread of the two (their median absolute deviations added), negative ones included.
against float64: "ok" when every result is within its tolerance, else FAIL and the results that are not;
  "worst" names the result farthest from float64, its error given "of scale": the largest |actual - expected|
  over the largest |expected| of that tensor."""


def _spread(times: list) -> float:
    middle = statistics.median(times)
    return statistics.median(abs(t - middle) for t in times)


def subtracted(both: list, part: list) -> str:
    """The median of ``both`` less the median of ``part``, or "< noise" where the difference does not exceed
    the two medians' spread: a time obtained by subtraction means nothing below that."""
    difference = statistics.median(both) - statistics.median(part)
    return f"{difference:.3g}" if difference > _spread(both) + _spread(part) else "< noise"


def _reference_backend(inputs):
    try:
        msda_core.resolve_backend(inputs["value"].double(), inputs["sampling_locations"].double(), "naive")
        return "naive"
    except msda_core.BackendUnavailableError:
        return "grid_sample"


def _paths(backend):
    """(label, grad_accum, deterministic) of each way the report runs a backend: both accumulation paths of
    one that scatters with atomics, and its deterministic mode when it has one."""
    modes = ("native", "fp32") if backend.honors_grad_accum else ("auto",)
    paths = [(mode, mode, False) for mode in modes]
    if backend.deterministic_on_request:
        paths.append(("deterministic", "auto", True))
    return paths if len(paths) > 1 else [(None, "auto", False)]


def rows_for(case, dtype, device, seconds: float, skipped: dict) -> list:
    """The table's rows for one case and dtype; each path a backend cannot run goes to ``skipped``
    instead, keyed by (backend, reason), as (path, case, dtype)."""
    inputs = make_inputs(case, dtype, device=device)
    expected = reference(inputs, backend=_reference_backend(inputs))
    grad_output = grad_output_for(inputs)
    dtype_name = str(dtype)[6:]
    rows = []
    for name, backend in sorted(msda_core.backends().items()):
        for path, grad_accum, deterministic in _paths(backend):
            reasons = backend.not_supported_reasons(msda_core.Metadata.of(
                inputs["value"], inputs["sampling_locations"], grad_accum, deterministic))
            if reasons:
                skipped.setdefault((name, "; ".join(reasons)), []).append((path, case.name, dtype_name))
                continue
            kwargs = {"grad_accum": grad_accum, "deterministic": deterministic}
            fwd = host_ms(lambda: run(inputs, name, **kwargs), seconds)
            both = host_ms(lambda: run(inputs, name, grad_output, **kwargs), seconds)
            results = check_parity(inputs, name, expected=expected, **kwargs)
            worst = max(results, key=lambda r: r.max_rel_err)
            failed = [r.name for r in results if not r.passed]
            verdict = "FAIL: " + ", ".join(failed) if failed else "ok"
            rows.append([case.name, dtype_name, f"{name} ({path})" if path else name,
                         f"{statistics.median(fwd):.3g}", subtracted(both, fwd),
                         f"{verdict} (worst {worst.name} {worst.max_rel_err:.2g} of scale)"])
    return rows


def format_row(cells) -> str:
    return "".join(f"{cell:<{width}}" if width else str(cell) for cell, (_, width) in zip(cells, COLUMNS)).rstrip()


def skip_lines(skipped: dict, cases: list, width: int = 110) -> list:
    """One wrapped paragraph per backend and reason: which of its paths, on which cases and dtypes."""
    everything = {(c, str(d)[6:]) for c in cases for d in DTYPES}
    lines = []
    for (name, reason), where in sorted(skipped.items(), key=lambda item: item[0][0]):
        paths = list(dict.fromkeys(p for p, _, _ in where if p))
        label = f"{name} ({', '.join(paths)})" if paths else name
        hit = {(c, d) for _, c, d in where}
        if hit == everything:
            scope = "every case and dtype"
        else:
            by_case = {c: [d for d in (str(t)[6:] for t in DTYPES) if (c, d) in hit] for c in cases}
            scope = ", ".join(c + ("" if len(ds) == len(DTYPES) else f" ({'/'.join(ds)})")
                              for c, ds in by_case.items() if ds)
        lines += textwrap.wrap(f"{label} skipped on {scope}: {reason}", width, subsequent_indent="  ",
                               break_long_words=False, break_on_hyphens=False)
    return lines


def main(argv=None) -> int:
    parser = cli.parser("msda_benchmarks.report", __doc__)
    cli.add_device(parser)
    parser.add_argument("--seconds", type=float, default=0.05, help="the least time of timed calls per figure")
    args = parser.parse_args(argv)
    device = cli.device(parser.prog, args.device)
    cases = [*(STANDARD_CASES if device.type == "cuda" else SMALL_CASES + STANDARD_CASES[:1]), *EDGE_CASES]
    print(f"msda report on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, "
          f"torch {torch.__version__}, backends {sorted(msda_core.backends())}")
    print(LEGEND + "\n")
    print(format_row(name for name, _ in COLUMNS))
    rows, failed, skipped = 0, 0, {}
    for case in cases:
        for dtype in DTYPES:
            for row in rows_for(case, dtype, device, args.seconds, skipped):
                print(format_row(row), flush=True)
                rows += 1
                failed += row[-1].startswith("FAIL")
    print(f"\n{rows} rows, {failed} failed" + (", and not run:" if skipped else ""))
    for line in skip_lines(skipped, [c.name for c in cases]):
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
