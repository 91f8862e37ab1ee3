"""Every malformed call raises before any backend runs, naming the argument, the expected and the actual."""

import msda_core
import pytest
import torch
from core_inputs import tiny_inputs


def _set(key, make):
    def mutate(inp):
        inp[key] = make(inp)
        return inp
    return mutate


MALFORMED = [
    # (id, mutation, exception, words the message must contain)
    ("value_rank", _set("value", lambda i: i["value"][0]), ValueError, ["value", "(B, S, M, D)", "(30, 2, 3)"]),
    ("value_int", _set("value", lambda i: i["value"].long()), TypeError, ["value", "floating", "torch.int64"]),
    ("shapes_rank", _set("spatial_shapes", lambda i: i["spatial_shapes"].flatten()), ValueError,
     ["spatial_shapes", "(L, 2)", "(4,)"]),
    ("shapes_empty", _set("spatial_shapes", lambda i: i["spatial_shapes"][:0]), ValueError,
     ["spatial_shapes", "L >= 1", "(0, 2)"]),
    ("shapes_float", _set("spatial_shapes", lambda i: i["spatial_shapes"].float()), TypeError,
     ["spatial_shapes", "int64", "torch.float32"]),
    ("shapes_nonpositive", _set("spatial_shapes", lambda i: torch.tensor([[6, 4], [0, 2]])), ValueError,
     ["spatial_shapes", "positive", "(0, 2)"]),
    ("shapes_sum", _set("spatial_shapes", lambda i: torch.tensor([[6, 4], [3, 3]])), ValueError,
     ["spatial_shapes", "S = value.shape[1] = 30", "got 33"]),
    ("start_values", _set("level_start_index", lambda i: torch.tensor([0, 23])), ValueError,
     ["level_start_index", "[0, 24]", "[0, 23]"]),
    ("start_length", _set("level_start_index", lambda i: torch.tensor([0, 24, 30])), ValueError,
     ["level_start_index", "(2,)", "(3,)"]),
    ("start_float", _set("level_start_index", lambda i: torch.tensor([0.0, 24.0])), TypeError,
     ["level_start_index", "int64", "torch.float32"]),
    ("loc_rank", _set("sampling_locations", lambda i: i["sampling_locations"][..., 0]), ValueError,
     ["sampling_locations", "6 dims", "(1, 2, 2, 2, 2)"]),
    ("loc_batch", _set("sampling_locations", lambda i: i["sampling_locations"].expand(3, -1, -1, -1, -1, -1)),
     ValueError, ["sampling_locations", "(1, 2, 2, 2, 2, 2)", "(3, 2, 2, 2, 2, 2)"]),
    ("loc_heads", _set("sampling_locations", lambda i: i["sampling_locations"][:, :, :1]), ValueError,
     ["sampling_locations", "(B, Q, M, L, P, 2) = (1, 2, 2, 2, 2, 2)", "(1, 2, 1, 2, 2, 2)"]),
    ("loc_levels", _set("sampling_locations", lambda i: i["sampling_locations"][:, :, :, :1]), ValueError,
     ["sampling_locations", "(1, 2, 2, 2, 2, 2)", "(1, 2, 2, 1, 2, 2)"]),
    ("loc_trailing", _set("sampling_locations", lambda i: torch.cat([i["sampling_locations"]] * 2, -1)),
     ValueError, ["sampling_locations", "(1, 2, 2, 2, 2, 2)", "(1, 2, 2, 2, 2, 4)"]),
    ("weights_points", _set("attention_weights", lambda i: i["attention_weights"][..., :1]), ValueError,
     ["attention_weights", "(B, Q, M, L, P) = (1, 2, 2, 2, 2)", "(1, 2, 2, 2, 1)"]),
    ("weights_queries", _set("attention_weights", lambda i: i["attention_weights"][:, :1]), ValueError,
     ["attention_weights", "(1, 2, 2, 2, 2)", "(1, 1, 2, 2, 2)"]),
    ("loc_dtype", _set("sampling_locations", lambda i: i["sampling_locations"].float()), TypeError,
     ["sampling_locations", "torch.float64", "torch.float32"]),  # value and weights agree: the locations are off
    ("loc_and_weights_dtype", lambda i: {**i, "sampling_locations": i["sampling_locations"].float(),
                                          "attention_weights": i["attention_weights"].float()},
     TypeError, ["sampling_locations", "torch.float64", "torch.float32"]),
    ("device", _set("attention_weights", lambda i: i["attention_weights"].to("meta")), ValueError,
     ["attention_weights", "device cpu", "meta"]),
    # value fp32 beside fp64 locations and fp32 weights: the locations are the odd one (weights were named)
    ("loc_dtype_beside_fp32", lambda i: {**i, "value": i["value"].float(),
                                         "attention_weights": i["attention_weights"].float()},
     TypeError, ["sampling_locations", "torch.float32", "torch.float64"]),
    # value alone on another device: value is named (spatial_shapes was)
    ("value_device", _set("value", lambda i: i["value"].to("meta")), ValueError, ["value", "device cpu", "meta"]),
]


