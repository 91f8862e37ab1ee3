"""msda_core.nn.MSDeformAttn: a Deformable-DETR-layout checkpoint loads strictly and gives the published
module's outputs and gradients in float64, for points, boxes and padding; its initialisation; its errors."""

import math
import re

import msda_testkit as kit
import pytest
import torch
from msda_core.nn import MSDeformAttn, MultiScaleDeformableAttention
from published import checkpoint, msdeformattn

FORWARD, GRADIENT = kit.tolerance(torch.float64, "forward"), kit.tolerance(torch.float64, "gradient")
C, L, M, P = 16, 2, 4, 3
SHAPES = [(6, 5), (3, 3)]
S = sum(h * w for h, w in SHAPES)


def _loaded(state):
    module = MSDeformAttn(C, L, M, P).double()
    module.load_state_dict(state, strict=True)
    return module


def _inputs(coordinates, N=2, Len_q=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(N, Len_q, C, generator=g, dtype=torch.float64)
    flat = torch.randn(N, S, C, generator=g, dtype=torch.float64)
    reference = torch.rand(N, Len_q, L, coordinates, generator=g, dtype=torch.float64)
    if coordinates == 4:
        reference[..., 2:] = 0.1 + 0.5 * reference[..., 2:]  # box sizes
    return query, reference, flat


def test_state_dict_round_trips_with_the_deformable_detr_layout():
    state = checkpoint(C, L, M, P)
    module = _loaded(state)
    assert list(module.state_dict()) == list(state)
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    assert (module.d_model, module.n_levels, module.n_heads, module.n_points, module.im2col_step) == (C, L, M, P, 64)


@pytest.mark.parametrize("coordinates", [2, 4], ids=["points", "boxes"])
@pytest.mark.parametrize("padding", [False, True])
def test_outputs_and_gradients_match_the_published_module(coordinates, padding):
    state = checkpoint(C, L, M, P)
    module = _loaded(state)
    query, reference, flat = _inputs(coordinates)
    mask = torch.rand(2, S, generator=torch.Generator().manual_seed(2)) < 0.3 if padding else None
    starts = torch.tensor([0, SHAPES[0][0] * SHAPES[0][1]])
    output = module(query, reference, flat, torch.tensor(SHAPES), starts, mask)
    leaves = {name: tensor.clone().requires_grad_() for name, tensor in state.items()}
    expected = msdeformattn(leaves, M, L, P, query, reference, flat, SHAPES, mask)
    kit.assert_close("output", output, expected, FORWARD)
    grad_output = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    params = dict(module.named_parameters())
    actual = torch.autograd.grad(output, list(params.values()), grad_output)
    wanted = torch.autograd.grad(expected, [leaves[name] for name in params], grad_output)
    for name, a, w in zip(params, actual, wanted):
        kit.assert_close(f"grad {name}", a, w, GRADIENT)


def test_padding_positions_do_not_reach_the_output():
    module = _loaded(checkpoint(C, L, M, P))
    query, reference, flat = _inputs(2)
    mask = torch.zeros(2, S, dtype=torch.bool)
    mask[:, ::3] = True
    changed = flat.clone()
    changed[mask] = 1e3
    shapes = torch.tensor(SHAPES)
    assert torch.equal(module(query, reference, flat, shapes, None, mask),
                       module(query, reference, changed, shapes, None, mask))


def test_one_reference_level_broadcasts_and_shapes_may_be_a_list():
    module = _loaded(checkpoint(C, L, M, P))
    query, reference, flat = _inputs(4)
    one_level = reference[:, :, :1]
    expected = module(query, one_level.expand(-1, -1, L, -1), flat, torch.tensor(SHAPES))
    kit.assert_close("output", module(query, one_level, flat, SHAPES), expected, FORWARD)


def test_reset_parameters_is_deformable_detrs_initialisation():
    module = MSDeformAttn(32, n_levels=3, n_heads=8, n_points=2)
    bias = module.sampling_offsets.bias.detach().view(8, 3, 2, 2)
    for head in range(8):
        t = 2 * math.pi * head / 8
        direction = torch.tensor([math.cos(t), math.sin(t)])
        direction = direction / direction.abs().max()  # its larger coordinate is +-1
        for point in range(2):
            assert torch.allclose(bias[head, :, point], (point + 1) * direction.expand(3, 2), atol=1e-6), (head, point)
    assert not module.sampling_offsets.weight.any()
    assert not module.attention_weights.weight.any() and not module.attention_weights.bias.any()
    for proj in (module.value_proj, module.output_proj):
        assert not proj.bias.any()
        assert proj.weight.abs().max() <= math.sqrt(6 / (32 + 32))  # xavier_uniform's bound
        assert proj.weight.std() > 0.1


def test_argument_errors_name_the_argument_the_expectation_and_the_value():
    with pytest.raises(ValueError, match=r"d_model: expected a multiple of n_heads = 3, got 16"):
        MSDeformAttn(16, 2, 3, 2)
    module = _loaded(checkpoint(C, L, M, P))
    query, reference, flat = _inputs(2)
    shapes = torch.tensor(SHAPES)
    with pytest.raises(ValueError, match=r"reference_points: expected shape \(N, Len_q, L or 1, 2 or 4\) with "
                                         r"\(N, Len_q, L\) = \(2, 5, 2\), got \(2, 5, 2, 3\)"):
        module(query, torch.rand(2, 5, L, 3, dtype=torch.float64), flat, shapes)
    with pytest.raises(ValueError, match=r"reference_points: .*got \(2, 5, 3, 2\)"):
        module(query, torch.rand(2, 5, 3, 2, dtype=torch.float64), flat, shapes)
    with pytest.raises(ValueError, match=r"query: expected shape \(N, Len_q, d_model\) with d_model = 16, got "
                                         r"\(2, 5, 8\)"):
        module(query[..., :8], reference, flat, shapes)
    with pytest.raises(ValueError, match=r"query: expected shape \(N, Len_q, d_model\) with d_model = 16, got "
                                         r"\(5, 16\)"):  # rank 2: the message showed (5, 16, 16) expected
        module(query[0], reference, flat, shapes)
    with pytest.raises(ValueError, match=r"input_flatten: expected shape \(N, S, d_model\) = \(2, 39, 16\)"):
        module(query, reference, flat[..., :8], shapes)
    with pytest.raises(ValueError, match=r"input_spatial_shapes: expected \(H, W\) of n_levels = 2 levels, got "
                                         r"shape \(1, 2\)"):
        module(query, reference, flat, shapes[:1])
    with pytest.raises(ValueError, match=r"input_padding_mask: expected shape \(N, S\) = \(2, 39\), got \(2, 38\)"):
        module(query, reference, flat, shapes, None, torch.zeros(2, S - 1, dtype=torch.bool))


def _module_and_arguments():
    """A loaded module and a valid call's arguments by name, for the tests that break one of them."""
    query, reference, flat = _inputs(2)
    return _loaded(checkpoint(C, L, M, P)), {
        "query": query, "reference_points": reference, "input_flatten": flat,
        "input_spatial_shapes": torch.tensor(SHAPES), "input_level_start_index": torch.tensor([0, 30]),
        "input_padding_mask": torch.zeros(2, S, dtype=torch.bool)}


@pytest.mark.parametrize("arg", ["query", "reference_points", "input_flatten", "input_level_start_index",
                                 "input_padding_mask"])
def test_a_non_tensor_argument_is_named(arg):
    """A list where a tensor belongs gave 'list' object has no attribute 'dim' (or 'device')."""
    module, args = _module_and_arguments()
    args[arg] = [args[arg]]
    with pytest.raises(TypeError, match=f"^{arg}: expected a tensor, got list"):
        module(**args)


@pytest.mark.parametrize("arg", ["reference_points", "input_flatten", "input_spatial_shapes",
                                 "input_level_start_index", "input_padding_mask"])
def test_an_argument_on_another_device_is_named(arg):
    """A meta level table gave torch's 'Tensor on device meta is not on the expected device cpu!'."""
    module, args = _module_and_arguments()
    args[arg] = args[arg].to("meta")
    with pytest.raises(ValueError, match=f"^{arg}: expected device cpu \\(the device of query\\), got meta"):
        module(**args)


@pytest.mark.parametrize("arg", ["value", "sampling_locations", "attention_weights"])
def test_the_transformers_core_names_a_non_tensor_argument(arg):
    """transformers' core given a list value said 'list' object has no attribute 'device'."""
    args = {"value": torch.randn(1, 30, 2, 8), "value_spatial_shapes": torch.tensor([(4, 6), (2, 3)]),
            "value_spatial_shapes_list": None, "level_start_index": None,
            "sampling_locations": torch.rand(1, 5, 2, 2, 3, 2), "attention_weights": torch.rand(1, 5, 2, 2, 3)}
    args[arg] = [args[arg]]
    with pytest.raises(TypeError, match=f"^{arg}: expected a tensor, got list"):
        MultiScaleDeformableAttention()(**args)


def test_backend_keyword_reaches_the_op(marker_backend):
    module = MSDeformAttn(C, L, M, P, backend="marker").double()
    query, reference, flat = _inputs(2)
    module(query, reference, flat, SHAPES)
    assert marker_backend == [1]


def test_constructor_refuses_bad_sizes_and_backend_names():
    """n_heads=0 or d_model=0 raised ZeroDivisionError, negative or float sizes torch's internals, and a bad
    backend name was accepted until the first forward."""
    for kwargs, error, message in ((dict(n_heads=0), ValueError, "n_heads: expected a positive int, got 0"),
                                   (dict(d_model=0), ValueError, "d_model: expected a positive int, got 0"),
                                   (dict(n_points=-1), ValueError, "n_points: expected a positive int, got -1"),
                                   (dict(n_levels=2.0), TypeError, "n_levels: expected a positive int, got 2.0"),
                                   (dict(backend="nope"), ValueError, "backend: expected 'auto' or one of")):
        with pytest.raises(error, match=re.escape(message)):
            MSDeformAttn(**kwargs)
    with pytest.raises(ValueError, match="backend: expected 'auto' or one of"):
        MultiScaleDeformableAttention(backend="nope")


def test_hub_mapping_takes_one_device_type_as_a_string():
    """mapping("cpu") mapped the device types 'c', 'p' and 'u'."""
    import msda_core
    assert list(msda_core.hub.mapping("cpu")["MultiScaleDeformableAttention"]) == ["cpu"]
    assert list(msda_core.hub.mapping(["cuda", "cpu"])["MultiScaleDeformableAttention"]) == ["cuda", "cpu"]
    with pytest.raises(TypeError, match=r"^devices: expected device type names such as 'cpu' or 'cuda', got 0"):
        msda_core.hub.mapping([0])
