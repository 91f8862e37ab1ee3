"""``python -m msda_benchmarks.model_bench``: training steps of transformers' Deformable DETR, per attention path (GPU).

The model is built from a ``DeformableDetrConfig`` with random weights and nothing fetched: transformers' own
ResNet-50 backbone config (``use_timm_backbone=False``, ``use_pretrained_backbone=False``). Batch 2 at 3x800x1333
and 3x512x683. A step is the forward, a loss (mean squared class logits plus mean box coordinates: a scalar that
reaches both heads, without the Hungarian matcher, which syncs with the host and needs scipy) and the backward.

For each image size, precision (fp32, bf16 autocast), mode (eager, ``torch.compile``) and attention path (the
model's own PyTorch attention, msda, deformops' patch where installed): the median step time over ``--seconds`` of
steps after warm-up, the peak memory of a step, and, from torch.profiler, the attention's GPU time per step and its
share of the step's GPU time. Attention kernels are those launched under the path's ops (``ATTENTION_OPS``) or
named for them (``ATTENTION_KERNELS``: compiled code inlines msda's and deformops' Triton kernels and fuses
grid_sample). Prints a table, writes JSON. ``--device cpu --tiny`` runs a tiny model on the CPU: a check that the
script works (its times mean nothing; the attention share is of CPU time there).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics

import msda_core
import torch
from msda_testkit import cli
from tabulate import tabulate

from .bench import environment
from .timing import host_ms

SIZES = ("800x1333", "512x683")
TINY_SIZE = "64x96"
PRECISIONS = ("fp32", "bf16")
MODES = ("eager", "compile")
# An op (or autograd node) counts when its profiler name contains one of these: msda's backward runs under its
# autograd.Function's node, "autograd::engine::evaluate_function: DeformAttnBackward".
ATTENTION_OPS = {"pytorch": ("aten::grid_sampler_2d",), "msda": ("msda::", "DeformAttnBackward"),
                 "deformops": ("deformops_triton::", "deformops_cuda::")}
ATTENTION_KERNELS = {"pytorch": ("grid_sampler_2d",), "msda": ("forward_kernel", "backward_kernel"),
                     "deformops": ("msda_",)}


def patch_msda(model) -> msda_core.PatchReport:
    """The one-line switch a user makes: msda_core.patch, strict, so a transformers that names its attention
    otherwise fails here rather than timing the model's own path."""
    return msda_core.patch(model, strict=True)


def patch_deformops(model) -> None:
    importlib.import_module("deformops.integrations.transformers").patch(model)


PATCHES = {"pytorch": lambda model: None, "msda": patch_msda, "deformops": patch_deformops}  # each patches in place


def build_model(tiny: bool):
    """A Deformable DETR for object detection with random weights; ``tiny``: a few thousand parameters."""
    from transformers import DeformableDetrConfig, DeformableDetrForObjectDetection, ResNetConfig

    stages = ["stage2", "stage3", "stage4"]  # strides 8, 16, 32; the fourth level is a strided conv on the last
    if tiny:
        backbone = ResNetConfig(out_features=stages, embedding_size=8, hidden_sizes=[8, 16, 16, 16],
                                depths=[1, 1, 1, 1])
        sizes = dict(d_model=32, encoder_layers=1, decoder_layers=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                     num_queries=10)
    else:
        backbone, sizes = ResNetConfig(out_features=stages), {}
    config = DeformableDetrConfig(use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=backbone,
                                  **sizes)
    return DeformableDetrForObjectDetection(config)


def _loss(outputs):
    return outputs.logits.float().square().mean() + outputs.pred_boxes.float().mean()


def attention_time(profile, path: str, device_type: str) -> tuple:
    """(attention time, total time) in microseconds from a torch.profiler profile. On the GPU, over the kernels:
    those launched under an op named by ATTENTION_OPS[path] (the op's device time) and, once, those whose own name
    is in ATTENTION_KERNELS[path]; on the CPU, the outermost named ops' CPU time over all ops' self CPU time."""
    events = profile.events()
    ops, kernels = ATTENTION_OPS[path], ATTENTION_KERNELS[path]

    def named(event):
        return any(op in event.name for op in ops)

    outermost = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and named(e)
                 and not any(named(a) for a in _ancestors(e.cpu_parent))]
    if device_type == "cpu":
        return sum(e.cpu_time_total for e in outermost), sum(e.self_cpu_time_total for e in events)
    device_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    by_kernel_name = sum(e.time_range.elapsed_us() for e in device_events if any(k in e.name for k in kernels))
    already_counted = sum(k.duration for e in outermost for sub in _subtree(e) for k in sub.kernels
                          if any(name in k.name for name in kernels))
    attention = sum(e.device_time_total for e in outermost) + by_kernel_name - already_counted
    return attention, sum(e.time_range.elapsed_us() for e in device_events)


