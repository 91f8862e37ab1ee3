import math
from dataclasses import replace

import msda_core
import msda_testkit as kit
import pytest
import torch


@pytest.mark.parametrize("case", kit.EDGE_CASES + kit.SMALL_CASES, ids=lambda c: c.name)
def test_every_case_builds_valid_inputs(case):
    inputs = kit.make_inputs(case, torch.float32)
    msda_core.validation.check_inputs(msda_core.Inputs(**inputs))
    assert inputs["sampling_locations"].shape[1] == case.queries


def test_encoder_cases_query_every_pixel_and_small_cases_scale_the_standard_levels():
    """What the cases' names promise, so that editing one number of a case cannot silently break it."""
    encoders = [c for c in kit.STANDARD_CASES + kit.SMALL_CASES if c.name.startswith("encoder")]
    assert encoders and all(c.queries == c.spatial_size for c in encoders)
    for small in kit.SMALL_CASES:
        assert small.levels == tuple((math.ceil(h / 8), math.ceil(w / 8)) for h, w in kit.cases.DETR_LEVELS)


def test_same_seed_same_inputs_across_dtypes():
    a = kit.make_inputs(kit.case("tiny"), torch.float64)
    b = kit.make_inputs(kit.case("tiny"), torch.bfloat16)
    assert torch.equal(a["value"].bfloat16(), b["value"])


def test_layouts_do_what_they_say():
    c = kit.case("pixel_centres")
    loc = kit.make_inputs(c, torch.float64)["sampling_locations"]
    W = torch.tensor([w for _, w in c.levels], dtype=torch.float64).reshape(1, 1, 1, -1, 1)
    x = loc[..., 0] * W - 0.5
    assert torch.allclose(x, x.round(), atol=1e-9)
    corners = kit.make_inputs(kit.case("map_corners"), torch.float64)["sampling_locations"]
    assert set(corners.unique().tolist()) == {0.0, 1.0}
    c = kit.case("past_edges")
    edges = kit.make_inputs(c, torch.bfloat16)["sampling_locations"].double()
    size = torch.tensor([(w, h) for h, w in c.levels], dtype=torch.float64).reshape(1, 1, 1, -1, 1, 2)
    x = edges * size - 0.5
    assert (x == -1).any() and (x == size).any() and ((x > -1) & (x < size - 1)).any()
    bad = kit.make_inputs(kit.case("nonfinite"), torch.float32)["sampling_locations"]
    assert bad.isnan().any() and (bad == math.inf).any() and (bad == -math.inf).any()
    nc = kit.make_inputs(kit.case("non_contiguous"), torch.float32)
    assert not any(v.is_contiguous() for v in nc.values() if v is not None)
    assert kit.make_inputs(kit.case("no_level_start"))["level_start_index"] is None
    assert kit.make_inputs(kit.case("int32_shapes"))["spatial_shapes"].dtype == torch.int32


def test_away_from_pixels_keeps_fractions_inside():
    c = kit.Case("a", layout="away_from_pixels", loc_range=(-0.2, 1.2))
    loc = kit.make_inputs(c, torch.float64)["sampling_locations"]
    hw = torch.tensor([(w, h) for h, w in c.levels], dtype=torch.float64).reshape(1, 1, 1, -1, 1, 2)
    frac = (loc * hw - 0.5) - torch.floor(loc * hw - 0.5)
    assert frac.min() >= 0.1 - 1e-9 and frac.max() <= 0.9 + 1e-9


def test_parity_check_catches_a_wrong_backend():
    """The parity check must see a convention error: a backend that forgets the -0.5 pixel shift."""
    grid_sample = msda_core.backends()["grid_sample"]

    def shifted(inputs):
        half_pixel = 0.5 / inputs.spatial_shapes.flip(-1).reshape(1, 1, 1, -1, 1, 2)
        return grid_sample.forward(inputs._replace(sampling_locations=inputs.sampling_locations + half_pixel))

    msda_core.register(msda_core.Backend("shifted", shifted, grid_sample.backward, grid_sample.devices,
                                         grid_sample.dtypes))
    try:
        results = kit.check_parity(kit.make_inputs(kit.case("tiny"), torch.float64), "shifted", "naive",
                                   backward=False)
        assert not results[0].passed
    finally:
        msda_core.unregister("shifted")


def test_kink_band_covers_pixel_centres_and_little_else():
    centred = kit.make_inputs(kit.case("pixel_centres"), torch.float32)
    assert kit.parity.near_pixel_kinks(centred).all()
    uniform = kit.make_inputs(kit.case("decoder_small"), torch.float32)
    near = kit.parity.near_pixel_kinks(uniform)
    assert near.float().mean() < 1e-3  # the band is ~1e-5 pixel wide: a handful of samples at most


