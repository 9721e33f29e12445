"""Measurement helpers shared by the benchmarks in this folder (GPU only).

- :func:`median_ms`: ``triton.testing.do_bench``'s median, for one process.
- :func:`timed_ms`: a fixed number of iterations timed with CUDA events after a barrier, for several
  ranks (``do_bench`` would pick a different count on each rank and deadlock a collective).
- :func:`extra_peak_bytes`: peak memory of one call beyond what was allocated before it.
- :func:`copy_bandwidth`: the device-to-device copy bandwidth, the memory floor's denominator.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

GiB = 2**30


def median_ms(fn, *, warmup_ms: int = 50, rep_ms: int = 300) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def timed_ms(fn, iters: int, group: dist.ProcessGroup | None = None, warmup: int = 5) -> float:
    """Median of per-iteration CUDA-event times after ``warmup`` calls and a barrier over ``group``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier(group)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def extra_peak_bytes(fwd_bwd) -> int:
    """Peak of one forward+backward beyond what was allocated before it (after one warm-up call, so the
    inputs and the previous call's gradients, which the call frees and allocates again, are the base)."""
    fwd_bwd()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    x = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x))
    del x, y
    return 2 * 2 * GiB / (ms * 1e-3)
