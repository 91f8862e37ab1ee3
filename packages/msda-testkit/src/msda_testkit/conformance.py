"""``python -m msda_testkit.conformance``: the checks every backend must pass, generated from what it declares.

For each backend, each device type it declares that this machine has, each value dtype it declares and each mode
it declares (``grad_accum`` "native" and "fp32" where it ``honors_grad_accum``, ``deterministic=True`` where it is
``deterministic_on_request``), the suite generates:

- ``parity``: every edge case of ``msda_testkit.cases`` (and ``CROWDED``), output and three gradients, against
  float64 ``naive`` on the CPU, within the tolerance table; half values also with fp32 locations;
- ``mixed``: half values with fp32 locations keep the locations' precision;
- ``nonfinite``: docs/math.md's rules ("Non-finite inputs") for inf and NaN in weights, value and locations, as
  ``naive`` gives them;
- ``knots``: Deformable DETR's initialisation on knots follows the compiled extension (``msda_testkit.knots``);
- ``fuzz``: ``msda_testkit.fuzz``, hypothesis' fixed examples and a fresh seed;
- ``opcheck``, ``opcheck_schema``, ``opcheck_aot``: ``torch.library.opcheck`` of both public ops with the backend;
- ``gradcheck``: finite differences of the op (float64 backends);
- ``replay``: a reproducible backward (``reproducible_on`` the device, or ``deterministic=True``) gives the same
  bits on every run;
- ``compile``, ``export``: ``torch.compile(fullgraph=True)`` and ``torch.export`` of the op with the backend, against
  eager; a ``traceable`` backend leaves no opaque op after decomposition, another one does.

A call the backend refuses through its declarations (``limits`` included) is skipped with its reason. ``Budget``
bounds what a run costs; ``waive`` (check-id patterns -> reason) skips checks that cannot run in a setting, with the
reason shown. Run against any installed backend, one registered from outside this repository included::

    python -m msda_testkit.conformance --backend NAME [--device cpu] [--fuzz-examples 40] [-k parity]

From pytest, parametrize one test over ``plan(...)`` (docs/backends.md).
"""

from __future__ import annotations

import fnmatch
import functools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import msda_core
import torch

from . import cli, fuzz, knots
from .cases import (
    DIFFERENTIABLE,
    EDGE_CASES,
    GRADCHECK_HEAD_DIMS,
    Case,
    grad_output_for,
    infinite_pixel_inputs,
    make_inputs,
    upcast,
)
from .compare import assert_close
from .parity import GRAD_NAMES, check_parity, grad_value_effect, run
from .replay import assert_replays_bit_exact
from .tolerances import tolerance

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
DTYPES = (F64, F32, F16, BF16)  # the order checks run in
HALF = (F16, BF16)
# many queries on one 2x2 map: hundreds of contributions land on each element of grad_value (atomic adds)
CROWDED = Case("crowded", queries=200, heads=1, head_dim=8, levels=((2, 2),), points=2)
OPCHECK_AOT_CASES = ("tiny", "no_level_start", "non_contiguous")  # the AOT dispatch check compiles: a few cases
FULL_JACOBIAN_HEAD_DIM = 3  # gradcheck compares the whole Jacobian up to this head dim, fast_mode past it
KNOT_LEVELS = {"powers_of_two": ((8, 8), (4, 2)), "other_sizes": ((6, 10), (3, 5))}


class Skip(Exception):
    """The check does not apply: the backend refuses the call (its reason), or a waiver."""


@dataclass(frozen=True)
class Budget:
    """What one backend's run may cost. ``fuzz_examples``: hypothesis examples per fuzz run (two runs);
    ``gradcheck_head_dims``: the head dims gradcheck runs at (the full Jacobian up to 3, fast_mode past it);
    ``other_variant_cases``: the parity cases of every variant but a dtype's first (its other locations dtype,
    accumulation path or deterministic mode), None for every case: the first variant of each dtype always runs
    every case."""

    fuzz_examples: int = 100
    gradcheck_head_dims: tuple = GRADCHECK_HEAD_DIMS
    other_variant_cases: tuple | None = None


@dataclass(frozen=True)
class Check:
    """One generated check: ``id`` says what runs (backend-device-check-details), ``run()`` raises AssertionError
    on failure and ``Skip`` where it does not apply."""

    id: str
    function: Callable[[], None]
    waived: str | None = None

    def run(self) -> None:
        if self.waived is not None:
            raise Skip(self.waived)
        self.function()

    def __str__(self) -> str:
        return self.id


