"""Property-based fuzzing of msda.deform_attn (hypothesis): random valid and malformed calls on one backend.

A valid call must give float64 ``naive``'s result on the same inputs, forward and gradients, within the tolerance
table (``check_parity``). Some pixels of ``value`` are +-inf or NaN (not pixel 0, which gather's off-map taps read
when no other of the first 64 is finite everywhere; not in the layouts ``ON_KNOTS``): a result is then inf or NaN
where naive's in the inputs' own dtype is, the same infinity or NaN (docs/math.md, "Non-finite inputs"), and a
finite one as above. Its locations lie in [0, 1] (the layouts of ``cases`` move some onto knots,
edges and corners, or make them non-finite) and one lies at the centre of a map: the table's ``atol`` is relative
to the largest result, and a call whose every sample barely touches the map has only tiny results, next to which
the rounding of an fp32 location (of order u times value) is large.
A malformed one (one argument broken in one of the ways ``MALFORMATIONS`` lists; off the CPU, not the level
table's values, ``TABLE_VALUES``) must raise ValueError or TypeError whose message starts with that argument's
name, before the backend runs.

``fuzz(backend, max_examples, seed)`` runs the property: ``seed=None`` is hypothesis' derandomized run, the same
examples on every run; an int seeds a random run, whose seed the failure message names (``MSDA_FUZZ_SEED``
replays it). Tests call it twice: once fixed, once with a fresh seed.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from .cases import ARGUMENTS, DIFFERENTIABLE, Case, grad_output_for, make_inputs, upcast
from .parity import check_parity, run

SEED_VARIABLE = "MSDA_FUZZ_SEED"
LAYOUTS = ("random", "pixel_centres", "map_corners", "past_edges", "nonfinite")
HALF = (torch.float16, torch.bfloat16)
NONFINITE = (math.inf, -math.inf, math.nan)  # value's pixels
# Layouts whose pixel coordinates lie on knots up to rounding, where which corners a sample reads (with weight 0 or
# next to it) depends on each backend's rounding of loc * W - 0.5: 0 * inf is NaN, 1e-8 * inf is inf
ON_KNOTS = ("pixel_centres", "past_edges")


def _with(arg, change):
    return lambda inputs: {**inputs, arg: change(inputs[arg])}


# name -> (the argument the error must name, how the call is broken)
MALFORMATIONS = {
    "value rank": ("value", _with("value", lambda v: v[..., 0])),
    "value integer": ("value", _with("value", lambda v: v.to(torch.int32))),
    "value heads": ("sampling_locations", _with("value", lambda v: torch.cat((v, v), 2))),  # M from value
    "shapes rank": ("spatial_shapes", _with("spatial_shapes", lambda s: s[:, 0])),
    "shapes float": ("spatial_shapes", _with("spatial_shapes", lambda s: s.float())),
    "shapes sum": ("spatial_shapes", _with("spatial_shapes", lambda s: s + 1)),
    "shapes zero": ("spatial_shapes", _with("spatial_shapes", lambda s: s * 0)),
    "shapes parameter sum": ("spatial_shapes",
                             _with("spatial_shapes", lambda s: torch.nn.Parameter(s + 1, requires_grad=False))),
    "starts values": ("level_start_index", lambda i: {**i, "level_start_index": _starts(i) + 1}),
    "starts length": ("level_start_index", lambda i: {**i, "level_start_index": _starts(i)[:-1]}),
    "locations rank": ("sampling_locations", _with("sampling_locations", lambda t: t[..., 0])),
    "locations points": ("attention_weights", _with("sampling_locations", lambda t: torch.cat((t, t), 4))),
    "locations integer": ("sampling_locations", _with("sampling_locations", lambda t: t.to(torch.int64))),
    "locations device": ("sampling_locations", _with("sampling_locations", lambda t: t.to("meta"))),
    "weights shape": ("attention_weights", _with("attention_weights", lambda t: t[:, :, :, :, :0])),
    "weights dtype": ("attention_weights",
                      _with("attention_weights", lambda t: t.to(torch.float64 if t.dtype != torch.float64
                                                                 else torch.float32))),
}


# Malformed level-table *values*: raised where the table is in CPU memory. A CUDA table is never read on the host
# (msda_core.validation); the kernels keep such a call inside value instead, which msda-triton's
# test_a_wrong_level_table_on_the_gpu_reads_nothing_outside_value checks.
TABLE_VALUES = ("shapes sum", "shapes zero", "shapes parameter sum", "starts values")


# How the differentiable tensors are stored: the same values, other strides
MEMORY_LAYOUTS = {
    "contiguous": lambda t: t,
    "gapped": lambda t: t.new_empty(*t.shape, 2)[..., 0].copy_(t),  # a gap after every element
    "queries innermost": lambda t: t.transpose(1, -1).contiguous().transpose(1, -1),
}


def _starts(inputs):
    sizes = inputs["spatial_shapes"].to(torch.int64).prod(1)
    return sizes.cumsum(0) - sizes


@dataclass(frozen=True)
class Call:
    inputs: dict
    malformation: str | None  # None: a valid call

    def __repr__(self) -> str:  # what hypothesis prints for a failing example
        shapes = {k: (tuple(v.shape), str(v.dtype)[6:], v.stride()) for k, v in self.inputs.items()
                  if v is not None}
        return f"Call(malformation={self.malformation!r}, {shapes})"


@st.composite
def calls(draw, dtypes=(torch.float64, torch.float32, torch.float16, torch.bfloat16), device="cpu") -> Call:
    levels = tuple(draw(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from(dtypes))
    batch, queries = draw(st.sampled_from((1, 2) * 4 + (0,))), draw(st.sampled_from((1, 2, 3) * 3 + (0,)))
    layouts = LAYOUTS if batch * queries else LAYOUTS[:-1]  # "nonfinite" needs some locations to spoil
    case = Case("fuzz", batch=batch, queries=queries, heads=draw(st.integers(1, 3)), head_dim=draw(st.integers(1, 5)),
                levels=levels, points=draw(st.integers(1, 3)), layout=draw(st.sampled_from(layouts)),
                pass_level_start=draw(st.booleans()), index_dtype=draw(st.sampled_from([torch.int64, torch.int32])))
    location_dtype = torch.float32 if dtype in HALF and draw(st.booleans()) else dtype
    inputs = make_inputs(case, dtype, location_dtype, device=device, seed=draw(st.integers(0, 2 ** 16)))
    if batch * queries:  # one sample at a level's centre: the results' scale is that of the inputs (module doc)
        inputs["sampling_locations"][0, 0, 0, 0, 0] = 0.5
    B, S, M, D = inputs["value"].shape
    if B * (S - 1) and case.layout not in ON_KNOTS:  # inf and NaN pixels, pixel 0 finite (module doc)
        where = st.tuples(st.integers(0, B - 1), st.integers(1, S - 1), st.integers(0, M - 1), st.integers(0, D - 1))
        spoilt = draw(st.lists(st.tuples(where, st.sampled_from(NONFINITE)), max_size=2))
        H, W = levels[0]
        centre = H // 2 * W + W // 2
        if batch * queries and centre and draw(st.booleans()):  # a pixel the sample at the centre reads
            spoilt.append(((0, centre, 0, draw(st.integers(0, D - 1))), draw(st.sampled_from(NONFINITE))))
        for index, bad in spoilt:
            inputs["value"][index] = bad
    memory = draw(st.sampled_from(list(MEMORY_LAYOUTS)))
    inputs = {k: (MEMORY_LAYOUTS[memory](v) if k in DIFFERENTIABLE else v) for k, v in inputs.items()}
    checked = [m for m in MALFORMATIONS if torch.device(device).type == "cpu" or m not in TABLE_VALUES]
    malformation = draw(st.none() | st.sampled_from(checked))  # valid calls half the time
    if malformation is not None:
        inputs = MALFORMATIONS[malformation][1](inputs)
    return Call(inputs, malformation)


def check(call: Call, backend: str) -> None:
    if call.malformation is None:
        inputs = call.inputs
        grad_output = grad_output_for(inputs)
        # naive runs on the CPU only: its float64 results on CPU copies, moved to the inputs' device
        on_cpu = upcast(inputs, torch.float64, device="cpu")
        device = inputs["value"].device
        expected = {k: v.to(device) for k, v in run(on_cpu, "naive", grad_output.cpu().double()).items()}
        if not bool(inputs["value"].isfinite().all()):
            # which results are inf or NaN follows naive in the inputs' own compute dtype: in float64 a bilinear
            # weight that is 0 in fp32 (0 * inf: NaN) may not be (inf)
            own = run({k: (v.cpu() if v is not None else None) for k, v in inputs.items()}, "naive", grad_output.cpu())
            expected = {k: torch.where(own[k].isfinite().to(device), v, own[k].to(device, v.dtype))
                        for k, v in expected.items()}
        failed = [str(r) for r in check_parity(inputs, backend, grad_output=grad_output, expected=expected)
                  if not r.passed]
        assert not failed, f"{backend} against float64 naive:\n" + "\n".join(failed)
        return
    arg = MALFORMATIONS[call.malformation][0]
    try:
        import msda_core
        msda_core.deform_attn(*(call.inputs[k] for k in ARGUMENTS), backend=backend)
    except (ValueError, TypeError) as err:
        assert str(err).startswith(f"{arg}:"), f"{call.malformation}: expected an error naming {arg}, got {err!r}"
        return
    raise AssertionError(f"{call.malformation}: no error, expected one naming {arg}")


def fresh_seed() -> int:
    """MSDA_FUZZ_SEED when set (to replay a failure), else a new random seed."""
    return int(os.environ.get(SEED_VARIABLE) or random.SystemRandom().randrange(2 ** 32))


def fuzz(backend: str, max_examples: int, seed: int | None = None, dtypes=None, device="cpu") -> None:
    """Run the property on ``backend`` with inputs on ``device``; see the module docstring for ``seed``."""
    strategy = calls(dtypes, device) if dtypes else calls(device=device)

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=seed is None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], print_blob=True)
    @given(call=strategy)
    def property_(call):
        check(call, backend)

    if seed is None:
        property_()
        return
    try:
        hypothesis_seed(seed)(property_)()
    except BaseException as err:
        raise AssertionError(f"fuzzing {backend} failed with seed {seed}: rerun with {SEED_VARIABLE}={seed}") from err
