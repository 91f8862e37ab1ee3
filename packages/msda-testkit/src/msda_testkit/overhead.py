"""``python -m msda_testkit.overhead``: host cost per call of the op, against what torch itself costs.

Times forward and forward + ``torch.autograd.grad`` on decoder-sized inputs for four layers of the same
call, each with kernels that do nothing (they allocate their outputs): a bare ``torch.autograd.Function``;
a ``torch.library`` op with ``register_autograd`` and a backward op, as msda is built; msda's own op with a
no-op backend; msda's op with a real backend. The differences say where a small call's time goes.
"""

from __future__ import annotations

import argparse
import time

import torch
from tabulate import tabulate

import msda_core

from .cases import case, grad_output_for, make_inputs

_NAMES = ("value", "spatial_shapes", "level_start_index", "sampling_locations", "attention_weights")


def _outputs_like(value, loc, weights):
    return torch.empty_like(value), torch.empty_like(loc), torch.empty_like(weights)


class _Bare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, loc, weights):
        ctx.save_for_backward(value, loc, weights)
        return value.new_empty(loc.shape[0], loc.shape[1], value.shape[2] * value.shape[3])

    @staticmethod
    def backward(ctx, grad_output):
        return _outputs_like(*ctx.saved_tensors)


def _library_op():
    """A torch.library op pair shaped like msda's (forward op, backward op, register_autograd)."""
    lib = torch.library.Library("msda_overhead", "FRAGMENT")
    lib.define("fwd(Tensor value, Tensor loc, Tensor weights) -> Tensor")
    lib.define("bwd(Tensor grad, Tensor value, Tensor loc, Tensor weights) -> (Tensor, Tensor, Tensor)")
    lib.impl("fwd", lambda v, l, w: v.new_empty(l.shape[0], l.shape[1], v.shape[2] * v.shape[3]),
             "CompositeExplicitAutograd")
    lib.impl("bwd", lambda g, v, l, w: _outputs_like(v, l, w), "CompositeExplicitAutograd")

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, grad_output):
        return torch.ops.msda_overhead.bwd(grad_output, *ctx.saved_tensors)

    torch.library.register_autograd("msda_overhead::fwd", backward, setup_context=setup_context, lib=lib)
    return lib, torch.ops.msda_overhead.fwd


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
    parser.add_argument("--backend", default="auto", help="the real backend of the last row")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    inputs = make_inputs(case("decoder_b4_q300"), torch.float32, device=device)
    value, shapes, starts, loc, weights = (inputs[k] for k in _NAMES)
    leaves = [t.requires_grad_() for t in (value, loc, weights)]
    grad_output = grad_output_for(inputs)
    msda_core.register(msda_core.Backend(
        "overhead_noop", forward=lambda v, s, st, l, w: v.new_empty(l.shape[0], l.shape[1], v.shape[2] * v.shape[3]),
        backward=lambda g, v, s, st, l, w, accum, det: _outputs_like(v, l, w),
        devices=frozenset({device.type}), dtypes=frozenset({torch.float32})))
    lib, library_op = _library_op()
    layers = {
        "autograd.Function, no kernel": lambda: _Bare.apply(value, loc, weights),
        "torch.library op pair, no kernel": lambda: library_op(value, loc, weights),
        "msda op, no-op backend": lambda: msda_core.deform_attn(value, shapes, starts, loc, weights,
                                                                backend="overhead_noop"),
        f"msda op, backend {args.backend!r}": lambda: msda_core.deform_attn(value, shapes, starts, loc, weights,
                                                                            backend=args.backend),
    }
    rows = []
    try:
        for name, forward in layers.items():
            fwd = _per_call_ms(forward, device, args.calls)
            both = _per_call_ms(lambda: torch.autograd.grad(forward(), leaves, grad_output), device, args.calls)
            rows.append([name, fwd, both])
    finally:
        msda_core.unregister("overhead_noop")
        lib._destroy()
    print(f"{device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), torch "
          f"{torch.__version__}, decoder B4 Q300 fp32, {args.calls} calls each")
    print(tabulate(rows, headers=["layer", "forward ms/call", "forward+grad ms/call"], floatfmt=".4f"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