def run_under_pytest(check: Check) -> None:
    """``check.run()`` inside a pytest test: a ``Skip`` becomes pytest's skip, with its reason."""
    import pytest

    try:
        check.run()
    except Skip as why:
        pytest.skip(str(why))


def available_devices() -> tuple:
    """The device types this machine can run: cpu, and cuda where torch sees a GPU."""
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def plan(name: str, *, budget: Budget = Budget(), devices: tuple | None = None, waive: dict | None = None) -> list:
    """The checks of backend ``name`` (loaded from the registry) on ``devices`` (default: the device types it
    declares that this machine has), in a fixed order.

    Args:
        name: a registered backend (``msda_core.backends()``), first-party or from an entry point.
        budget: what the run may cost (``Budget``).
        devices: device types to run on, e.g. ("cpu",); those the backend does not declare are left out.
        waive: fnmatch patterns of check ids -> why they cannot run here; matching checks raise ``Skip``.

    Returns:
        A list of ``Check``.

    Raises:
        KeyError: ``name`` is not a registered backend.

    Example:
        >>> checks = plan("gather", devices=("cpu",))
        >>> checks[0].id
        'gather-cpu-parity-f64-tiny'
    """
    backend = msda_core.backends()[name]
    devices = [d for d in (devices or available_devices()) if d in backend.devices]
    checks = []
    for device in devices:
        checks += _device_checks(backend, device, budget)
    waive = waive or {}
    return [replace(c, waived=next((why for pattern, why in waive.items() if fnmatch.fnmatchcase(c.id, pattern)),
                                   None)) for c in checks]


def _short(dtype: torch.dtype) -> str:
    return {F64: "f64", F32: "f32", F16: "f16", BF16: "bf16"}[dtype]


def _dtypes(backend) -> list:
    return [d for d in DTYPES if d in backend.dtypes]


def _variants(backend, device: str) -> list:
    """(value dtype, location dtype, grad_accum, deterministic) for every mode the backend declares: each dtype
    with its own locations, and half values also with fp32 ones. grad_accum "auto" is "fp32" for half values and
    "native" for fp32 and fp64, where both name one path (msda_testkit.parity.grad_value_effect), so a backend that
    honors grad_accum runs the named paths instead: both for half values, "native" for the others."""
    variants = []
    for dtype in _dtypes(backend):
        accums = ("auto",) if not backend.honors_grad_accum else ("native", "fp32") if dtype in HALF else ("native",)
        for location_dtype in (dtype, F32) if dtype in HALF else (dtype,):
            variants += [(dtype, location_dtype, accum, False) for accum in accums]
            if backend.deterministic_on_request and device not in backend.reproducible_on:
                variants.append((dtype, location_dtype, "auto", True))
    return variants


def _variant_id(dtype, location_dtype, grad_accum, deterministic) -> str:
    parts = [_short(dtype) + ("" if location_dtype == dtype else f"/{_short(location_dtype)}")]
    parts += [grad_accum] if grad_accum != "auto" else []
    parts += ["deterministic"] if deterministic else []
    return "-".join(parts)


