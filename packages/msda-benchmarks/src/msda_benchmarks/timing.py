"""How the tools time a call: host time with ``torch.utils.benchmark.Timer``, device time with
``triton.testing.do_bench``.

Host time is what a caller waits for: wall clock with the device synchronized around each block of calls, on
torch's current thread count (Timer would otherwise pin one thread). Device time is the GPU's: do_bench queues
the calls behind a cache flush, so the host's overhead hides unless it exceeds the kernel's; ``graph_ms``
replays a CUDA graph of the calls, which leaves the kernels alone.
"""

from __future__ import annotations

import gc
import statistics

import torch
import torch.utils.benchmark as benchmark


def _timer(fn) -> benchmark.Timer:
    return benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())


def host_ms(fn, min_seconds: float = 0.2) -> list[float]:
    """ms per call of ``fn``, one figure per block of calls, for at least ``min_seconds`` after a warm-up
    (``Timer.blocked_autorange``: each block long enough that the timer's own cost is negligible; calls that
    take milliseconds are timed one per block)."""
    return [t * 1e3 for t in _timer(fn).blocked_autorange(min_run_time=min_seconds).times]


def loop_ms(fn, calls: int) -> float:
    """ms per call of ``calls`` back-to-back calls between two synchronizations (``Timer.timeit``): the host's
    cost per call where the device keeps up."""
    return _timer(fn).timeit(calls).mean * 1e3


def device_ms(fn) -> float:
    """The median of ``triton.testing.do_bench`` (CUDA)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def median_ms(fn, device: torch.device, min_seconds: float = 1.0) -> float:
    """On CUDA, ``device_ms``; on the CPU, the median of ``host_ms`` over at least ``min_seconds``."""
    return device_ms(fn) if device.type == "cuda" else statistics.median(host_ms(fn, min_seconds))


def graph_ms(fn) -> float | None:
    """``device_ms`` of replaying ``fn`` from a CUDA graph (kernel time with no host overhead), or None if ``fn``
    cannot be captured (e.g. it synchronizes). It first collects garbage: a call's autograd graph that only a
    reference cycle keeps alive (torch's first call of an op leaves one) would tie the capture to the default
    stream, and torch no longer collects before a capture."""
    gc.collect()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as error:
        print(f"graph_ms: not captured: {str(error).splitlines()[0]}")
        return None
    return device_ms(graph.replay)
