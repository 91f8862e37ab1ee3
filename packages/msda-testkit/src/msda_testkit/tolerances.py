"""The tolerance table: how far a result may sit from a float64 reference computed on the same inputs.

Keyed by (dtype of the result, effect). Every entry carries the reason for its numbers. An element
passes when ``|actual - expected| <= atol * scale + rtol * |expected|``, where ``scale`` is the largest
finite ``|expected|`` of that tensor: errors of accumulated sums are proportional to the size of what is
summed, not to the (possibly cancelled) result, so ``atol`` is relative to the tensor's scale.

Effects:
- ``forward`` / ``gradient``: the kernel's own arithmetic (fp32 accumulation) and one rounding of the
  result to its dtype. Unit roundoff u: fp32 2^-24 ≈ 6e-8, fp16 2^-11 ≈ 4.9e-4, bf16 2^-8 ≈ 3.9e-3.
- ``fixed_point``: grad_value of the deterministic mode: each contribution rounded once to fp32, then
  split at power-of-two scales into an integer and its remainder's multiple of 1/ratio; both are summed
  exactly and added once (one rounding). Each term errs by at most half the quantum 1/(scale*ratio) <
  bound * units * 2^-42 (units: the bound on an element's count of terms, bound: on its sum of |terms|;
  see msda_triton.kernels._fixed_point_scales), so K terms of random sign err by ~sqrt(K) of that.
- ``atomic``: grad_value scattered with atomic adds, whose order varies run to run; in a half dtype
  (``grad_accum="native"``) every add also rounds the running sum. These entries hold for at most
  ``max_contributions`` adds into one element (K); the comparison counts K on the actual inputs and
  refuses to judge a case beyond it. The Deformable DETR encoder reaches K = 1427 on its 13x21 level
  (22223 queries x 4 points x 4 corners over 273 pixels).
- ``accumulated``: grad_value of an accumulation policy that picks native half adds or fp32 accumulation from
  the shapes (msda_triton's ``grad_accum="auto"``), judged norm-wise: ``||actual - expected||_2 <= rtol *
  ||expected||_2`` (``norm_wise``), the dtype's unit roundoff: as far off as rounding each element once.
- ``data_parallel`` / ``sharded``: training under DDP against one process on the concatenated batch, and FSDP2
  against DDP (``msda_testkit.distributed``): the same fp32 terms added in another order across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    rtol: float  # relative to each expected element
    atol: float  # relative to the tensor's scale (largest finite |expected|)
    reason: str
    max_contributions: int | None = None  # atomic entries: the K per element they were derived for
    norm_wise: bool = False  # judge ||actual - expected||_2 <= rtol * ||expected||_2 instead (atol unused)


_FP32_SUMS = ("fp32 accumulation of sums of up to ~300 products (4 corners x D <= 71, or 4*L*P samples): "
              "worst case n*u = 300 * 6e-8 ~ 2e-5 of the scale")

TOLERANCES = {
    (torch.float64, "forward"): Tolerance(1e-12, 1e-12,
        "float64 sums of <= 4*L*P terms err by ~n * 1.1e-16 ~ 1e-14; 1e-12 leaves 100x headroom, while a "
        "convention slip (the -0.5, a corner weight, padding) is O(1)"),
    (torch.float64, "gradient"): Tolerance(1e-10, 1e-10,
        "gradients add D-long dot products, differences of corners and the W_l/H_l factor (up to 167x); "
        "1e-10 still catches any formula error, which is O(1)"),
    (torch.float64, "atomic"): Tolerance(1e-10, 1e-10,
        "reordered float64 atomic adds err by <= K * 1.1e-16 ~ 5e-13 for K <= 4096; held to the gradient entry",
        max_contributions=4096),
    (torch.float32, "forward"): Tolerance(1e-5, 2e-5, _FP32_SUMS),
    (torch.float32, "gradient"): Tolerance(1e-5, 2e-5, _FP32_SUMS),
    (torch.float32, "atomic"): Tolerance(1e-5, 2e-5,
        "fp32 atomic adds in any order: random-sign reordering error ~ sqrt(K) * u = 3.8e-6 of the scale for "
        "K <= 4096, under the fp32 arithmetic term: held to the gradient entry", max_contributions=4096),
    (torch.float32, "fixed_point"): Tolerance(1e-5, 2e-5,
        "fp32 contributions summed exactly: per-term fp32 rounding (u), a remainder quantum below "
        "bound * units * 2^-42 (units ~7e3 at encoder B2: 1.6e-9 of the bound; sqrt(K) = 38 such terms), then "
        "one rounding; held to the gradient entry (H200, encoder B2: within 8.8e-6 of the scale)"),
    (torch.float16, "fixed_point"): Tolerance(1e-3, 2e-5,
        "the exact fixed-point sum (fp32 entry) then one rounding to fp16: as the fp16 gradient entry"),
    (torch.bfloat16, "fixed_point"): Tolerance(8e-3, 2e-5,
        "the exact fixed-point sum (fp32 entry) then one rounding to bf16: as the bf16 gradient entry"),
    (torch.float16, "accumulated"): Tolerance(2.0 ** -11, 0.0,
        "the default accumulation: one rounding of each element to fp16 errs by <= u = 2^-11 of it, so by <= u "
        "norm-wise; native adds, taken where the shapes expect about one term per element, round each running sum "
        "again (H100, the DETR levels with 300 queries: 0.85 u; past u from 1.7 terms per element: "
        "BENCHMARKS.md, 'Accumulation paths'); beyond one term, fp32 accumulation",
        norm_wise=True),
    (torch.bfloat16, "accumulated"): Tolerance(2.0 ** -8, 0.0,
        "as the fp16 entry, bf16's u = 2^-8: the error of rounding each element of the result once, norm-wise",
        norm_wise=True),
    (torch.float16, "forward"): Tolerance(1e-3, 2e-5,
        "fp32 accumulation (atol, as fp32) then one rounding to fp16: <= u = 4.9e-4 relative; rtol = 2u"),
    (torch.float16, "gradient"): Tolerance(1e-3, 2e-5,
        "as the fp16 forward: fp32 arithmetic, one rounding of each gradient to fp16"),
    (torch.float16, "atomic"): Tolerance(1e-3, 3.2e-2,
        "native fp16 atomics round the running sum at each of K adds: random-sign error ~ sqrt(K) * u of the "
        "scale; K <= 4096 gives 64u = 3.1e-2 (measured on the H200, encoder K = 1427: 1.1e-2)",
        max_contributions=4096),
    (torch.bfloat16, "forward"): Tolerance(8e-3, 2e-5,
        "fp32 accumulation (atol, as fp32) then one rounding to bf16: <= u = 3.9e-3 relative; rtol = 2u"),
    (torch.bfloat16, "gradient"): Tolerance(8e-3, 2e-5,
        "as the bf16 forward: fp32 arithmetic, one rounding of each gradient to bf16"),
    (torch.bfloat16, "atomic"): Tolerance(8e-3, 0.25,
        "native bf16 atomics round the running sum at each of K adds: ~ sqrt(K) * u of the scale; K <= 4096 "
        "gives 64u = 0.25. That is why grad_accum='fp32' exists: it is held to the bf16 gradient entry",
        max_contributions=4096),
    (torch.float32, "data_parallel"): Tolerance(1e-5, 1e-5,
        "DDP on 2 ranks against one process on their concatenated batch (msda_testkit.distributed): each "
        "gradient element sums the same n = 2 ranks x 2 samples x 80 tokens = 320 per-token terms, DDP as two "
        "partial sums then one add, the one process in its GEMM's order (the means' 1/320 is 1/160 halved, "
        "exactly). Each order errs by ~sqrt(n) * u = 1.1e-6 of the scale for random-sign terms, so they differ "
        "by <= 2.1e-6; on CUDA outside the deterministic mode each run's grad_value atomics add <= 3.8e-6 (the "
        "fp32 atomic entry): <= 9.7e-6. 3 SGD steps (lr 0.1) move parameters by less than their gradients' "
        "error plus 3u. Measured on gloo (CPU): 4.9e-7 (gradients), 3.1e-7 (parameters)"),
    (torch.float32, "sharded"): Tolerance(1e-6, 1e-5,
        "FSDP2 against DDP, the losses of 3 SGD steps (msda_testkit.distributed): the same per-rank fp32 "
        "gradients, scaled by powers of two (exact), reduce-scattered instead of all-reduced: for 2 ranks one "
        "commutative add, the same bits (measured on gloo: 0). On CUDA outside the deterministic mode each "
        "run's grad_value atomics differ (<= 3.8e-6 relative, the fp32 atomic entry), moving the loss by that "
        "fraction of its decrease (<= the scale) in each run, and the loss, a mean of 160 squares, then rounds "
        "at other parameters (2 sqrt(160) u = 1.5e-6): <= 9.1e-6 of the scale"),
}


def tolerance(dtype: torch.dtype, effect: str) -> Tolerance:
    try:
        return TOLERANCES[(dtype, effect)]
    except KeyError:
        raise KeyError(f"no tolerance for dtype {dtype} and effect {effect!r}; see msda_testkit.tolerances") from None
