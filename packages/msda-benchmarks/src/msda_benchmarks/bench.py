"""``python -m msda_benchmarks.bench``: forward and backward times of every available backend.

On the GPU, for each backend, dtype, case and location distribution (model-like first, then uniform): the
median forward time and backward time (forward+backward minus forward, through autograd as users call it,
host overhead included), the same work replayed from a CUDA graph (kernel time without host overhead), peak
extra memory of one forward+backward, and effective bandwidth (the bytes that must move at least once, over
the time) as a fraction of the device-to-device copy bandwidth measured in the same run. Prints a table,
writes JSON (with the environment) and, when matplotlib is present, a PNG of time against work.

On the CPU it times the ``gather`` backend against mmcv's PyTorch formulation (one grid_sample per level,
``mmcv_pytorch``) side by side, decoder B1 Q300 and encoder B1, inference and forward+backward, taking turns
for ``--rounds`` rounds: medians over the rounds, with their spread.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
from dataclasses import replace
from importlib.metadata import PackageNotFoundError, version

import msda_core
import torch
from msda_testkit import cli
from msda_testkit.cases import DETR_LEVELS, DETR_S, DIFFERENTIABLE, STANDARD_CASES, Case, grad_output_for, make_inputs
from msda_testkit.mmcv_formulation import mmcv_pytorch
from tabulate import tabulate

from .timing import graph_ms, median_ms

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# On the GPU, locations are uniform in [-0.1, 1.1] as in the peer figures of BENCHMARKS.md, so they compare.
PEER_LOC_RANGE = (-0.1, 1.1)
GPU_CASES = tuple(replace(c, loc_range=PEER_LOC_RANGE) for c in STANDARD_CASES)
SWEEP = tuple(replace(GPU_CASES[1], name=f"sweep_b2_q{q}", queries=q) for q in (300, 1000, 3000, 10000)) + \
    tuple(replace(GPU_CASES[1], name=f"sweep_b{b}_q{DETR_S}", batch=b) for b in (1, 4))
CPU_CASES = (Case("decoder_b1_q300", batch=1, queries=300, heads=8, head_dim=32, levels=DETR_LEVELS, points=4),
             Case("encoder_b1", batch=1, queries=DETR_S, heads=8, head_dim=32, levels=DETR_LEVELS, points=4))
LAYOUTS = ("model_like", "random")  # the location distributions: as Deformable DETR samples, and uniform


def with_layout(case: Case, layout: str) -> Case:
    return replace(case, layout=layout)


def must_move_bytes(inputs: dict) -> tuple:
    """The floors on memory traffic of the forward and of the backward: each input read once and each output
    written once, where of value only the rows that some sample reads count (the decoder's samples read 30% of
    them; the encoder's, all)."""
    value, loc, weights = (inputs[k] for k in DIFFERENTIABLE)
    out = math.prod(msda_core.output_shape(value, loc)) * value.element_size()
    reads = _rows_read(inputs) * value.shape[3] * value.element_size() + loc.nbytes + weights.nbytes
    # the backward reads value's rows, the locations, the weights and grad_output; writes all of the three gradients
    return reads + out, reads + out + value.nbytes + loc.nbytes + weights.nbytes


def _rows_read(inputs: dict) -> int:
    """How many (b, s, m) rows of value some sample reads with a nonzero weight: those whose gradient is
    nonzero for a grad_output of ones and |attention_weights|, in fp32 (every term of those sums is >= 0, so
    none cancels)."""
    value = inputs["value"].detach().float().requires_grad_()
    out = torch.ops.msda.deform_attn(value, inputs["spatial_shapes"], inputs["level_start_index"],
                                     inputs["sampling_locations"].float(), inputs["attention_weights"].float().abs())
    (grad_value,) = torch.autograd.grad(out, value, torch.ones_like(out))
    return int((grad_value != 0).any(-1).sum())


def copy_bandwidth(device) -> float:
    """Device-to-device copy, bytes read plus written per second."""
    import triton.testing
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def training_leaves(inputs: dict) -> dict:
    """The inputs, the differentiable ones made leaves that require grad, as a training step passes them."""
    return {k: (v.requires_grad_() if k in DIFFERENTIABLE else v) for k, v in inputs.items()}


def backward_ms(forward_backward_ms, forward_ms):
    """The backward's time: forward+backward less forward, None where either could not be measured."""
    return forward_backward_ms - forward_ms if forward_backward_ms and forward_ms else None


def with_backward(forward, leaves: dict, grad_output):
    """What the bench times as forward+backward: ``forward()``, then torch.autograd.grad into the leaves."""
    return lambda: torch.autograd.grad(forward(), [leaves[k] for k in DIFFERENTIABLE], grad_output)


def measure(case: Case, dtype: torch.dtype, backend: str, device, seconds: float, grad_accum: str = "auto",
            deterministic: bool = False) -> dict:
    inputs = make_inputs(case, dtype, device=device)
    leaves = training_leaves(inputs)
    grad_output = grad_output_for(inputs)

    def forward():
        return torch.ops.msda.deform_attn(**leaves, backend=backend, grad_accum=grad_accum,
                                          deterministic=deterministic)

    forward_backward = with_backward(forward, leaves, grad_output)
    row = {"case": case.name, "locations": case.layout, "dtype": str(dtype)[6:], "backend": backend,
           "grad_accum": "deterministic" if deterministic else grad_accum,
           "B": case.batch, "Q": case.queries}
    row["fwd_ms"] = median_ms(forward, device, seconds)
    row["bwd_ms"] = median_ms(forward_backward, device, seconds) - row["fwd_ms"]
    if device.type == "cuda":
        fwd_graph = graph_ms(forward)
        both_graph = graph_ms(forward_backward)
        row["fwd_graph_ms"] = fwd_graph
        row["bwd_graph_ms"] = backward_ms(both_graph, fwd_graph)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        forward_backward()
        torch.cuda.synchronize(device)
        row["peak_extra_mb"] = (torch.cuda.max_memory_allocated(device) - before) / 2 ** 20
    row["fwd_min_bytes"], row["bwd_min_bytes"] = must_move_bytes(inputs)
    return row


def environment(device) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        import triton
        env.update(gpu=torch.cuda.get_device_name(device), triton=triton.__version__,
                   cuda=torch.version.cuda)
    else:
        env.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    for package in ("msda-core", "msda-reference", "msda-triton", "msda-testkit"):
        try:
            env[package] = version(package)
        except PackageNotFoundError:
            pass
    return env


def _plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key in zip(axes, ("fwd", "bwd")):
        # solid: called from Python (host overhead included); dashed: replayed from a CUDA graph
        for suffix, style in (("_ms", "-"), ("_graph_ms", "--")):
            series = {}
            for r in rows:
                if r.get(key + suffix) is not None:
                    line = (r["backend"], r["dtype"], r.get("locations", "random"), r.get("grad_accum", "auto"))
                    series.setdefault(line, []).append((r["B"] * r["Q"], r[key + suffix]))
            for i, ((backend, dtype, locations, accum), points) in enumerate(sorted(series.items())):
                points.sort()
                label = " ".join([backend, dtype, locations] + ([accum] if accum != "auto" else [])) + (
                    " (graph)" if suffix == "_graph_ms" else "")
                ax.plot(*zip(*points), style, color=f"C{i}", marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="queries x batch", ylabel="median ms",
               title="forward" if key == "fwd" else "backward")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> int:
    parser = cli.parser("msda_benchmarks.bench", __doc__)
    cli.add_device(parser)
    parser.add_argument("--backends", nargs="*",
                        help="GPU: the backends to time (default: every backend that auto may choose on the device)")
    parser.add_argument("--dtypes", nargs="*", choices=list(DTYPES), help="default: all on the GPU, fp32 on the CPU")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS),
                        help="location distributions: model_like (Deformable DETR's sampling), random (uniform)")
    parser.add_argument("--no-sweep", action="store_true", help="GPU: only the standard cases, not the size sweep")
    parser.add_argument("--grad-accum", nargs="*", default=["auto"], choices=["auto", "native", "fp32"],
                        help="the accumulation paths to time")
    parser.add_argument("--deterministic", action="store_true", help="time the deterministic backward")
    parser.add_argument("--threads", type=int, default=2, help="CPU: torch.set_num_threads")
    parser.add_argument("--rounds", type=int, default=5, help="CPU: rounds in which the implementations take turns")
    parser.add_argument("--seconds", type=float, default=1.0, help="CPU: the least time of timed calls per figure")
    parser.add_argument("--json", default="bench.json", help="where the results go, in the current folder by default")
    parser.add_argument("--plot", default="bench.png",
                        help="GPU: where the plot goes, in the current folder by default")
    parser.add_argument("--replot", metavar="JSON", help="only redraw the plot from a JSON this tool wrote")
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            _plot(json.load(f)["rows"], args.plot)
        return 0
    device = cli.device(parser.prog, args.device)
    if device.type == "cpu":
        return compare_cpu(args)
    cases = GPU_CASES + (() if args.no_sweep else SWEEP)
    backends = args.backends or sorted(n for n, b in msda_core.backends().items()
                                       if device.type in b.auto_devices)
    env = environment(device)
    env["copy_bandwidth_tb_s"] = copy_bandwidth(device) / 1e12
    rows = []
    for case in (with_layout(c, layout) for c in cases for layout in args.layouts):
        for dtype_name in args.dtypes or list(DTYPES):
            for backend, grad_accum in ((b, a) for b in backends for a in args.grad_accum):
                row = measure(case, DTYPES[dtype_name], backend, device, args.seconds, grad_accum,
                              args.deterministic)
                bandwidth = env["copy_bandwidth_tb_s"] * 1e12
                for key in ("fwd", "bwd"):
                    ms = row.get(f"{key}_graph_ms") or row[f"{key}_ms"]
                    row[f"{key}_bw_frac"] = row[f"{key}_min_bytes"] / (ms * 1e-3) / bandwidth
                rows.append(row)
                print(f"{row['case']} {row['locations']} {row['dtype']} {backend} {row['grad_accum']}: "
                      f"fwd {row['fwd_ms']:.4g} ms, bwd {row['bwd_ms']:.4g} ms", flush=True)
    columns = ["case", "locations", "dtype", "backend", "grad_accum", "fwd_ms", "bwd_ms", "fwd_graph_ms",
               "bwd_graph_ms", "peak_extra_mb", "fwd_bw_frac", "bwd_bw_frac"]
    columns = [c for c in columns if any(c in r for r in rows)]
    print(json.dumps(env))
    print(tabulate([[r.get(c) for c in columns] for r in rows], headers=columns, floatfmt=".4g"))
    cli.write_results(args.json, env, rows)
    _plot(rows, args.plot)
    return 0


