"""Measurement helpers shared by the benchmarks in this folder (GPU only).

- :func:`median_ms`: ``triton.testing.do_bench``'s median, for one process.
- :func:`timed_ms`: a fixed number of iterations timed with CUDA events after a barrier, for several
  ranks (``do_bench`` would pick a different count on each rank and deadlock a collective).
- :func:`extra_peak_bytes`: peak memory of one call beyond what was allocated before it.
- :func:`copy_bandwidth`: the device-to-device copy bandwidth, the memory floor's denominator.
- :func:`host_us`: the CPU time to issue one call (no synchronization inside the call).
- :func:`graph_replay_ms`: the GPU time of one call, as the median replay of a CUDA graph that captured it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

GiB = 2**30


def median_ms(fn, *, warmup_ms: int = 50, rep_ms: int = 300, grad_to_none=None) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none,
                                         return_mode="median"))


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


def host_us(fn, calls: int = 20) -> float:
    """Mean host time of one call in microseconds: the GPU is idle at the start and nothing inside synchronizes
    (the default checks read nothing on the host), so this is the CPU time to issue the call. ``calls`` stays
    small enough that the launch queue never fills and blocks the host."""
    import time

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def graph_replay_ms(fn, *, warmup: int = 3, **median_kwargs) -> float:
    """GPU time of one call of ``fn``: the median replay of a CUDA graph that captured it (warm-up calls on a
    side stream first; no host launch overhead, which eager timing includes). ``median_kwargs`` go to
    :func:`median_ms`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = median_ms(graph.replay, **median_kwargs)
    del graph
    torch.cuda.empty_cache()
    return ms