def test_contribution_count_matches_a_hand_count():
    """One query, one point at the centre of a 2x2 map: its 4 corners each get 1 add; two identical
    queries make 2."""
    c = kit.Case("k", queries=2, heads=1, levels=((2, 2),), points=1)
    inputs = kit.make_inputs(c, torch.float64)
    inputs["sampling_locations"].fill_(0.5)
    assert kit.parity.max_contributions_per_element(inputs) == 2
    inputs["sampling_locations"][0, 1] = 5.0  # the second query outside the map
    assert kit.parity.max_contributions_per_element(inputs) == 1


def test_atomic_tolerance_refuses_cases_beyond_its_premise():
    c = kit.Case("crowded", queries=3000, heads=1, levels=((1, 1),), points=2)  # 6000 adds on one pixel
    inputs = kit.make_inputs(c, torch.float32)
    actual = expected = {"grad_value": torch.zeros_like(inputs["value"])}
    with pytest.raises(ValueError, match="6000 atomic adds reach one element, beyond the K <= 4096"):
        kit.compare_results(inputs, actual, expected, grad_value_effect="atomic")


def _pixel_offsets(c, dtype=torch.float64, seed=0):
    """The model-like inputs, the reference points recovered as the mean location over heads, levels and
    points (the heads' directions sum to 0), its noise's std (normalized units, per axis), and the locations
    as offsets in pixels from it."""
    inputs = kit.make_inputs(c, dtype, seed=seed)
    loc = inputs["sampling_locations"].double()
    size = torch.tensor([(w, h) for h, w in c.levels], dtype=torch.float64).reshape(-1, 2)
    reference = loc.mean((2, 3, 4), keepdim=True)
    # N(0, 1) pixels per term, over (W_l, H_l): the mean of M*L*P of them
    reference_std = (c.heads * c.points * size.pow(-2).sum(0)).sqrt() / (c.heads * len(c.levels) * c.points)
    return inputs, reference, reference_std, (loc - reference) * size.reshape(1, 1, 1, -1, 1, 2)


def test_model_like_encoder_queries_sit_on_their_own_pixel_centres():
    c = replace(kit.case("encoder_small"), batch=2, layout="model_like")
    _, reference, reference_std, _ = _pixel_offsets(c)
    # query i is pixel i of the levels in order: its reference is that pixel's centre
    expected = torch.cat([torch.stack(((torch.arange(w).repeat(h) + 0.5) / w,
                                       (torch.arange(h).repeat_interleave(w) + 0.5) / h), -1) for h, w in c.levels])
    error = reference[:, :, 0, 0, 0] - expected
    assert (error.abs() < 5 * reference_std).all()
    z = error / reference_std  # noise of std 1: not shifted, not scaled
    assert (z.mean((0, 1)).abs() < 0.2).all() and 0.8 < z.std() < 1.2


def test_model_like_offsets_point_each_head_its_way_on_every_level():
    c = replace(kit.case("decoder_small"), queries=400, layout="model_like")
    *_, offsets = _pixel_offsets(c)
    mean = offsets.mean((0, 1))  # (M, L, P, 2): the noise averages out over the queries
    M, P = c.heads, c.points
    for m in range(M):
        angle = torch.atan2(mean[m, ..., 1], mean[m, ..., 0])
        expected = torch.tensor(2 * math.pi * m / M)
        assert (torch.remainder(angle - expected + math.pi, 2 * math.pi) - math.pi).abs().max() < 0.1
    max_norm = mean.abs().amax(-1)  # (M, L, P): p + 1, the same on every level
    assert torch.allclose(max_norm, torch.arange(1, P + 1, dtype=torch.float64).expand_as(max_norm), atol=0.2)
    noise = offsets - mean
    assert 0.9 < noise.std() < 1.1  # N(0, 1) pixels


def test_model_like_decoder_references_are_uniform_and_weights_a_softmax():
    c = replace(kit.case("decoder_small"), batch=4, queries=500, layout="model_like")
    inputs, reference, _, _ = _pixel_offsets(c)
    reference = reference[:, :, 0, 0, 0]  # (B, Q, 2)
    assert reference.min() > -0.1 and reference.max() < 1.1
    assert (reference.mean((0, 1)) - 0.5).abs().max() < 0.03  # uniform in [0, 1]: mean 1/2, std 12^-1/2
    assert (reference.std((0, 1)) - 12 ** -0.5).abs().max() < 0.03
    weights = inputs["attention_weights"]
    assert (weights > 0).all() and torch.allclose(weights.sum((-1, -2)), torch.ones((), dtype=weights.dtype))


def test_model_like_is_seeded_and_the_same_in_every_dtype():
    c = replace(kit.case("encoder_small"), layout="model_like")
    a = kit.make_inputs(c, torch.float64)["sampling_locations"]
    assert torch.equal(a, kit.make_inputs(c, torch.float64)["sampling_locations"])
    assert not torch.equal(a, kit.make_inputs(c, torch.float64, seed=1)["sampling_locations"])
    assert torch.equal(a.bfloat16(), kit.make_inputs(c, torch.bfloat16)["sampling_locations"])
    msda_core.validation.check_inputs(msda_core.Inputs(**kit.make_inputs(c, torch.float16)))