def _device_checks(backend, device: str, budget: Budget) -> list:
    name, prefix = backend.name, f"{backend.name}-{device}"
    checks = []

    def add(what: str, function: Callable, *args) -> None:
        checks.append(Check(f"{prefix}-{what}", functools.partial(function, *args)))

    first_of_dtype: set = set()
    for variant in _variants(backend, device):
        first = variant[0] not in first_of_dtype
        first_of_dtype.add(variant[0])
        for case in EDGE_CASES + (CROWDED,):
            if first or budget.other_variant_cases is None or case.name in budget.other_variant_cases:
                add(f"parity-{_variant_id(*variant)}-{case.name}", _parity, name, device, case, *variant)
    for dtype in [d for d in _dtypes(backend) if d in HALF]:
        add(f"mixed-{_short(dtype)}", _mixed_precision, name, device, dtype)
    for dtype in _dtypes(backend):
        for rule in NONFINITE_RULES:
            add(f"nonfinite-{rule.__name__.removeprefix('_nonfinite_')}-{_short(dtype)}", rule, name, device, dtype)
    for dtype in [d for d in _dtypes(backend) if d in (F64, F32)]:
        for levels in KNOT_LEVELS:
            add(f"knots-{_short(dtype)}-{levels}", _knots, name, device, dtype, levels)
    for run_kind in ("fixed", "fresh_seed"):
        add(f"fuzz-{run_kind}", _fuzz, name, device, tuple(_dtypes(backend)), budget.fuzz_examples, run_kind)
    dtype = F64 if F64 in backend.dtypes else _dtypes(backend)[0]
    for case in EDGE_CASES:
        add(f"opcheck-{_short(dtype)}-{case.name}", _opcheck, name, device, dtype, case,
            ("test_autograd_registration", "test_faketensor"))
    for case in EDGE_CASES:
        add(f"opcheck_schema-{_short(dtype)}-{case.name}", _opcheck, name, device, dtype, case, ("test_schema",))
    for case in [c for c in EDGE_CASES if c.name in OPCHECK_AOT_CASES]:
        add(f"opcheck_aot-{_short(dtype)}-{case.name}", _opcheck, name, device, dtype, case,
            ("test_aot_dispatch_dynamic",))
    if F64 in backend.dtypes:
        for head_dim in budget.gradcheck_head_dims:
            add(f"gradcheck-f64-d{head_dim}", _gradcheck, name, device, head_dim)
    reproducible = device in backend.reproducible_on
    if reproducible or backend.deterministic_on_request:
        deterministic = not reproducible
        for dtype in _dtypes(backend):
            add(f"replay-{_short(dtype)}{'-deterministic' if deterministic else ''}", _replay, name, device, dtype,
                deterministic)
    dtype = F32 if F32 in backend.dtypes else _dtypes(backend)[0]
    add(f"compile-{_short(dtype)}", _compile, name, device, dtype)
    add(f"export-{_short(dtype)}", _export, name, device, dtype)
    return checks


def _refused(name: str, inputs: dict, grad_accum: str = "auto", deterministic: bool = False) -> None:
    """Skip where the backend's declarations refuse the call (device, dtype, its limits)."""
    meta = msda_core.Metadata.of(inputs["value"], inputs["sampling_locations"], grad_accum, deterministic)
    reasons = msda_core.backends()[name].not_supported_reasons(meta)
    if reasons:
        raise Skip(f"{name} declares it cannot run this call: {'; '.join(reasons)}")


@functools.lru_cache(maxsize=32)
def _naive_float64(case: Case, dtype: torch.dtype, location_dtype: torch.dtype) -> dict:
    """float64 naive's output and gradients on the CPU for ``case`` rounded to the dtypes, the grad_output seeded
    as the check's (the same for every mode and device of one variant: computed once)."""
    inputs = make_inputs(case, dtype, location_dtype)
    return run(upcast(inputs, F64), "naive", grad_output_for(inputs).double())


def _parity(name, device, case, dtype, location_dtype, grad_accum, deterministic) -> None:
    inputs = make_inputs(case, dtype, location_dtype, device=device)
    _refused(name, inputs, grad_accum, deterministic)
    expected = {k: v.to(device) for k, v in _naive_float64(case, dtype, location_dtype).items()}
    results = check_parity(inputs, name, grad_output=grad_output_for(inputs), expected=expected,
                           grad_accum=grad_accum, deterministic=deterministic)
    failed = [str(r) for r in results if not r.passed]
    assert not failed, f"{name} against float64 naive on {case.name}:\n" + "\n".join(failed)


def _mixed_precision(name, device, dtype) -> None:
    """Half value with fp32 locations: the locations are not rounded to half on the way. Within the table of
    float64 naive, and the same call with locations rounded to half measurably worse (the dtype mattered)."""
    inputs = make_inputs(EDGE_CASES[1], dtype, location_dtype=F32, device=device)  # out_of_bounds
    _refused(name, inputs)
    exact = run(upcast(inputs, F64, "cpu"), "naive")["output"]
    assert_close("output", run(inputs, name)["output"], exact, tolerance(dtype, "forward"))
    rounded = dict(inputs, sampling_locations=inputs["sampling_locations"].to(dtype).float())
    err_mixed = (run(inputs, name)["output"].cpu().double() - exact).abs().max()
    err_rounded = (run(rounded, name)["output"].cpu().double() - exact).abs().max()
    assert err_rounded > 2 * err_mixed, f"locations rounded to {dtype}: error {err_rounded:.3g}, fp32: {err_mixed:.3g}"