CPU_IMPLEMENTATIONS = {
    "gather": lambda **inputs: torch.ops.msda.deform_attn(**inputs, backend="gather"),
    "mmcv_pytorch": lambda **inputs: mmcv_pytorch(**inputs),
}
CPU_MODES = ("inference", "fwd+bwd")


def compare_row(case: Case, dtype: torch.dtype, rounds: int, seconds: float) -> dict:
    """One case on the CPU: each implementation's median time over ``rounds`` rounds, inference (under
    torch.inference_mode) and forward+backward (torch.autograd.grad into value, locations and weights),
    the implementations taking turns each round; the spread of the rounds; the speedups of gather."""
    cpu = torch.device("cpu")
    inputs = make_inputs(case, dtype)
    leaves = training_leaves(make_inputs(case, dtype))
    grad_output = grad_output_for(inputs)
    calls = {}
    for name, fn in CPU_IMPLEMENTATIONS.items():
        def inference(fn=fn):
            with torch.inference_mode():
                return fn(**inputs)
        calls[name, "inference"] = inference
        calls[name, "fwd+bwd"] = with_backward(lambda fn=fn: fn(**leaves), leaves, grad_output)
    times = {key: [] for key in calls}
    for _ in range(rounds):
        for key, fn in calls.items():
            times[key].append(median_ms(fn, cpu, seconds))
    outputs = [calls[name, "inference"]().float() for name in CPU_IMPLEMENTATIONS]
    row = {"case": case.name, "locations": case.layout, "dtype": str(dtype)[6:], "rounds": rounds,
           "max_abs_diff": (outputs[0] - outputs[1]).abs().max().item()}
    for (name, mode), ts in times.items():
        row[f"{name} {mode} ms"] = statistics.median(ts)
        row[f"{name} {mode} spread ms"] = [min(ts), max(ts)]
    for mode in CPU_MODES:
        row[f"{mode} speedup"] = row[f"mmcv_pytorch {mode} ms"] / row[f"gather {mode} ms"]
    return row


