"""Bit-exact replays: the same call on the same inputs must give the same bits, every time.

Compared by bit pattern, not by value: -0.0 differs from +0.0 and NaN payloads count. Optional
contention (CUDA) runs unrelated work on a side stream during each replay, so that results depending on
the order of atomic operations show it.
"""

from __future__ import annotations

import torch

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's storage reinterpreted as integers of the same width (floats compared bit for bit)."""
    t = t.detach().contiguous()
    return t.view(_SAME_WIDTH_INT[t.element_size()]) if t.is_floating_point() else t


def _named_outputs(result) -> dict:
    if isinstance(result, torch.Tensor):
        return {"output": result}
    if isinstance(result, dict):
        return dict(result)
    return {f"output[{i}]": t for i, t in enumerate(result)}


def _contend(device, stop_after: int = 8):
    """Queue matrix products on a side stream of ``device``, competing for the SMs with the replay."""
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        a = torch.randn(2048, 2048, device=device)
        for _ in range(stop_after):
            a = a @ a / 2048
    return side


def first_difference(name: str, expected: torch.Tensor, actual: torch.Tensor) -> str:
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        return (f"{name}: shape/dtype {tuple(actual.shape)} {actual.dtype} differs from "
                f"{tuple(expected.shape)} {expected.dtype}")
    flat = (bits(expected) != bits(actual)).flatten().nonzero()
    i = int(flat[0])
    index = tuple(int(k) for k in torch.unravel_index(torch.tensor(i), expected.shape))
    e, a = expected.flatten()[i].item(), actual.flatten()[i].item()
    return f"{name}: {len(flat)} elements differ, the first at {index}: {e!r} then {a!r}"


def assert_replays_bit_exact(fn, inputs: dict, replays: int = 10, contention: bool = False) -> dict:
    """Run ``fn(**inputs)`` ``replays`` times; every output (a tensor, a tuple or a dict of tensors) must
    have the bits of the first run. Returns the first run's outputs; raises AssertionError naming the
    first differing element otherwise."""
    first = {name: t.detach().clone() for name, t in _named_outputs(fn(**inputs)).items()}
    reference = {name: bits(t) for name, t in first.items()}
    for replay in range(1, replays):
        side = None
        if contention and any(t.is_cuda for t in first.values()):
            side = _contend(next(t.device for t in first.values() if t.is_cuda))
        outputs = _named_outputs(fn(**inputs))
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        for name, t in outputs.items():
            if not torch.equal(bits(t), reference[name]):
                raise AssertionError(f"replay {replay} of {replays}: " + first_difference(name, first[name], t))
    return first