def _rule_inputs(Q: int, dtype, location_dtype=None, seed: int = 0) -> dict:
    """B=1, M=2, D=3 on levels (4, 5) and (2, 3), P=2: locations inside the maps, level starts derived."""
    location_dtype = location_dtype or dtype
    g = torch.Generator().manual_seed(seed)
    shapes = torch.tensor([(4, 5), (2, 3)])
    return {"value": torch.randn(1, 26, 2, 3, generator=g, dtype=F64).to(dtype), "spatial_shapes": shapes,
            "level_start_index": None,
            "sampling_locations": (torch.rand(1, Q, 2, 2, 2, 2, generator=g, dtype=F64) * 0.8 + 0.1).to(location_dtype),
            "attention_weights": torch.rand(1, Q, 2, 2, 2, generator=g, dtype=F64).to(location_dtype)}


def _as_naive(name, device, inputs, names=("output",), grad=False) -> dict:
    """``name`` on ``device`` gives naive's result on the same CPU inputs: NaN exactly where naive's is, an inf
    the same inf, the rest within the gradient entry of its dtype. (naive judges finiteness in the op's compute
    dtype, as every backend must.) Returns naive's results."""
    on_device = {k: (v.to(device) if v is not None else None) for k, v in inputs.items()}
    _refused(name, on_device)
    grad_output = grad_output_for(inputs) if grad else None
    actual = run(on_device, name, grad_output.to(device) if grad else None)
    expected = run(inputs, "naive", grad_output)
    for key in names:
        assert_close(key, actual[key], expected[key], tolerance(actual[key].dtype, "gradient"))
    return expected


def _nonfinite_weights(name, device, dtype) -> None:
    """An inf or NaN attention weight makes its output row (b, q, m) NaN, on the map or off it."""
    inputs = _rule_inputs(4, dtype)
    weights, locations = inputs["attention_weights"], inputs["sampling_locations"]
    weights[0, 0, 0, 0, 0] = torch.inf  # on the map
    locations[0, 1, 1, 1, 1] = 5.0
    weights[0, 1, 1, 1, 1] = -torch.inf  # off it
    weights[0, 2, 0, 1, 0] = torch.nan
    nan_rows = _as_naive(name, device, inputs)["output"].view(1, 4, 2, -1).isnan().all(-1)
    assert nan_rows.flatten().tolist() == [True, False, False, True, True, False, False, False]
    positive = _rule_inputs(4, dtype)  # every corner of the same sign: inf + inf, never inf - inf
    positive["value"].abs_()
    positive["attention_weights"][0, 0, 0, 0, 0] = torch.inf
    _as_naive(name, device, positive)


def _nonfinite_value(name, device, dtype) -> None:
    """An inf or NaN pixel of value changes only the samples that read it: samples off the map give 0, whatever
    value holds at the pixels an implementation might clamp them to."""
    for bad in (torch.inf, -torch.inf, torch.nan):
        inputs = _rule_inputs(4, dtype)
        inputs["value"][:, [0, 19, 20]] = bad  # level 0's first and last pixels, level 1's first
        locations = inputs["sampling_locations"]
        locations[:, 0] = -0.5  # query 0: every sample off the map, above and to the left
        locations[:, 1] = 1.5  # query 1: below and to the right
        locations[:, 2, :, :, :, 0] = -0.3  # query 2: left of the map, rows inside it
        expected = _as_naive(name, device, inputs, ("output", "grad_sampling_locations", "grad_attention_weights"),
                             grad=True)
        assert expected["output"][:, :2].eq(0).all()


def _nonfinite_locations(name, device, dtype) -> None:
    """A location whose pixel coordinate loc * W overflows the compute dtype (fp32, fp64 for fp64) is as a
    non-finite one: its row NaN, its location and weight gradients NaN. One that stays finite lies off the map."""
    location_dtype = F32 if dtype in HALF else dtype  # a half location cannot hold an fp32 overflow
    inputs = _rule_inputs(3, dtype, location_dtype)
    big = torch.finfo(F64 if dtype == F64 else F32).max / 2
    inputs["sampling_locations"][0, 0, 0, 0, 0, 0] = big  # x 5 or 3 pixels: overflows
    inputs["sampling_locations"][0, 1, 0, 0, 0, 1] = big / 8  # x 4 or 2 pixels: finite, far off the map
    expected = _as_naive(name, device, inputs, ("output", "grad_sampling_locations", "grad_attention_weights"),
                         grad=True)
    rows = expected["output"].view(1, 3, 2, -1)
    assert rows[0, 0, 0].isnan().all() and not rows[0, 1].isnan().any()


