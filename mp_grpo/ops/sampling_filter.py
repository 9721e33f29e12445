"""Replay of an inference engine's sampling filter (min-p, top-k, top-p) on vocab-parallel logits.

The filter is reduced to one number per row: a raw-logit threshold tau; the kept set is
``{j : logits[j] >= tau}``, and the log-prob kernels then compute the statistics of the renormalized
distribution over that set (``HAS_THRESHOLD`` in ``kernels/logprob_stats.py`` / ``logprob_backward.py``).
The threshold is found without gathering the vocabulary.

Convention (vLLM's v1 sampler, ``vllm/v1/sample/ops/topk_topp_sampler.py`` and its min-p logits
processor; order: temperature, min-p, top-k, top-p):

- **min-p** keeps ``p_j >= min_p * max_i p_i``, i.e. ``z_j >= max z + log(min_p)`` (z = logits / T);
  the comparison is done in fp32 raw-logit units, ``x_j >= x_max + T log(min_p)``.
- **top-k** keeps every token whose logit is >= the k-th largest logit: **ties at the k-th value are
  all kept** (vLLM: ``logits < kth_value`` is masked).
- **top-p** (on the distribution left by min-p and top-k) keeps token j iff the probability mass of
  tokens with a strictly larger logit is < p; the largest logit is always kept. vLLM sorts ascending
  and masks ``cumsum <= 1 - p``, always keeping the last position: the two agree whenever no tie
  group straddles the boundary. Inside a tie group vLLM's choice follows its (unstable) sort order;
  here the whole tie group is kept whenever vLLM keeps any member — ties kept, as for top-k.

Threshold search (``kernels/logprob_candidates.py``, ``kernels/logprob_filter.py``). tau depends only on
a row's largest logits, so the statistics' read of the shard keeps the maximum of every group of columns
(8-128 columns: 1/8-1/128 of the bytes), and a small kernel a row takes the 128 largest group maxima,
re-reads those groups and keeps their columns >= the 128th largest maximum theta: every column >= theta,
at least 128 of them (the candidates, ~130-200 a row, at most 512). A select kernel finishes the search on
the candidates of all TP ranks and writes the row's filtered statistics. It finishes top-k for every
k <= 128 (more where the candidates hold more), min-p when its threshold lies among the candidates, and
top-p when the candidates hold >= p of the kept mass — a trained policy's row, where a few tokens hold
almost all of it. The other rows (flat rows under top-p, large k, ties beyond the candidate kernel's
capacity) take the exact radix select on the whole shard (the fallback), flagged rows only: top-k counts tokens
(256-digit passes, 8 key bits each), top-p sums probability mass (16-digit passes, 4 key bits each, then one
256-digit pass over the last 8 bits, whose digits are single logit values: count x weight, exact). Both
paths are exact: the result is the key of the k-th largest logit, or of the smallest logit whose
strictly-larger mass is < p S.

Schedule of :func:`filtered_statistics` / :func:`filter_threshold` (``N`` rows, ``V_local`` columns on each
of ``TP`` ranks, ``K`` key bits: 16 for bf16 / fp16, 32 for fp32; every collective is skipped for a group
of size 1)

    1. ``logprob_group_max_kernel``: one read of the shard — the raw row maximum, with top-p the sum-exp, and
       the group maxima; ``logprob_candidates_kernel``: theta and the candidates of each row (a re-read of its
       chosen groups) into the candidate buffer ``[N, 4 + 512 x 2 bytes / 4]`` int32 (bf16; head + candidates).
    2. **One all-gather of the candidate buffers** over the TP group (``[TP, N, W]``).
    3. ``logprob_candidate_select_kernel``: per row min-p, top-k, top-p on the union of the candidates
       (``kernels/logprob_candidates.py``): tau, the row maximum M, a finished flag; for finished rows
       (statistics asked for) this shard's statistics over its kept candidates.
    4. Fallback, rows not finished (the others skip every launch's work; at TP = 1 steps 4 and 5 are one launch,
       ``logprob_radix_search_kernel``, a row's whole search in one program): top-k: ``K / 8`` counting passes
       (2 for bf16, 4 for fp32), each one read of the shard and **one all-reduce (sum) of ``[N, 256]``
       int32**; then tau = max(tau, k-th largest logit).
    5. Fallback, top-p: ``(K - 8) / 4`` mass passes (2 for bf16, 6 for fp32) with **one all-reduce (sum)
       of ``[N, 16]`` fp32** each, then one exact pass with **one all-reduce (sum) of ``[N, 256]`` fp32**,
       the masses relative to step 3's M.
    6. (``filtered_statistics``) ``logprob_stats_kernel`` with the threshold on the rows not finished.
    No host read anywhere (per-row tensors included): the fallback's launches and collectives run whether
    or not a row needs them. Bitwise batch-invariant: every launch depends on V_local only, and every
    decision and sum of a row is made by that row's own programs in a fixed order.

Cost (bf16, TP = 1, one H100, N = 16384): a trained policy's rows cost the statistics' read and the
select kernel; flat rows under top-p pay the fallback's passes on top (each ~4-5 reads' worth:
instruction-bound histograms). Measured: ``docs/benchmarks/logprob_filter.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from typing import NamedTuple

from mp_grpo.collectives import ProcessGroup, all_gather_stacked, all_reduce_sum, group_rank, group_size
from mp_grpo.ops.checks import CheckInputs, record_errors
from mp_grpo.ops.filter_launch import (
    RADIX_COUNT_BITS,
    RADIX_MASS_BITS,
    candidates_of,
    gather_candidates,
    key_bits,
    radix_histogram,
    radix_search,
    radix_select,
    select_from_candidates,
)
from mp_grpo.ops.logprob_launch import shard_statistics


@dataclass(frozen=True)
class SamplingFilter:
    """The rollout's sampling filter, replayed at training time (vLLM's convention; module docstring).

    Each field is ``None`` (off), a Python number for every row, or a tensor of ``target.shape`` (one
    value per row, as vLLM's per-request sampling params). Under tensor parallelism every rank of the
    group must pass the same values (as it passes the same targets): a per-row top_k sizes a collective.
    """

    top_k: int | torch.Tensor | None = None
    """Keep the tokens whose logit is >= the k-th largest (ties kept). int >= 1; in a per-row tensor,
    values <= 0 switch the filter off for that row (vLLM's ``top_k = 0 / -1``); k >= V keeps all."""
    top_p: float | torch.Tensor | None = None
    """Nucleus: keep the tokens whose strictly-larger mass is < p. In (0, 1]; 1 keeps all."""
    min_p: float | torch.Tensor | None = None
    """Keep the tokens with probability >= min_p * the largest probability. In [0, 1]; 0 keeps all."""

    def without_noops(self, vocab_size: int) -> SamplingFilter | None:
        """The same filter without the Python-number fields that keep everything (top_p = 1,
        top_k >= vocab_size, min_p = 0); None when nothing is left (the op then runs unfiltered)."""
        top_k = None if isinstance(self.top_k, int) and self.top_k >= vocab_size else self.top_k
        top_p = None if isinstance(self.top_p, (int, float)) and self.top_p >= 1.0 else self.top_p
        min_p = None if isinstance(self.min_p, (int, float)) and self.min_p == 0.0 else self.min_p
        if top_k is None and top_p is None and min_p is None:
            return None
        return SamplingFilter(top_k=top_k, top_p=top_p, min_p=min_p)


    def flattened(self) -> SamplingFilter:
        """The same filter with every per-row tensor flattened to ``[N]`` (for callers that cut rows)."""
        return SamplingFilter(**{name: value.reshape(-1) if isinstance(value, torch.Tensor) else value
                                 for name, value in self._fields()})

    def rows(self, start: int, stop: int) -> SamplingFilter:
        """Rows ``start:stop`` of a :meth:`flattened` filter (Python numbers stay as they are)."""
        return SamplingFilter(**{name: value[start:stop] if isinstance(value, torch.Tensor) else value
                                 for name, value in self._fields()})

    def _fields(self):
        return (("top_k", self.top_k), ("top_p", self.top_p), ("min_p", self.min_p))


def _per_row(value, shape: torch.Size, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A field as ``[N]`` values of ``dtype`` (checked already: :func:`check_sampling_filter`)."""
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).to(dtype)
    return torch.full((math.prod(shape),), value, dtype=dtype, device=device)


def check_sampling_filter(filt: SamplingFilter, target_shape: torch.Size, device: torch.device,
                          *, check_tensors: bool) -> None:
    """Types and ranges of the filter's fields; tensor values are checked only with ``check_tensors``
    (through the deferred error ledger: no host read on a GPU)."""
    if not isinstance(filt, SamplingFilter):
        raise TypeError(f"sampling_filter must be a SamplingFilter or None, got {type(filt).__name__}")
    ranges = {"top_k": None, "top_p": (0.0, 1.0, False), "min_p": (0.0, 1.0, True)}
    for name, bounds in ranges.items():
        value = getattr(filt, name)
        if value is None:
            continue
        if isinstance(value, torch.Tensor):
            if value.shape != target_shape:
                raise ValueError(f"sampling_filter.{name} tensor shape {tuple(value.shape)} must equal target.shape "
                                 f"{tuple(target_shape)}")
            if value.device != device:
                raise ValueError(f"sampling_filter.{name} is on {value.device} but the logits are on {device}")
            if name == "top_k" and (value.dtype.is_floating_point or value.dtype == torch.bool):
                raise TypeError(f"sampling_filter.top_k tensor must be integer, got {value.dtype}")
            if name != "top_k" and not value.dtype.is_floating_point:
                raise TypeError(f"sampling_filter.{name} tensor must be floating point, got {value.dtype}")
            if check_tensors and bounds is not None:
                lo, hi, lo_closed = bounds
                bad = ((value < lo) if lo_closed else (value <= lo)) | (value > hi) | torch.isnan(value)
                interval = f"{'[' if lo_closed else '('}{lo}, {hi}]"
                # Through the deferred error ledger: at once on the CPU, at mp_grpo.check_errors() on a GPU.
                record_errors(f"sampling_filter.{name} out of range", bad.sum(),
                              lambda count, name=name, interval=interval:
                              f"sampling_filter.{name} has values outside {interval} ({count} rows)")
            continue
        if name == "top_k":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"sampling_filter.top_k must be an int >= 1, a per-row tensor or None, got {value!r}")
            continue
        lo, hi, lo_closed = bounds
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            (lo <= value if lo_closed else lo < value) and value <= hi
        ):
            raise ValueError(
                f"sampling_filter.{name} must be a float in {'[' if lo_closed else '('}{lo}, {hi}], a per-row tensor "
                f"or None, got {value!r}"
            )


class _StatsRequest(NamedTuple):
    """Where :func:`filtered_statistics` wants the shard's statistics written."""

    target: torch.Tensor  # [n] int64
    stats: torch.Tensor  # [N + 1, 4] fp32
    row_start: int
    with_entropy: bool


class ThresholdSearch(NamedTuple):
    tau: torch.Tensor
    """[n] fp32 raw-logit threshold of the kept set (-inf: keep all)."""
    finished: torch.Tensor
    """[n] int8: 1 where the candidates gave the threshold (steps 1-3), 0 where the fallback did."""
    row_max: torch.Tensor
    """[n] fp32 raw row maximum over the whole vocabulary; +inf where a logit is NaN or +inf."""


def filter_threshold(
    x: torch.Tensor,  # [N, V_local] logits shard, last dim contiguous
    filt: SamplingFilter,
    target_shape: torch.Size,
    *,
    tp_group: ProcessGroup | None,
    inv_temperature: float,
) -> torch.Tensor:
    """``[N]`` fp32 raw-logit threshold of the filter's kept set (``-inf``: keep all). See the module
    docstring for the schedule and its collectives. ``filt`` is trusted: the op that calls this checked it
    against ``target_shape`` (:func:`check_sampling_filter`)."""
    return threshold_search(x, filt, target_shape, tp_group=tp_group, inv_temperature=inv_temperature).tau


def filtered_statistics(
    x: torch.Tensor,  # [n, V_local] logits shard, last dim contiguous
    target: torch.Tensor,  # [n] int64
    stats: torch.Tensor,  # [N + 1, 4] fp32 from new_stats_buffer(N)
    filt: SamplingFilter,
    target_shape: torch.Size,
    *,
    row_start: int = 0,
    tp_group: ProcessGroup | None,
    inv_temperature: float,
    with_entropy: bool,
) -> torch.Tensor:
    """:func:`mp_grpo.ops.logprob_launch.shard_statistics` of the filtered distribution: the statistics of the kept
    columns of ``x`` into ``stats[row_start : row_start + n]`` (and the shard size into ``stats[N]``); returns the
    ``[n]`` fp32 thresholds (saved for backward). The finished rows' statistics come from the candidates (step 3),
    the others' from one more read (step 6)."""
    request = _StatsRequest(target, stats, row_start, with_entropy)
    search = threshold_search(x, filt, target_shape, tp_group=tp_group, inv_temperature=inv_temperature,
                              statistics=request)
    # --- 6. the rows the candidates did not finish: statistics over the kept columns of the whole shard ---
    shard_statistics(x, target, stats, row_start=row_start, vocab_start=group_rank(tp_group) * x.shape[1],
                     inv_temperature=inv_temperature, with_entropy=with_entropy, threshold=search.tau,
                     skip=search.finished)
    # --- 7. rows with a NaN / +inf logit anywhere (their maximum is +inf: the group maxima count a NaN as +inf) or
    #        none above -inf: the sum-exp is NaN, so the merge reports them as it reports an unfiltered row — the
    #        kept set alone would hide a NaN outside it ---
    rows = stats[row_start : row_start + x.shape[0], 1]
    rows.masked_fill_(~torch.isfinite(search.row_max), float("nan"))
    return search.tau


def threshold_search(
    x: torch.Tensor,  # [n, V_local] logits shard, last dim contiguous
    filt: SamplingFilter,
    target_shape: torch.Size,
    *,
    tp_group: ProcessGroup | None,
    inv_temperature: float,
    statistics: _StatsRequest | None = None,
) -> ThresholdSearch:
    """Steps 1-5 of the module docstring (with ``statistics``, step 3 also writes the finished rows' statistics)."""
    n, v_local = x.shape
    device = x.device
    tp = group_size(tp_group)
    v_global = v_local * tp
    if n == 0:
        return ThresholdSearch(torch.empty(0, dtype=torch.float32, device=device),
                               torch.empty(0, dtype=torch.int8, device=device),
                               torch.empty(0, dtype=torch.float32, device=device))
    top_k = min_p = top_p = None
    if filt.top_k is not None:  # int32 k, 0: off (k <= 0 or k >= V keeps all)
        if isinstance(filt.top_k, int):
            top_k = torch.full((n,), filt.top_k if filt.top_k < v_global else 0, dtype=torch.int32, device=device)
        else:
            k = _per_row(filt.top_k, target_shape, device, torch.int64)
            top_k = torch.where((k <= 0) | (k >= v_global), 0, k).to(torch.int32)
    if filt.top_p is not None:
        top_p = _per_row(filt.top_p, target_shape, device, torch.float32).contiguous()
    if filt.min_p is not None:
        min_p = _per_row(filt.min_p, target_shape, device, torch.float32).contiguous()

    # --- 1. one read: the candidates, the row maximum and (top-p) the sum-exp ---
    found = gather_candidates(x, with_sum=top_p is not None, inv_temperature=inv_temperature)
    # --- 2. the one all-gather of the candidate buffers ---
    gathered = candidates_of(all_gather_stacked(found.buffer, tp_group), x.dtype)
    # --- 3. min-p, top-k, top-p on the candidates; the finished rows' statistics ---
    selected = select_from_candidates(
        gathered, x, rank=group_rank(tp_group), v_global=v_global, top_k=top_k, top_p=top_p, min_p=min_p,
        inv_temperature=inv_temperature,
        stats=statistics.stats if statistics is not None else None,
        target=statistics.target if statistics is not None else None,
        row_start=statistics.row_start if statistics is not None else 0,
        with_entropy=statistics.with_entropy if statistics is not None else False,
    )
    tau, skip = selected.tau, selected.finished
    bits = key_bits(x.dtype)

    if tp == 1:
        # --- 4.–5. TP = 1: the fallback's whole search in one launch (no histogram meets other ranks') ---
        radix_search(x, tau, selected.row_max, top_k=top_k, top_p=top_p, skip=skip, inv_temperature=inv_temperature)
        return ThresholdSearch(tau, skip, selected.row_max)

    # --- 4. fallback top-k: radix select of the k-th largest key, 8 bits a pass, counts all-reduced ---
    if top_k is not None:
        prefix = torch.zeros(n, dtype=torch.int32, device=device)
        passes = bits // RADIX_COUNT_BITS
        for i in range(passes):
            hist = radix_histogram(x, tau, prefix, shift=bits - RADIX_COUNT_BITS * (i + 1),
                                   digit_bits=RADIX_COUNT_BITS, mass=False, first=i == 0, skip=skip)
            radix_select(all_reduce_sum(hist, tp_group), x, prefix, top_k, tau, digit_bits=RADIX_COUNT_BITS,
                         first=i == 0, last=i == passes - 1, skip=skip)

    # --- 5. fallback top-p: radix select on the mass strictly above, 4 bits a pass, then the last 8 bits exactly ---
    if top_p is not None:
        prefix = torch.zeros(n, dtype=torch.int32, device=device)
        budget = torch.empty(n, dtype=torch.float32, device=device)
        above = torch.zeros(n, dtype=torch.float32, device=device)
        widths = [RADIX_MASS_BITS] * ((bits - RADIX_COUNT_BITS) // RADIX_MASS_BITS) + [RADIX_COUNT_BITS]
        shift = bits
        for i, width in enumerate(widths):
            shift -= width
            hist = radix_histogram(x, tau, prefix, shift=shift, digit_bits=width, mass=True, row_max=selected.row_max,
                                   inv_temperature=inv_temperature, first=i == 0, skip=skip)
            radix_select(all_reduce_sum(hist, tp_group), x, prefix, budget, tau, digit_bits=width, first=i == 0,
                         last=i == len(widths) - 1, above=above, top_p=top_p, skip=skip)
    return ThresholdSearch(tau, skip, selected.row_max)


def count_outside_filter(logprobs: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """int64 scalar (no host read): rows whose target lies outside the filter's kept set (log-prob -inf)."""
    return targets_outside_filter(logprobs, target, ignore_index, CheckInputs.OFF).sum()


def targets_outside_filter(
    logprobs: torch.Tensor, target: torch.Tensor, ignore_index: int, mode: CheckInputs
) -> torch.Tensor:
    """Bool mask of the rows whose target lies outside the filter's kept set (the op gave them log-prob -inf;
    ``ignore_index`` rows excluded). ``logprobs``: the op's log-probs, or any per-row value that is -inf exactly
    where they are (the fused logits op passes the targets' logits summed over the shards). Unless ``mode`` is OFF
    their count goes through the deferred error ledger (``mp_grpo.ops.checks.record_errors``): raised at once on
    the CPU or with ``SYNC``, at the next ``mp_grpo.check_errors()`` on a GPU — no host read here."""
    outside = torch.isneginf(logprobs) & (target != ignore_index)
    if mode is CheckInputs.OFF:
        return outside

    def message(count: int) -> str:
        return (
            f"target: {count} token id(s) lie outside the sampling_filter's kept set (probability 0 under the "
            f"filtered distribution). Check that the filter matches the rollout's sampling params, or pass "
            f"check_inputs=False to get log-prob -inf and no gradient for them"
        )

    record_errors("target outside the sampling filter", outside.sum(), message, mode=mode)
    return outside
