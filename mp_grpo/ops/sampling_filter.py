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

Threshold search — one mechanism for top-k and top-p: an exact radix select over the order-preserving
integer key of the logits (16 bits for bf16 / fp16, 32 for fp32; ``kernels/logprob_filter.py``). Each pass
reads the shard once and builds, per row, a histogram of the next key digit among the columns whose
higher digits equal the ones chosen so far and whose logit is >= the thresholds already applied; the
histograms are summed over the TP group (**one all-reduce per pass**) and a tiny kernel picks the digit.
Top-k counts tokens (256-digit passes, 8 key bits each); top-p sums probability mass exp((z - M)) with
the row maximum M known beforehand (16-digit passes, 4 key bits each, then one 256-digit pass over the
last 8 bits, whose digits are single logit values: count x weight, exact). The search is exact: the
result is the key of the k-th largest logit, or of the smallest logit whose strictly-larger mass is < p S.

Schedule of :func:`filter_threshold` (``N`` rows, ``V_local`` columns on each of ``TP`` ranks, ``K`` key
bits: 16 for bf16 / fp16, 32 for fp32; every collective is skipped for a group of size 1)

    1. Row maximum M (min-p and top-p need it): one ``amax`` read of the shard, or — with top-k and no
       min-p — a by-product of top-k's first pass; **one all-reduce (max) of ``[N]`` fp32**.
    2. min-p: ``tau = M + T log(min_p)`` (no pass, no collective).
    3. top-k: ``K / 8`` counting passes (2 for bf16, 4 for fp32), each one read of the shard and
       **one all-reduce (sum) of ``[N, 256]`` int32**; then ``tau = max(tau, k-th largest logit)``.
    4. top-p: ``(K - 8) / 4`` mass passes (2 for bf16, 6 for fp32) with **one all-reduce (sum) of
       ``[N, 16]`` fp32** each, then one exact pass with **one all-reduce (sum) of ``[N, 256]`` fp32**;
       ``tau = max(tau, threshold logit)``.
    No host read anywhere (per-row tensors included). Bitwise batch-invariant: every pass's launch
    depends on V_local only, and the digit choice is per row.

Cost (bf16, TP = 1, one H100, N = 16384, V = 151936): a counting pass is instruction-bound in
``tl.histogram`` of 256 digits (~4.9 reads' worth), a mass pass compute-bound in its 16
compare-select-adds per element (~4.3 reads); top-k = 2 counting passes + the filtered statistics,
top-p = amax + 2 mass passes + 1 counting pass. Measured: ``docs/benchmarks/logprob_filter.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mp_grpo.collectives import ProcessGroup, all_reduce_max, all_reduce_sum, group_size
from mp_grpo.ops.checks import CheckInputs, record_errors
from mp_grpo.ops.logprob_launch import RADIX_COUNT_BITS, RADIX_MASS_BITS, radix_histogram, radix_select


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
    n, v_local = x.shape
    device = x.device
    v_global = v_local * group_size(tp_group)
    key_bits = 16 if x.dtype in (torch.bfloat16, torch.float16) else 32
    tau = torch.full((n,), float("-inf"), dtype=torch.float32, device=device)
    if n == 0:
        return tau

    # --- 1. row maximum over the whole vocabulary (from top-k's first pass when min-p does not need it first) ---
    row_max = None
    if filt.min_p is not None or filt.top_k is None:
        row_max = all_reduce_max(x.amax(dim=-1).float(), tp_group)

    # --- 2. min-p: p_j >= min_p * p_max  <=>  x_j >= x_max + T log(min_p) ---
    if filt.min_p is not None:
        min_p = _per_row(filt.min_p, target_shape, device, torch.float32)
        # log(0) = -inf switches the filter off for that row.
        tau = torch.maximum(tau, row_max + torch.log(min_p) / inv_temperature)

    # --- 3. top-k: radix select of the k-th largest key, 8 bits a pass, counts all-reduced ---
    if filt.top_k is not None:
        k = _per_row(filt.top_k, target_shape, device, torch.int64)
        budget = torch.where((k <= 0) | (k >= v_global), 0, k).to(torch.int32)  # 0: row off
        prefix = torch.zeros(n, dtype=torch.int32, device=device)
        passes = key_bits // RADIX_COUNT_BITS
        for i in range(passes):
            local_max = torch.empty(n, dtype=torch.float32, device=device) if row_max is None and i == 0 else None
            hist = radix_histogram(x, tau, prefix, shift=key_bits - RADIX_COUNT_BITS * (i + 1),
                                   digit_bits=RADIX_COUNT_BITS, mass=False, first=i == 0, row_max_out=local_max)
            hist = all_reduce_sum(hist, tp_group)
            if local_max is not None:
                row_max = all_reduce_max(local_max, tp_group)
            radix_select(hist, x, prefix, budget, tau, digit_bits=RADIX_COUNT_BITS, first=i == 0, last=i == passes - 1)

    # --- 4. top-p: radix select on the mass strictly above, 4 bits a pass, then the last 8 bits exactly ---
    if filt.top_p is not None:
        top_p = _per_row(filt.top_p, target_shape, device, torch.float32).contiguous()
        prefix = torch.zeros(n, dtype=torch.int32, device=device)
        budget = torch.empty(n, dtype=torch.float32, device=device)
        above = torch.zeros(n, dtype=torch.float32, device=device)
        widths = [RADIX_MASS_BITS] * ((key_bits - RADIX_COUNT_BITS) // RADIX_MASS_BITS) + [RADIX_COUNT_BITS]
        shift = key_bits
        for i, bits in enumerate(widths):
            shift -= bits
            hist = radix_histogram(x, tau, prefix, shift=shift, digit_bits=bits, mass=True, row_max=row_max,
                                   inv_temperature=inv_temperature, first=i == 0)
            hist = all_reduce_sum(hist, tp_group)
            radix_select(hist, x, prefix, budget, tau, digit_bits=bits, first=i == 0, last=i == len(widths) - 1,
                         above=above, top_p=top_p)
    return tau


def count_outside_filter(logprobs: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """int64 scalar (no host read): rows whose target lies outside the filter's kept set (log-prob -inf)."""
    return targets_outside_filter(logprobs, target, ignore_index, CheckInputs.OFF).sum()


def targets_outside_filter(
    logprobs: torch.Tensor, target: torch.Tensor, ignore_index: int, mode: CheckInputs
) -> torch.Tensor:
    """Bool mask of the rows whose target lies outside the filter's kept set (the op gave them log-prob -inf;
    ``ignore_index`` rows excluded). Unless ``mode`` is OFF their count goes through the deferred error ledger
    (``mp_grpo.ops.checks.record_errors``): raised at once on the CPU or with ``SYNC``, at the next
    ``mp_grpo.check_errors()`` on a GPU — no host read here."""
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
