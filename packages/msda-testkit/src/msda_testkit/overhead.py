"""``python -m msda_testkit.overhead``: host cost per call of the op, against what torch itself costs.

Times forward and forward + ``torch.autograd.grad`` on decoder-sized inputs for layers of the same call:
a bare ``torch.autograd.Function``; a ``torch.library`` op pair with msda's own schemas, built as msda's is
(forward op, backward op, ``msda_core.op.register_autograd``), whose kernels only allocate their outputs (the
floor of this design); the same pair calling the real backend's forward and backward directly (msda's op without
its validation and selection); msda's op with a no-op backend; msda's op with the real backend. The
differences say where a small call's time goes.

Two measures: the host's time per call (a loop of calls, then one synchronize), and on CUDA the bench's
own "called" figures (``msda_testkit.bench``: medians of ``triton.testing.do_bench``, backward = forward+grad
less forward). do_bench zeroes a 256 MB buffer before each call, and the host's work for the call
overlaps that fill, so the bench's figures sit below the host's time by up to the fill's duration.
"""

from __future__ import annotations

import argparse
import time

import torch
from tabulate import tabulate

import msda_core
from msda_core import op

from .bench import median_ms
from .cases import ARGUMENTS, case, grad_output_for, make_inputs


def _outputs_like(value, loc, weights):
    return torch.empty_like(value), torch.empty_like(loc), torch.empty_like(weights)


class _Bare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, loc, weights):
        ctx.save_for_backward(value, loc, weights)
        return value.new_empty(msda_core.output_shape(value, loc))

    @staticmethod
    def backward(ctx, grad_output):
        return _outputs_like(*ctx.saved_tensors)


def _library_op_pair(lib, name: str, backend=None):
    """Define ``lib``'s op pair ``name`` / ``name_backward`` with msda's schemas and autograd registration.
    Its kernels allocate their outputs, or with ``backend`` (a registry Backend) call its forward and backward
    directly: no validation, no selection."""
    lib.define(name + op.SCHEMA)
    lib.define(f"{name}_backward" + op.BACKWARD_SCHEMA)

    def forward(value, spatial_shapes, level_start_index, loc, weights, **options):
        if backend:
            return backend.forward(value, spatial_shapes, level_start_index, loc, weights)
        return value.new_empty(msda_core.output_shape(value, loc))

    def backward(grad_output, value, spatial_shapes, level_start_index, loc, weights, **options):
        if backend:
            return backend.backward(grad_output, value, spatial_shapes, level_start_index, loc, weights, "auto", False)
        return _outputs_like(value, loc, weights)

    lib.impl(name, forward, "CompositeExplicitAutograd")
    lib.impl(f"{name}_backward", backward, "CompositeExplicitAutograd")
    op.register_autograd(lib, name)
    return getattr(torch.ops.msda_overhead, name)


def _per_call_ms(fn, device, calls: int) -> float:
    for _ in range(max(10, calls // 20)):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / calls * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto", help="the real backend (auto: what the op would choose)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    inputs = make_inputs(case("decoder_b4_q300"), dtype, device=device)
    value, shapes, starts, loc, weights = (inputs[k] for k in ARGUMENTS)
    leaves = [t.requires_grad_() for t in (value, loc, weights)]
    grad_output = grad_output_for(inputs)
    msda_core.register(msda_core.Backend(
        "overhead_noop", forward=lambda v, s, st, l, w: v.new_empty(msda_core.output_shape(v, l)),
        backward=lambda g, v, s, st, l, w, accum, det: _outputs_like(v, l, w),
        devices=frozenset({device.type}), dtypes=frozenset({dtype})))
    chosen = msda_core.resolve(msda_core.requested(args.backend), msda_core.Inputs.of(value, loc))
    lib = torch.library.Library("msda_overhead", "FRAGMENT")
    pairs = {"torch.library op pair, msda's schemas, no kernel": _library_op_pair(lib, "plain"),
             f"the same, calling backend {chosen.name!r} directly": _library_op_pair(lib, "direct", chosen)}
    layers = {"autograd.Function, no kernel": lambda: _Bare.apply(value, loc, weights)}
    layers |= {name: (lambda pair=pair: pair(value, shapes, starts, loc, weights)) for name, pair in pairs.items()}
    layers |= {
        "msda op, no-op backend": lambda: msda_core.deform_attn(value, shapes, starts, loc, weights,
                                                                backend="overhead_noop"),
        f"msda op, backend {chosen.name!r}": lambda: msda_core.deform_attn(value, shapes, starts, loc, weights,
                                                                           backend=chosen.name),
    }
    rows = []
    try:
        for name, forward in layers.items():
            forward_backward = lambda: torch.autograd.grad(forward(), leaves, grad_output)  # noqa: E731
            row = [name, _per_call_ms(forward, device, args.calls), _per_call_ms(forward_backward, device, args.calls)]
            if device.type == "cuda":
                fwd = median_ms(forward, device, 0)
                row += [fwd, median_ms(forward_backward, device, 0) - fwd]
            rows.append(row)
    finally:
        msda_core.unregister("overhead_noop")
        lib._destroy()
    print(f"{device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), torch "
          f"{torch.__version__}, decoder B4 Q300 {args.dtype}, {args.calls} calls each")
    headers = ["layer", "host fwd ms/call", "host fwd+grad ms/call"]
    if device.type == "cuda":
        headers += ["bench fwd ms", "bench bwd ms"]
    print(tabulate(rows, headers=headers, floatfmt=".4f"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