def _ancestors(event):
    while event is not None:
        yield event
        event = event.cpu_parent


def _subtree(event):
    yield event
    for child in event.cpu_children:
        yield from _subtree(child)


def measure(path: str, size: str, precision: str, mode: str, args, device) -> dict:
    torch.manual_seed(0)
    model = build_model(args.tiny)
    PATCHES[path](model)
    model.to(device).train()
    step_model = torch.compile(model) if mode == "compile" else model
    height, width = map(int, size.split("x"))
    pixels = torch.randn(args.batch, 3, height, width, device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = _loss(step_model(pixel_values=pixels))
        loss.backward()
        model.zero_grad(set_to_none=True)

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        step()
    times = host_ms(step, args.seconds)
    row = {"path": path, "size": size, "precision": precision, "mode": mode, "batch": args.batch,
           "step_ms": statistics.median(times), "step_spread_ms": [min(times), max(times)]}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        step()
        synchronize()
        row["peak_mb"] = torch.cuda.max_memory_allocated(device) / 2 ** 20
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(args.profile_steps):
            step()
        synchronize()
    attention, total = attention_time(profile, path, device.type)
    row["attention_ms_per_step"] = attention / 1e3 / args.profile_steps
    row["attention_share"] = attention / total if total else None
    return row


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of steps >= 1, got {text!r}")
    return int(text)


def main(argv=None) -> int:
    parser = cli.parser("msda_benchmarks.model_bench", __doc__)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu with --tiny to check the script")
    parser.add_argument("--tiny", action="store_true", help=f"a tiny model at {TINY_SIZE}, to check the script")
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), help="images, HxW")
    parser.add_argument("--batch", type=int, default=2, help="images per step")
    parser.add_argument("--precisions", nargs="*", default=list(PRECISIONS), choices=list(PRECISIONS),
                        help="fp32, or bf16 autocast")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES), help="eager or torch.compile")
    parser.add_argument("--paths", nargs="*", default=list(PATCHES), choices=list(PATCHES),
                        help="attention paths (deformops: skipped when it is not installed)")
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="the least time of timed steps (the median step is reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, autotuning)")
    parser.add_argument("--profile-steps", type=_positive, default=2, help="steps profiled for the attention's share")
    parser.add_argument("--json", default="model_bench.json",
                        help="where the results go, in the current folder by default")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("model_bench runs on a CUDA GPU and none is available (--device cpu --tiny checks the script)")
        return 2
    if device.type == "cpu" and not args.tiny:
        print("model_bench on the CPU runs only the tiny model (--tiny), a check of the script")
        return 2
    try:
        importlib.import_module("transformers")
    except ImportError:
        print("model_bench needs transformers (pip install transformers); it is not installed")
        return 2
    paths = list(args.paths)
    if "deformops" in paths and importlib.util.find_spec("deformops") is None:
        print("deformops is not installed: its path is skipped")
        paths.remove("deformops")
    rows = []
    for size in [TINY_SIZE] if args.tiny else args.sizes:
        for precision in args.precisions:
            for mode in args.modes:
                for path in paths:
                    try:
                        rows.append(measure(path, size, precision, mode, args, device))
                    except Exception as err:  # one path failing (say, to compile) must not end the run
                        rows.append({"path": path, "size": size, "precision": precision, "mode": mode,
                                     "error": f"{type(err).__name__}: {err}"})
                    print(rows[-1], flush=True)
    env = environment(device)
    env["transformers"] = importlib.import_module("transformers").__version__
    print(json.dumps(env))
    columns = ["size", "precision", "mode", "path", "step_ms", "peak_mb", "attention_ms_per_step",
               "attention_share", "error"]
    columns = [c for c in columns if any(c in r for r in rows)]
    print(tabulate([[r.get(c) for c in columns] for r in rows], headers=columns, floatfmt=".4g"))
    cli.write_results(args.json, env, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
