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
- :func:`interleaved_ms`: several calls timed in interleaved rounds in one process (each round times every call
  once with CUDA events, :func:`cuda_event_ms`, in the order given and in the reverse order every other round); :func:`ratio_to` and
  :func:`median_interval`: the figure a benchmark reports for "A against B" from those rounds — the median of the
  per-round ratios A / B with a distribution-free 95 % interval (order statistics of the median). Both take any
  timer and run without a GPU.

Why rounds: on a shared machine the same call timed again in the same process moves by several per cent from one
minute to the next, so medians of A's iterations and then B's cannot resolve the 1 % a target is about; in one
round A and B see the same machine state, and the per-round ratio cancels what drifts slower than a round.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Mapping, Sequence
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



# ------------------------------------------------------------------------------------------------ interleaved rounds
CONFIDENCE = 0.95
"""The coverage asked of :func:`median_interval`: a 95 % interval."""

Timer = Callable[[Callable[[], object]], float]
"""Times one call of a function in milliseconds."""


def cuda_event_ms(fn: Callable[[], object]) -> float:
    """One call of ``fn`` timed with CUDA events: the GPU drained first, the end event waited for."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def interleaved_ms(fns: Mapping[str, Callable[[], object]], rounds: int, *, warmup: int = 1,
                   timer: Timer = cuda_event_ms, before_each: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Each function's time in ``rounds`` interleaved rounds: ``warmup`` untimed calls of every function (in order),
    then round r times every function once with ``timer`` — in the order of ``fns`` (``floor, A, B, …``) in even
    rounds and in the reverse order in odd rounds, so that a machine whose speed drifts steadily during a round
    favours neither the first nor the last function (a fixed order puts that drift into every per-round ratio).
    ``before_each`` runs before every timed call, outside its timed window (e.g. a barrier aligning the ranks).
    Returns ``{name: [ms of round 0, round 1, …]}``."""
    if rounds < 1:
        raise ValueError(f"rounds must be ≥ 1, got {rounds}")
    if warmup < 0:
        raise ValueError(f"warmup must be ≥ 0, got {warmup}")
    if not fns:
        raise ValueError("fns must name at least one function to time")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for r in range(rounds):
        for name, fn in order if r % 2 == 0 else reversed(order):
            if before_each is not None:
                before_each()
            times[name].append(float(timer(fn)))
    return times


@dataclass(frozen=True)
class MedianInterval:
    """The sample median of n values and a distribution-free interval for the true median."""

    median: float
    low: float
    high: float
    """The order statistics x₍ₖ₎ and x₍ₙ₊₁₋ₖ₎ (sorted values, 1-based) of :func:`median_interval`."""
    coverage: float
    """The interval's exact coverage for any continuous distribution: P(Bin(n, ½) ∈ [k, n − k]). ≥ the confidence asked
    for whenever n allows it (n ≥ 6 for 95 %); with fewer values the interval is the whole range and this says how
    little it covers."""
    n: int

    def as_dict(self) -> dict:
        return {"median": self.median, "low": self.low, "high": self.high, "coverage": self.coverage, "n": self.n}


def _binomial_half_cdf(k: int, n: int) -> float:
    """P(Bin(n, ½) ≤ k)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> MedianInterval:
    """The median of ``values`` and the narrowest symmetric order-statistic interval [x₍ₖ₎, x₍ₙ₊₁₋ₖ₎] whose coverage
    of the true median, 1 − 2·P(Bin(n, ½) ≤ k − 1), is at least ``confidence`` — assuming only that the values are
    independent draws of one continuous distribution (no normality). With too few values for ``confidence``: k = 1
    (the range), its smaller coverage recorded."""
    xs = sorted(float(v) for v in values)
    n = len(xs)
    if n == 0:
        raise ValueError("median_interval: no values")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if any(not math.isfinite(x) for x in xs):
        raise ValueError(f"median_interval: values must be finite, got {values!r}")
    median = xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])
    k = 1
    while k + 1 <= (n + 1) // 2 and 1.0 - 2.0 * _binomial_half_cdf(k, n) >= confidence:
        k += 1
    coverage = 1.0 - 2.0 * _binomial_half_cdf(k - 1, n)
    return MedianInterval(median=median, low=xs[k - 1], high=xs[n - k], coverage=coverage, n=n)


def ratio_to(times: Sequence[float], base: Sequence[float], confidence: float = CONFIDENCE) -> MedianInterval:
    """``times`` against ``base`` round by round (both from the same :func:`interleaved_ms` rounds): the median of
    the per-round ratios times[r] / base[r] and its interval (:func:`median_interval`)."""
    if len(times) != len(base):
        raise ValueError(f"ratio_to: {len(times)} times against {len(base)} base times: not the same rounds")
    if any(b <= 0 for b in base):
        raise ValueError(f"ratio_to: base times must be > 0, got {list(base)!r}")
    return median_interval([t / b for t, b in zip(times, base)], confidence)


def median(values: Sequence[float]) -> float:
    """The sample median (the mean of the middle two for an even count)."""
    return median_interval(values).median
