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

Schedule of :func:`filter_threshold` (``N`` rows, ``V_local`` columns on each of ``TP`` ranks;
every collective is skipped for a group of size 1)

    1. Row maximum and top-k: with top-k, ``torch.topk`` of each shard's ``k_max`` largest values,
       **one all-gather of ``[N, min(k_max, V_local)]`` fp32**, and the k-th largest of the merged
       ``TP * min(k_max, V_local)`` values (k_max = the largest k; a per-row k tensor costs one
       host read of its maximum). Without top-k, **one all-reduce (max) of ``[N]`` fp32**.
    2. min-p: ``tau = max(tau, x_max + T log(min_p))`` (no collective).
    3. top-p: a radix search over an order-preserving integer key of the fp32 logit, 4 key bits a
       round: ``logprob_filter_bins_kernel`` sums exp(z - M) of the kept columns in 16 sub-ranges
       of the current key interval (one read of the shard), **one all-reduce (sum) of ``[N, 16]``
       fp32** per round, and a 16-step scan picks the sub-range where the mass from the top crosses
       p * S. The search is exact: 4 rounds for bf16 logits, 5 for fp16, 8 for fp32 (the key bits
       that the logits' dtype can set).

The log-prob op then makes its usual all-gather of ``[N + 1, 4]`` statistics, restricted to the kept set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mp_grpo.collectives import ProcessGroup, all_gather_stacked, all_reduce_max, all_reduce_sum, group_size
from mp_grpo.ops.logprob_launch import FILTER_BINS, filter_bin_masses

_KEY_BITS_PER_ROUND = 4  # log2(FILTER_BINS)
# Rounds of the top-p search: the top key bits a logit of each dtype can set, 4 per round
# (bf16 -> fp32 leaves 16 low bits constant, fp16 -> fp32 leaves 13).
_SEARCH_ROUNDS = {torch.bfloat16: 4, torch.float16: 5, torch.float32: 8}
_KEY_MIN = -(2**31)
_NEG_KEY_FLIP = 0x7FFFFFFF


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


def _per_row(value, name: str, shape: torch.Size, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.shape != shape:
            raise ValueError(f"sampling_filter.{name} tensor shape {tuple(value.shape)} must equal target.shape {tuple(shape)}")
        if value.device != device:
            raise ValueError(f"sampling_filter.{name} is on {value.device} but the logits are on {device}")
        return value.reshape(-1).to(dtype)
    return torch.full((math.prod(shape),), value, dtype=dtype, device=device)


def check_sampling_filter(filt: SamplingFilter, target_shape: torch.Size, device: torch.device,
                          *, check_tensors: bool) -> None:
    """Types and ranges of the filter's fields; tensor values are checked (one host read) only with
    ``check_tensors``."""
    if not isinstance(filt, SamplingFilter):
        raise TypeError(f"sampling_filter must be a SamplingFilter or None, got {type(filt).__name__}")
    ranges = {"top_k": None, "top_p": (0.0, 1.0, False), "min_p": (0.0, 1.0, True)}
    for name, bounds in ranges.items():
        value = getattr(filt, name)
        if value is None:
            continue
        if isinstance(value, torch.Tensor):
            _per_row(value, name, target_shape, device, value.dtype)
            if name == "top_k" and (value.dtype.is_floating_point or value.dtype == torch.bool):
                raise TypeError(f"sampling_filter.top_k tensor must be integer, got {value.dtype}")
            if name != "top_k" and not value.dtype.is_floating_point:
                raise TypeError(f"sampling_filter.{name} tensor must be floating point, got {value.dtype}")
            if check_tensors and bounds is not None:
                lo, hi, lo_closed = bounds
                bad = ((value < lo) if lo_closed else (value <= lo)) | (value > hi) | torch.isnan(value)
                if bool(bad.any()):
                    raise ValueError(f"sampling_filter.{name} has values outside {'[' if lo_closed else '('}{lo}, {hi}]")
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


def _key_to_float(key: torch.Tensor) -> torch.Tensor:
    """Inverse of the kernel's key map; keys below that of -inf (NaN patterns) become -inf."""
    k32 = key.to(torch.int32)
    bits = torch.where(k32 < 0, k32 ^ _NEG_KEY_FLIP, k32)
    value = bits.view(torch.float32)
    return torch.where(torch.isnan(value), torch.full_like(value, float("-inf")), value)


def filter_threshold(
    x: torch.Tensor,  # [N, V_local] logits shard, last dim contiguous
    filt: SamplingFilter,
    target_shape: torch.Size,
    *,
    tp_group: ProcessGroup | None,
    inv_temperature: float,
) -> torch.Tensor:
    """``[N]`` fp32 raw-logit threshold of the filter's kept set (``-inf``: keep all). See the module
    docstring for the schedule and its collectives."""
    n, v_local = x.shape
    device = x.device
    v_global = v_local * group_size(tp_group)
    threshold = torch.full((n,), float("-inf"), dtype=torch.float32, device=device)
    if n == 0:
        return threshold

    # --- 1. row maximum; top-k threshold from each shard's k largest values (one all-gather) ---
    if filt.top_k is not None:
        k_rows = _per_row(filt.top_k, "top_k", target_shape, device, torch.int64)
        k_rows = torch.where(k_rows <= 0, v_global, k_rows).clamp(max=v_global)
        k_max = int(k_rows.max()) if isinstance(filt.top_k, torch.Tensor) and n > 0 else int(min(filt.top_k, v_global))
        local = x.topk(min(max(k_max, 1), v_local), dim=-1, sorted=False).values.float()  # [N, k_local]
        gathered = all_gather_stacked(local, tp_group)  # [TP, N, k_local]
        candidates = gathered.permute(1, 0, 2).reshape(n, -1)
        top = candidates.topk(min(max(k_max, 1), candidates.shape[1]), dim=-1, sorted=True).values
        row_max = top[:, 0].contiguous()
        kth = top.gather(1, (k_rows.clamp(max=top.shape[1]) - 1).unsqueeze(1)).squeeze(1)
        threshold = torch.where(k_rows < v_global, kth, threshold)
    else:
        row_max = all_reduce_max(x.amax(dim=-1).float(), tp_group)

    # --- 2. min-p: p_j >= min_p * p_max  <=>  x_j >= x_max + T log(min_p) ---
    if filt.min_p is not None:
        min_p = _per_row(filt.min_p, "min_p", target_shape, device, torch.float32)
        # log(0) = -inf switches the filter off for that row.
        threshold = torch.maximum(threshold, row_max + torch.log(min_p) / inv_temperature)

    # --- 3. top-p: radix search on the logit's key, one all-reduce of [N, 16] masses per round ---
    if filt.top_p is not None:
        top_p = _per_row(filt.top_p, "top_p", target_shape, device, torch.float32)
        key_lo = torch.full((n,), _KEY_MIN, dtype=torch.int64, device=device)
        above = torch.zeros(n, dtype=torch.float32, device=device)  # kept mass with a key above the interval
        target_mass = None
        shift = 32
        for _ in range(_SEARCH_ROUNDS[x.dtype]):
            shift -= _KEY_BITS_PER_ROUND
            masses = all_reduce_sum(
                filter_bin_masses(x, threshold, row_max, key_lo, shift=shift, inv_temperature=inv_temperature),
                tp_group,
            )
            if target_mass is None:  # the first round's interval holds every key: its total is S
                total = masses[:, 0]
                for b in range(1, FILTER_BINS):
                    total = total + masses[:, b]
                target_mass = top_p * total
            # F_b = mass above sub-range b, summed in a fixed order (batch-invariant); the lowest b
            # with F_b < p * S holds the threshold.
            chosen = torch.zeros(n, dtype=torch.int64, device=device)
            chosen_above = above
            running = above
            for b in range(FILTER_BINS - 1, -1, -1):
                # F_b is non-increasing in b: the last ok while walking down is the lowest one.
                ok = running < target_mass
                chosen = torch.where(ok, b, chosen)
                chosen_above = torch.where(ok, running, chosen_above)
                running = running + masses[:, b]
            above = chosen_above
            key_lo = key_lo + (chosen << shift)
        p_threshold = _key_to_float(key_lo)
        threshold = torch.where(top_p < 1.0, torch.maximum(threshold, p_threshold), threshold)
    return threshold


def count_outside_filter(logprobs: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """int64 scalar (no host read): rows whose target lies outside the filter's kept set (log-prob -inf)."""
    return (torch.isneginf(logprobs) & (target != ignore_index)).sum()


def raise_on_targets_outside_filter(outside: torch.Tensor) -> None:
    """Checked mode: one host read; raise naming the argument if any target lies outside the kept set."""
    count = int(outside.sum())
    if count:
        rows = outside.nonzero().flatten()[:8].tolist()
        raise ValueError(
            f"target: {count} token id(s) lie outside the sampling_filter's kept set (probability 0 under the "
            f"filtered distribution; first flattened rows: {rows}). Check that the filter matches the rollout's "
            f"sampling params, or pass check_inputs=False to get log-prob -inf and no gradient for them"
        )
