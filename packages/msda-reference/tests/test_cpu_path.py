"""The CPU path's layouts, sizes and conventions (issue 31): every valid call served by every CPU backend, and
gather's threads and index widths. (The non-finite rules run on every backend in the conformance suite.)"""

import msda_core
import msda_testkit as kit
import pytest
import torch
import torch.nn.functional as F
from msda_reference import gather

BACKENDS = ("naive", "grid_sample", "gather")


def _inputs(B=1, Q=2, M=2, D=3, levels=((4, 5), (2, 3)), P=2, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = torch.tensor(levels)
    S = int(shapes.prod(1).sum())
    return {"value": torch.randn(B, S, M, D, generator=g, dtype=dtype), "spatial_shapes": shapes,
            "level_start_index": None,
            "sampling_locations": torch.rand(B, Q, M, len(levels), P, 2, generator=g, dtype=dtype) * 0.8 + 0.1,
            "attention_weights": torch.rand(B, Q, M, len(levels), P, generator=g, dtype=dtype)}


def _all_results(inputs, grad_output=None):
    return {b: kit.run(inputs, b, grad_output) for b in BACKENDS}


def _assert_same_everywhere(results, names=("output",)):
    """Every backend equal to naive, NaN where naive is NaN (the gradient entry of the result's dtype)."""
    for backend, result in results.items():
        for name in names:
            expected, actual = results["naive"][name], result[name]
            tol = kit.tolerance(actual.dtype, "gradient")
            assert torch.equal(expected.isnan(), actual.isnan()), (backend, name, expected, actual)
            finite = ~expected.isnan()
            kit.assert_close(f"{backend} {name}", actual[finite], expected[finite], tol)


@pytest.mark.parametrize("layout", ["single query", "query axis innermost"])
def test_gather_serves_non_contiguous_weights(layout):
    """B*Q = 1, or B = 1 with the query axis innermost: weights whose flat view is not a view of their
    memory. gather raised torch's 'view size is not compatible' in the forward, backward and the backward op."""
    inputs = _inputs(Q=1 if layout == "single query" else 3)
    B, Q, M, L, P = inputs["attention_weights"].shape
    if layout == "single query":
        weights = torch.rand(B, Q, L, P, M, dtype=torch.float64).permute(0, 1, 4, 2, 3)
    else:
        weights = torch.rand(B, M, L, P, Q, dtype=torch.float64).permute(0, 4, 1, 2, 3)
    inputs["attention_weights"] = weights
    assert not weights.is_contiguous()
    grad_output = kit.grad_output_for(inputs)
    _assert_same_everywhere(_all_results(inputs, grad_output), ("output", *kit.GRAD_NAMES))
    by_op = {b: torch.ops.msda.deform_attn_backward(grad_output, *inputs.values(), backend=b) for b in BACKENDS}
    for b in BACKENDS:
        for name, actual, expected in zip(kit.GRAD_NAMES, by_op[b], by_op["naive"]):
            kit.assert_close(f"{b} {name}", actual, expected, kit.tolerance(torch.float64, "gradient"))


def test_gather_levels_wider_than_2_to_the_24():
    """Coordinates were clamped at 2^24, even in float64. value = its own column index, so a bilinear sample
    at column x reads x."""
    W = 2 ** 24 + 8
    value = torch.arange(W, dtype=torch.float64).view(1, W, 1, 1)
    columns = torch.tensor([2.0 ** 24 + 5.25, 2.0 ** 24 + 6.5, 3.75], dtype=torch.float64)
    locations = torch.stack(((columns + 0.5) / W, torch.full_like(columns, 0.5)), -1).view(1, 3, 1, 1, 1, 2)
    weights = torch.ones(1, 3, 1, 1, 1, dtype=torch.float64)
    out = torch.ops.msda.deform_attn(value, torch.tensor([[1, W]]), None, locations, weights, backend="gather")
    assert out.flatten().tolist() == columns.tolist()


def test_gather_counts_taps_in_int64_past_int32(monkeypatch):
    """The backward's transposed sum counts taps per row: with 2^31 taps or more (B*S*M may be far fewer) the
    counts and offsets must be int64. The limit is lowered here so that a small call crosses it."""
    inputs = _inputs(dtype=torch.float32)
    taps = inputs["attention_weights"].numel() * 4
    rows = inputs["value"].numel() // inputs["value"].shape[-1]
    monkeypatch.setattr(gather, "_INT32_LIMIT", rows + 1)  # rows fit int32, taps do not
    assert rows < gather._INT32_LIMIT <= taps
    offsets = []
    real = F.embedding_bag

    def spy(input, weight, offsets_=None, *args, **kwargs):
        if kwargs.get("include_last_offset"):
            offsets.append(offsets_.dtype)
        return real(input, weight, offsets_, *args, **kwargs)

    monkeypatch.setattr(gather.F, "embedding_bag", spy)
    result = kit.run(inputs, "gather", kit.grad_output_for(inputs))
    assert offsets == [torch.int64]
    monkeypatch.undo()
    expected = kit.run(inputs, "gather", kit.grad_output_for(inputs))
    for name in result:
        assert torch.equal(result[name], expected[name]), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gather_half_weight_parts_have_the_weights_sign_and_sum_to_it(dtype):
    """gather sums a half value with each fp32 weight as two half parts (gather._split): both of the weight's sign and
    nonzero (+-inf pixels stay +-inf), their sum within the bound its docstring gives, for weights on the half's grid
    (whose rest is 0 when rounded to nearest), off it, of either sign and of every magnitude."""
    g = torch.Generator().manual_seed(0)
    magnitude = torch.exp2(torch.empty(100_000, dtype=torch.float64).uniform_(-22, 16, generator=g))
    weights = (magnitude * (torch.randint(0, 2, magnitude.shape, generator=g) * 2 - 1)).float()
    weights = torch.cat((weights, weights.to(dtype).float(), torch.tensor([1.0, -0.5, 0.0, -0.0])))
    weights = weights[weights.abs() < 65504]
    high, low = gather._split(weights.clone().view(1, -1), dtype).double()[0]
    w = weights.double()
    for part in (high, low):
        assert torch.equal(part.sign(), w.sign())
    bound = 2.0 ** -15 * w.abs() if dtype == torch.bfloat16 else 2.0 ** -21 * w.abs() + 2.0 ** -24
    assert ((high + low - w).abs() <= bound).all()


def test_gather_small_calls_run_on_one_thread(monkeypatch):
    """A call's elementwise work is too short to gain from a second thread and, with the other core busy, waits
    milliseconds for it: small eager calls run on one intra-op thread, and the caller's count comes back."""
    inputs = _inputs(dtype=torch.float32)
    seen = []
    real = F.embedding_bag

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(gather.F, "embedding_bag", spy)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        kit.run(inputs, "gather", kit.grad_output_for(inputs))
        assert set(seen) == {1} and torch.get_num_threads() == 2
        seen.clear()
        monkeypatch.setattr(gather, "_ONE_THREAD_TAPS", 1)  # every call is large
        kit.run(inputs, "gather", kit.grad_output_for(inputs))
        assert set(seen) == {2} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_level_table_checked_on_parameters():
    """The CPU level-table check skipped tensor subclasses: an nn.Parameter holding a wrong table got silent
    garbage from gather (and an IndexError or a silent wrap from naive)."""
    inputs = _inputs()
    wrong = torch.nn.Parameter(inputs["spatial_shapes"] * 2, requires_grad=False)
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="spatial_shapes: expected sum"):
            msda_core.deform_attn(**dict(inputs, spatial_shapes=wrong), backend=backend)