def _nonfinite_sampled_inf(name, device, dtype) -> None:
    """A sampled +-inf pixel gives +-inf where naive does (a weight times inf), NaN where it does (a zero weight on
    an inf, or +inf and -inf in one sum): msda_testkit.cases.infinite_pixel_inputs."""
    expected = _as_naive(name, device, infinite_pixel_inputs(dtype),
                         ("output", "grad_sampling_locations", "grad_attention_weights"), grad=True)
    rows = expected["output"].view(6, -1)
    assert rows[:3].isposinf().all() and rows[3].isneginf().all() and rows[4:].isnan().all()


NONFINITE_RULES = (_nonfinite_weights, _nonfinite_value, _nonfinite_locations, _nonfinite_sampled_inf)


def _knots(name, device, dtype, levels) -> None:
    inputs = {k: v.to(device) for k, v in knots.model_init_inputs(KNOT_LEVELS[levels], dtype=dtype).items()}
    _refused(name, inputs)
    knots.assert_follows_the_extension(name, inputs)


def _fuzz(name, device, dtypes, examples, run_kind) -> None:
    fuzz.fuzz(name, examples, seed=None if run_kind == "fixed" else fuzz.fresh_seed(), dtypes=dtypes, device=device)


def _opcheck(name, device, dtype, case, utils) -> None:
    """torch.library.opcheck of both public ops with the backend: ``utils`` of the schema (no mutation or aliasing
    it does not declare), the autograd registration, the fake-tensor kernel, the AOT dispatch (which compiles)."""
    inputs = make_inputs(case, dtype, device=device)
    _refused(name, inputs)
    grad = grad_output_for(inputs)
    detached = tuple(inputs.values())
    for k in DIFFERENTIABLE:
        inputs[k] = inputs[k].detach().requires_grad_()
    options = {"backend": name}
    torch.library.opcheck(torch.ops.msda.deform_attn.default, tuple(inputs.values()), options, test_utils=utils)
    torch.library.opcheck(torch.ops.msda.deform_attn_backward.default, (grad, *detached),
                          {**options, "grad_accum": "auto", "deterministic": None}, test_utils=utils)


def _gradcheck(name, device, head_dim) -> None:
    """Finite differences of the op, samples kept away from pixel kinks (docs/math.md). The full Jacobian at a
    few channels; past them a head dim changes only how many channels the same formulas run over, so fast_mode
    (the Jacobian against random vectors on both sides, which a wrong entry fails) suffices."""
    case = Case(f"gradcheck_d{head_dim}", head_dim=head_dim, layout="away_from_pixels", loc_range=(-0.2, 1.2))
    inputs = make_inputs(case, F64, device=device)
    _refused(name, inputs)
    leaves = [inputs[k].requires_grad_() for k in DIFFERENTIABLE]

    def op(value, locations, weights):
        return torch.ops.msda.deform_attn(value, inputs["spatial_shapes"], inputs["level_start_index"], locations,
                                          weights, backend=name)

    assert torch.autograd.gradcheck(op, leaves, eps=1e-6, atol=1e-7, rtol=1e-5,
                                    fast_mode=head_dim > FULL_JACOBIAN_HEAD_DIM)


def _replay(name, device, dtype, deterministic) -> None:
    """The backward the backend declares reproducible (on this device, or with deterministic=True) gives the same
    bits on every run, forward and three gradients, on a map where hundreds of terms reach each element."""
    inputs = make_inputs(CROWDED, dtype, device=device)
    _refused(name, inputs, deterministic=deterministic)
    grad_output = grad_output_for(inputs)
    assert_replays_bit_exact(lambda **inp: run(inp, name, grad_output, deterministic=deterministic or None), inputs,
                             replays=3, contention=True)


