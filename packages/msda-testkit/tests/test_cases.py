import math

import pytest
import torch

import msda_core
import msda_testkit as kit


@pytest.mark.parametrize("case", kit.EDGE_CASES + kit.SMALL_CASES, ids=lambda c: c.name)
def test_every_case_builds_valid_inputs(case):
    inputs = kit.make_inputs(case, torch.float32)
    msda_core.validation.check_inputs(**inputs)
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

    def shifted(value, shapes, starts, loc, weights):
        return grid_sample.forward(value, shapes, starts, loc + 0.5 / shapes.flip(-1).reshape(1, 1, 1, -1, 1, 2), weights)

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
