"""``python -m msda_benchmarks.overhead``: host cost per call of the op, against what torch itself costs.

Times forward and forward + ``torch.autograd.grad`` on decoder-sized inputs for layers of the same call: a bare
``torch.autograd.Function``; a public CompositeImplicitAutograd ``torch.library`` op with msda's schema whose kernel
applies that Function (the floor of msda's design: msda_core.op); msda's op with a no-op traceable backend (adds
validation and selection) and with a no-op opaque backend (adds the private custom op); the real backend's forward
called alone; and msda's op with the real backend. The differences say where a small call's time goes.

Two measures: the host's time per call (a loop of calls, then one synchronize), and on CUDA the bench's own "called"
figures (msda_benchmarks.bench: medians of triton.testing.do_bench, backward = forward+grad less forward). do_bench
zeroes a 256 MB buffer before each call and the host's work overlaps that fill, so the bench's figures sit below the
host's time by up to the fill's duration.
"""

from __future__ import annotations

import msda_core
import torch
from msda_core import op
from msda_testkit import cli
from msda_testkit.cases import ARGUMENTS, case, grad_output_for, make_inputs
from tabulate import tabulate

from .bench import environment
from .timing import loop_ms, median_ms


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


def _composite_op(lib):
    """A public op with msda's schema whose CompositeImplicitAutograd kernel applies _Bare: no validation, no
    selection, no kernel."""
    lib.define("floor" + op.SCHEMA)
    lib.impl("floor", lambda value, shapes, starts, loc, weights, **options: _Bare.apply(value, loc, weights),
             "CompositeImplicitAutograd")
    return torch.ops.msda_overhead.floor


def _noop_backend(name, device, dtype, traceable):
    return msda_core.Backend(
        name, forward=lambda i: i.value.new_empty(msda_core.output_shape(i.value, i.sampling_locations)),
        backward=lambda g, i, accum, det: _outputs_like(i.value, i.sampling_locations, i.attention_weights),
        devices=frozenset({device.type}), dtypes=frozenset({dtype}), traceable=traceable)


def main(argv=None) -> int:
    parser = cli.parser("msda_benchmarks.overhead", __doc__)
    cli.add_device(parser)
    parser.add_argument("--backend", default="auto", help="the real backend (auto: what the op chooses)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="value's dtype")
    parser.add_argument("--calls", type=int, default=2000, help="calls per layer and measure")
    parser.add_argument("--case", default="decoder_b4_q300", help="the inputs, a msda_testkit case")
    parser.add_argument("--json", default="overhead.json", help="where the results go")
    args = parser.parse_args(argv)
    device = cli.device(parser.prog, args.device)
    dtype = getattr(torch, args.dtype)
    inputs = make_inputs(case(args.case), dtype, device=device)
    value, shapes, starts, loc, weights = (inputs[k] for k in ARGUMENTS)
    leaves = [t.requires_grad_() for t in (value, loc, weights)]
    grad_output = grad_output_for(inputs)
    for name, traceable in (("overhead_traceable", True), ("overhead_opaque", False)):
        msda_core.register(_noop_backend(name, device, dtype, traceable))
    chosen = msda_core.resolve(args.backend, msda_core.Metadata.of(value, loc))
    lib = torch.library.Library("msda_overhead", "FRAGMENT")
    floor = _composite_op(lib)
    detached = msda_core.Inputs(*(t.detach() for t in (value, shapes, starts, loc, weights)))
    layers = {
        "autograd.Function, no kernel": lambda: _Bare.apply(value, loc, weights),
        "composite op -> autograd.Function, no kernel": lambda: floor(value, shapes, starts, loc, weights),
        "msda op, no-op traceable backend": lambda: msda_core.deform_attn(value, shapes, starts, loc, weights,
                                                                          backend="overhead_traceable"),
        "msda op, no-op opaque backend": lambda: msda_core.deform_attn(value, shapes, starts, loc, weights,
                                                                       backend="overhead_opaque"),
        f"backend {chosen.name!r}: its forward alone": lambda: chosen.forward(detached),
        f"msda op, backend {chosen.name!r}": lambda: msda_core.deform_attn(value, shapes, starts, loc, weights,
                                                                           backend=chosen.name),
    }
    rows = []
    try:
        for name, forward in layers.items():
            differentiable = "forward alone" not in name
            forward_backward = lambda: torch.autograd.grad(forward(), leaves, grad_output)  # noqa: E731
            row = [name, loop_ms(forward, args.calls),
                   loop_ms(forward_backward, args.calls) if differentiable else None]
            if device.type == "cuda":
                fwd = median_ms(forward, device)
                row += [fwd, median_ms(forward_backward, device) - fwd if differentiable else None]
            rows.append(row)
    finally:
        for name in ("overhead_traceable", "overhead_opaque"):
            msda_core.unregister(name)
        lib._destroy()
    env = dict(environment(device), case=args.case, dtype=args.dtype, calls=args.calls)
    print(env)
    headers = ["layer", "host fwd ms/call", "host fwd+grad ms/call"]
    if device.type == "cuda":
        headers += ["bench fwd ms", "bench bwd ms"]
    print(tabulate(rows, headers=headers, floatfmt=".4f", missingval="-"))
    cli.write_results(args.json, env, [dict(zip(headers, row)) for row in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