def _compile(name, device, dtype) -> None:
    """torch.compile(fullgraph=True) of the op with the backend, for inference and for training, against eager."""
    inputs = make_inputs(EDGE_CASES[1], dtype, device=device)  # out_of_bounds
    _refused(name, inputs)
    grad_output = grad_output_for(inputs)
    eager = run(inputs, name, grad_output)
    torch._dynamo.reset()
    compiled = torch.compile(lambda **kw: torch.ops.msda.deform_attn(**kw, backend=name), fullgraph=True)
    with torch.no_grad():
        assert_close("output", compiled(**inputs), eager["output"], tolerance(dtype, "forward"))
    leaves = {k: (v.detach().requires_grad_() if k in DIFFERENTIABLE else v) for k, v in inputs.items()}
    out = compiled(**leaves)
    assert_close("output", out.detach(), eager["output"], tolerance(dtype, "forward"))
    grads = torch.autograd.grad(out, [leaves[k] for k in DIFFERENTIABLE], grad_output)
    effect = grad_value_effect(name, inputs)
    for key, got in zip(GRAD_NAMES, grads):
        assert_close(key, got, eager[key], tolerance(dtype, effect if key == "grad_value" else "gradient"))


class _Layer(torch.nn.Module):
    def __init__(self, backend: str):
        super().__init__()
        self.backend = backend

    def forward(self, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        return torch.ops.msda.deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                                          attention_weights, backend=self.backend)


def _export(name, device, dtype) -> None:
    """torch.export records the public op (what the ONNX table keys on) and runs as eager; decomposing the program
    bakes in the backend: a traceable one's own operations, another one's call of the opaque op."""
    inputs = make_inputs(EDGE_CASES[1], dtype, device=device)  # out_of_bounds
    _refused(name, inputs)
    program = torch.export.export(_Layer(name), tuple(inputs.values()))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "msda.deform_attn.default" in targets, targets
    assert_close("output", program.module()(*inputs.values()), run(inputs, name)["output"],
                 tolerance(dtype, "forward"))
    decomposed = {str(n.target) for n in program.run_decompositions().graph.nodes if n.op == "call_function"}
    assert "msda.deform_attn.default" not in decomposed, decomposed
    opaque = any("msda._opaque_forward" in t for t in decomposed)
    traceable = msda_core.backends()[name].traceable
    assert opaque != traceable, f"declared traceable={traceable}, decomposed into {sorted(decomposed)}"


def main(argv=None) -> int:
    p = cli.parser("msda_testkit.conformance", __doc__)
    p.add_argument("--backend", action="append", required=True,
                   help="a registered backend (repeat for several); msda_core.backends() lists them")
    p.add_argument("--device", action="append", choices=("cpu", "cuda"),
                   help="device types to run on (repeat for several; default: every one the backend declares "
                        "that this machine has)")
    p.add_argument("--fuzz-examples", type=int, default=Budget.fuzz_examples, help="hypothesis examples per fuzz run")
    p.add_argument("-k", dest="pattern", default="*",
                   help="run only checks whose id matches this fnmatch pattern (substrings match: -k parity)")
    p.add_argument("--list", action="store_true", help="list the checks' ids and exit")
    args = p.parse_args(argv)
    known = msda_core.backends()
    unknown = [b for b in args.backend if b not in known]
    if unknown:
        p.error(f"--backend: expected one of {sorted(known)}, got {unknown} (errors: {msda_core.load_errors()})")
    pattern = args.pattern if any(c in args.pattern for c in "*?[") else f"*{args.pattern}*"
    budget = Budget(fuzz_examples=args.fuzz_examples)
    checks = [c for b in args.backend for c in plan(b, budget=budget, devices=args.device)
              if fnmatch.fnmatchcase(c.id, pattern)]
    if args.list:
        print("\n".join(c.id for c in checks))
        return 0
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for check in checks:
        start = time.perf_counter()
        try:
            check.run()
            verdict, detail = "passed", ""
        except Skip as why:
            verdict, detail = "skipped", f": {why}"
        except Exception as err:  # a failing check is reported, and the others still run
            verdict, detail = "failed", f":\n{type(err).__name__}: {err}"
        counts[verdict] += 1
        print(f"{verdict.upper():7} {check.id} ({time.perf_counter() - start:.1f} s){detail}", flush=True)
    print(", ".join(f"{n} {v}" for v, n in counts.items()))
    return 1 if counts["failed"] or not checks else 0


if __name__ == "__main__":
    sys.exit(main())
