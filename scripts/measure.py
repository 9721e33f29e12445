"""Measurement helpers shared by the benchmarks in this folder (GPU only).

- :func:`median_ms`: ``triton.testing.do_bench``'s median, for one process.
- :func:`timed_ms`: a fixed number of iterations timed with CUDA events after a barrier, for several
  ranks (``do_bench`` would pick a different count on each rank and deadlock a collective).
- :func:`extra_peak_bytes`: peak memory of one call beyond what was allocated before it.
- :func:`copy_bandwidth`: the device-to-device copy bandwidth, the memory floor's denominator.
- :func:`host_us`: the CPU time to issue one call (no synchronization inside the call).
- :func:`graph_replay_ms`: the GPU time of one call, as the median replay of a CUDA graph that captured it.
- :func:`peak_bytes`: the peak allocated memory during one call (everything allocated counted).
- :func:`fits_in_memory`: whether one call runs without running out of device memory (and its peak).
- :func:`largest_fitting`: the largest integer size that fits, by probes (exponential steps from a guess,
  then bisection); the search itself takes any ``fits(size) -> bool`` and runs without a GPU.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field

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


OUT_OF_MEMORY_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED")
"""Errors that mean the device ran out of memory: ``torch.cuda.OutOfMemoryError`` and these texts in a
``RuntimeError`` (a cuBLAS workspace that cannot be allocated fails with the second)."""


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and any(m in str(err) for m in OUT_OF_MEMORY_MESSAGES))


def peak_bytes(fn) -> int:
    """The peak of ``torch.cuda.memory_allocated`` during one call of ``fn`` — absolute: the weights, gradients
    and inputs allocated before the call are counted."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def fits_in_memory(fn) -> tuple[bool, int | None]:
    """``(True, peak bytes)`` when one call of ``fn`` runs, ``(False, None)`` when it runs out of device memory.

    Either way the call's tensors are released (the error's traceback, which holds its frames, is dropped
    before the garbage collector runs) and the caching allocator's free blocks are returned, so that each probe
    starts from the same state. Any other error is raised."""
    try:
        peak = peak_bytes(fn)
        ok = True
    except (torch.cuda.OutOfMemoryError, RuntimeError) as err:
        if not is_out_of_memory(err):
            raise
        ok, peak = False, None
    gc.collect()
    torch.cuda.empty_cache()
    return ok, peak


@dataclass
class Search:
    """The outcome of :func:`largest_fitting`."""

    largest: int
    """The largest size that fit (``known_fit`` when no probe fit)."""
    first_failure: int | None
    """The smallest size that did not fit; None when ``limit`` fit."""
    probes: list[tuple[int, bool]] = field(default_factory=list)
    """Every probe in order: (size, fitted)."""


def largest_fitting(fits: Callable[[int], bool], guess: int, *, limit: int, known_fit: int = 0,
                    known_failure: int | None = None) -> Search:
    """The largest size in ``[known_fit, limit]`` for which ``fits(size)`` holds, assuming it holds for every smaller size.

    The first probe is ``guess`` (a memory model's estimate, clipped into the open range). While only fits have
    been seen the next probe adds 1, 2, 4, … to the largest fit; while only failures have been seen it subtracts
    1, 2, 4, … from the smallest failure; once both are known it bisects. With a guess off by one: two probes.
    ``known_fit`` / ``known_failure``: sizes already known to fit / fail (0: none known to fit)."""
    if limit < 1 or known_fit < 0 or (known_failure is not None and known_failure <= known_fit):
        raise ValueError(f"largest_fitting: need 0 ≤ known_fit < known_failure and limit ≥ 1, got known_fit={known_fit}, "
                         f"known_failure={known_failure}, limit={limit}")
    lo, hi = min(known_fit, limit), known_failure
    top = limit if hi is None else min(limit, hi - 1)
    probe = min(max(guess, lo + 1), top)
    step, probes = 1, []
    seen_fit = False
    while lo < limit and (hi is None or hi - lo > 1):
        ok = bool(fits(probe))
        probes.append((probe, ok))
        if ok:
            lo, seen_fit = probe, True
        else:
            hi = probe
        if hi is None:  # only fits so far: grow
            probe = min(lo + step, limit)
        elif not seen_fit:  # only failures so far: shrink
            probe = max(hi - step, lo + 1)
        else:
            probe = (lo + hi) // 2
        step *= 2
    return Search(largest=lo, first_failure=hi, probes=probes)