def _cpu_table(rows) -> str:
    timed = [f"{name} {mode}" for mode in CPU_MODES for name in CPU_IMPLEMENTATIONS]
    headers = ["case", "locations", "dtype"] + [f"{t} ms" for t in timed] + [f"{m} speedup" for m in CPU_MODES]
    table = []
    for r in rows:
        spreads = [r[f"{t} spread ms"] for t in timed]
        table.append([r["case"], r["locations"], r["dtype"]]
                     + [f"{r[f'{t} ms']:.4g} ({lo:.4g}-{hi:.4g})" for t, (lo, hi) in zip(timed, spreads)]
                     + [round(r[f"{m} speedup"], 2) for m in CPU_MODES])
    return tabulate(table, headers=headers)


def compare_cpu(args) -> int:
    torch.set_num_threads(args.threads)
    env = environment(torch.device("cpu"))
    rows = []
    for case in (with_layout(c, layout) for c in CPU_CASES for layout in args.layouts):
        for dtype_name in args.dtypes or ["fp32"]:
            rows.append(compare_row(case, DTYPES[dtype_name], args.rounds, args.seconds))
            print(rows[-1], flush=True)
    print(json.dumps(env))
    print(f"medians over {args.rounds} rounds (min-max of the rounds), {args.threads} threads")
    print(_cpu_table(rows))
    cli.write_results(args.json, env, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
