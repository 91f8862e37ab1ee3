import msda_core
from msda_testkit.verify import verify


def _rows(stages):
    return {s.name: (s.cases, s.passed) for s in stages}


def test_verify_passes_a_correct_backend_and_fails_a_wrong_one():
    rows = _rows(verify("gather", "cpu", replays=2))
    # the CPU slice: one standard-dims case, its five dtype pairs, the uneven shape, all-zero inputs and
    # NaN or inf in each of the four inputs, two replay checks, no stress
    assert rows == {"1 correctness": (1, 1), "2 dtypes": (5, 5), "3 edge cases": (10, 10), "4 determinism": (2, 2),
                    "5 stress": (0, 0)}

    gather = msda_core.backends()["gather"]

    def forgets_half_pixel(inputs):  # a convention slip: no -0.5
        loc = inputs.sampling_locations
        half_pixel = 0.5 / inputs.spatial_shapes.flip(-1).to(loc.dtype).view(1, 1, 1, -1, 1, 2)
        return gather.forward(inputs._replace(sampling_locations=loc + half_pixel))

    msda_core.register(msda_core.Backend("slipped", forgets_half_pixel, gather.backward, gather.devices, gather.dtypes,
                                         reproducible_on=gather.reproducible_on))
    try:
        rows = _rows(verify("slipped", "cpu", replays=2))
    finally:
        msda_core.unregister("slipped")
    assert rows["1 correctness"][1] == 0 and rows["2 dtypes"][1] == 0
    assert rows["4 determinism"][1] == rows["4 determinism"][0]  # wrong, but wrong the same way every time