@pytest.fixture
def spy_backend():
    """A backend that records whether it ran: validation must stop bad calls before it."""
    calls = []
    spy = msda_core.Backend("spy", forward=lambda *a: calls.append("forward"),
                            backward=lambda *a: calls.append("backward"),
                            devices=frozenset({"cpu"}), dtypes=frozenset({torch.float64, torch.float32}))
    msda_core.register(spy)
    yield calls
    msda_core.unregister("spy")


@pytest.mark.parametrize("case_id, mutate, exc, words", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_call_raises_naming_the_argument(case_id, mutate, exc, words, spy_backend):
    bad = mutate(tiny_inputs())
    with pytest.raises(exc) as info:
        torch.ops.msda.deform_attn(**bad, backend="spy")
    message = str(info.value)
    assert message.startswith(words[0] + ":"), message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert spy_backend == []


@pytest.mark.parametrize("case_id, mutate, exc, words",
                         [m for m in MALFORMED if m[0] not in ("shapes_nonpositive", "shapes_sum", "start_values",
                                                               "device", "value_device")],
                         ids=lambda m: m if isinstance(m, str) else None)
def test_fake_kernel_validates_metadata(case_id, mutate, exc, words):
    """Under fake tensors (torch.compile, torch.export) the same metadata errors are raised."""
    from torch._subclasses import FakeTensorMode
    bad = mutate(tiny_inputs())
    with FakeTensorMode() as mode:
        fake = {k: (mode.from_tensor(v) if v is not None else None) for k, v in bad.items()}
        with pytest.raises(exc, match=f"^{words[0]}:"):
            torch.ops.msda.deform_attn(**fake)


def test_grad_accum_is_checked(inputs, spy_backend):
    with pytest.raises(ValueError, match=r"^grad_accum: expected one of \('auto', 'native', 'fp32'\), got 'fast'"):
        torch.ops.msda.deform_attn(**inputs, backend="spy", grad_accum="fast")


def test_grad_output_shape_is_checked(inputs, spy_backend):
    bad_grad = torch.zeros(1, 2, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^grad_output: expected shape \(B, Q, M\*D\) = \(1, 2, 6\) "
                                         r"\(B, Q from sampling_locations, "
                                         r"M, D from value\), got \(1, 2, 5\)"):
        torch.ops.msda.deform_attn_backward(bad_grad, *inputs.values(), backend="spy", grad_accum="auto",
                                            deterministic=None)
    assert spy_backend == []


def test_mixed_precision_half_value_fp32_locations_is_accepted(spy_backend):
    for half in (torch.float16, torch.bfloat16):
        inp = tiny_inputs()
        inp["value"] = inp["value"].to(half)
        for k in ("sampling_locations", "attention_weights"):
            inp[k] = inp[k].float()
        msda_core.validation.check_inputs(msda_core.Inputs(**inp))
    inp = tiny_inputs(torch.float32)
    inp["value"] = inp["value"].half()
    inp["attention_weights"] = inp["attention_weights"].half()
    inp["sampling_locations"] = inp["sampling_locations"].half()
    msda_core.validation.check_inputs(msda_core.Inputs(**inp))  # all half: fine
    inp["value"] = inp["value"].bfloat16()
    with pytest.raises(TypeError, match=r"^sampling_locations: expected the dtype of value \(torch.bfloat16\) or "
                                        r"torch.float32"):
        msda_core.validation.check_inputs(msda_core.Inputs(**inp))


def test_int32_index_tensors_are_accepted(inputs):
    inputs["spatial_shapes"] = inputs["spatial_shapes"].int()
    inputs["level_start_index"] = inputs["level_start_index"].int()
    msda_core.validation.check_inputs(msda_core.Inputs(**inputs))


def test_non_contiguous_inputs_are_accepted(inputs):
    inputs["value"] = inputs["value"].transpose(2, 3).contiguous().transpose(2, 3)
    assert not inputs["value"].is_contiguous()
    msda_core.validation.check_inputs(msda_core.Inputs(**inputs))


def test_non_tensor_is_rejected_by_the_schema(inputs):
    inputs["value"] = inputs["value"].tolist()
    with pytest.raises(RuntimeError, match="Expected a value of type 'Tensor' for argument 'value'"):
        torch.ops.msda.deform_attn(**inputs)


def test_cpu_level_tables_are_checked_on_every_call(inputs, spy_backend):
    """Reading a CPU table costs microseconds and no device sync, so every call reads it: an in-place edit that
    makes it wrong is caught on the next call, inference tensors included."""
    torch.ops.msda.deform_attn(**inputs, backend="spy")
    inputs["spatial_shapes"][1, 0] = 4
    with pytest.raises(ValueError, match="^spatial_shapes: expected sum"):
        torch.ops.msda.deform_attn(**inputs, backend="spy")
    with torch.inference_mode():
        inference = tiny_inputs()
        inference["level_start_index"][1] = 23
        with pytest.raises(ValueError, match="^level_start_index: expected the exclusive cumulative sum"):
            torch.ops.msda.deform_attn(**inference, backend="spy")
    assert spy_backend == ["forward"]


def test_shape_errors_name_where_each_size_came_from(inputs, spy_backend):
    """One level in spatial_shapes against locations with two: the message says that L came from spatial_shapes."""
    inputs["spatial_shapes"] = inputs["spatial_shapes"][:1]
    inputs["level_start_index"] = None
    with pytest.raises(ValueError, match=r"^sampling_locations: expected shape \(B, Q, M, L, P, 2\) = "
                                         r"\(1, 2, 2, 1, 2, 2\) \(B, M from value.shape, "
                                         r"L = spatial_shapes.shape\[0\]"):
        torch.ops.msda.deform_attn(**inputs, backend="spy")


def test_an_extra_positional_im2col_step_points_to_the_drop_in(inputs):
    with pytest.raises(TypeError, match="no im2col_step .* msda_core.compat.MSDeformAttnFunction"):
        msda_core.deform_attn(*inputs.values(), 64)


def test_level_table_values_are_checked_on_parameters_too(inputs, spy_backend):
    """The CPU check skipped every tensor subclass: an nn.Parameter holding a wrong table reached the backend."""
    wrong = torch.nn.Parameter(inputs["spatial_shapes"] * 2, requires_grad=False)
    with pytest.raises(ValueError, match="spatial_shapes: expected sum"):
        torch.ops.msda.deform_attn(**dict(inputs, spatial_shapes=wrong), backend="spy")
    assert spy_backend == []


@pytest.mark.parametrize("arg", ["value", "spatial_shapes", "level_start_index", "sampling_locations",
                                 "attention_weights"])
def test_a_non_tensor_argument_is_named(arg):
    """msda_core.deform_attn given a list where a tensor belongs: torch's schema error printed the whole list."""
    inputs = tiny_inputs()
    inputs[arg] = [inputs[arg]]
    with pytest.raises(TypeError, match=f"^{arg}: expected a tensor, got list$"):
        msda_core.deform_attn(**inputs)
