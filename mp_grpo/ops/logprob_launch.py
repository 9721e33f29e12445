"""Host launchers for the log-prob kernels, and the steps both log-prob ops share.

Shared by :mod:`mp_grpo.ops.vocab_parallel_logprobs` (logits given) and
:mod:`mp_grpo.ops.fused_linear_logprobs` (logits computed chunk by chunk). The launchers make no
collective; :func:`gather_and_merge` makes the ops' one all-gather.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from mp_grpo.collectives import ProcessGroup, all_gather_stacked
from mp_grpo.kernels import (
    LogprobLaunchConfig,
    logprob_backward_kernel,
    logprob_radix_hist_kernel,
    logprob_radix_select_kernel,
    logprob_launch_config,
    logprob_merge_kernel,
    logprob_stats_kernel,
)
from mp_grpo.kernels.launch_config import ceil_div
from mp_grpo.ops.checks import CheckInputs, kernel_counters, merge_error_kinds, raise_on_kernel_errors
from mp_grpo.ops.launcher import LaunchMeta, launch, launch_meta

STATS_WIDTH = 4
"""Columns of the per-row statistics: (max, sum-exp, sum-exp*(z - max), target logit)."""


@functools.lru_cache(maxsize=256)
def _stats_meta(cfg: LogprobLaunchConfig, with_entropy: bool, has_threshold: bool) -> LaunchMeta:
    return LaunchMeta(HAS_ENTROPY=with_entropy, HAS_THRESHOLD=has_threshold, BLOCK_V=cfg.stats_block_v,
                      num_warps=cfg.stats_warps)


@functools.lru_cache(maxsize=256)
def _backward_meta(cfg: LogprobLaunchConfig, entropy_grad: bool, has_threshold: bool, grad_scale: bool) -> LaunchMeta:
    return LaunchMeta(HAS_ENTROPY_GRAD=entropy_grad, HAS_THRESHOLD=has_threshold, HAS_GRAD_SCALE=grad_scale,
                      BLOCK_V=cfg.backward_block_v, num_warps=cfg.backward_warps)


def new_stats_buffer(rows: int, device: torch.device) -> torch.Tensor:
    """``[rows + 1, 4]`` fp32 buffer for :func:`shard_statistics`.

    The extra last row carries this shard's vocabulary size through the same all-gather as the
    statistics, so the merge can check that every TP rank holds a shard of the same size without a
    collective of its own. The statistics kernel writes it.
    """
    return torch.empty(rows + 1, STATS_WIDTH, dtype=torch.float32, device=device)


def shard_statistics(
    logits: torch.Tensor,  # [n, V_local], last dim contiguous
    target: torch.Tensor,  # [n] int64
    stats: torch.Tensor,  # [N + 1, 4] fp32 from new_stats_buffer(N)
    *,
    row_start: int = 0,
    vocab_start: int,
    inv_temperature: float,
    with_entropy: bool,
    threshold: torch.Tensor | None = None,  # [n] fp32 raw-logit threshold of a sampling filter
) -> None:
    """Write the statistics of ``logits`` into ``stats[row_start : row_start + n]`` (one read of the
    logits) and the shard size into ``stats[N]``. Chunked callers pass their chunk's ``row_start``.
    With ``threshold`` only the columns whose logit is >= it count (a sampling filter's kept set)."""
    n, v_local = logits.shape
    cfg = logprob_launch_config(v_local)
    launch_meta(logprob_stats_kernel, (max(n, 1),), _stats_meta(cfg, with_entropy, threshold is not None),
        logits, target, stats,
        threshold if threshold is not None else stats,  # unused placeholder pointer without a filter
        n, row_start, stats.shape[0] - 1, v_local, vocab_start,
        logits.stride(0), stats.stride(0),
        inv_temperature,
    )


class Merged(NamedTuple):
    logprobs: torch.Tensor
    """[N] fp32; 0 where target == ignore_index."""
    entropy: torch.Tensor
    """[N] fp32; empty (0 rows) when the merge was asked for no entropy."""
    row_max: torch.Tensor
    """[N] fp32 row maximum M of z = logits / T over the whole vocabulary (saved for backward)."""
    log_sum: torch.Tensor
    """[N] fp32 log S, S = sum exp(z - M); logZ = M + log S (saved for backward)."""
    errors: torch.Tensor
    """[3] int64 counters the merge added into: (shard-size mismatches, targets outside [0, V_global) other than
    ignore_index, rows with non-finite logits) — the deferred ledger's own slots, fresh zeros, or a scratch
    (``check_inputs``)."""


def merge_statistics(
    stats: torch.Tensor,  # [TP, N + 1, 4] fp32 gathered stats buffers
    target: torch.Tensor,  # [N] int64
    *,
    v_local: int,
    ignore_index: int,
    with_entropy: bool,
    errors: torch.Tensor,  # [3] int64 counters to add into
) -> Merged:
    """Merge the gathered statistics of every TP shard (one small kernel)."""
    tp, rows_plus_one, _ = stats.shape
    n = rows_plus_one - 1
    device = stats.device
    logprobs = torch.empty(n, dtype=torch.float32, device=device)
    entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=device)
    row_max = torch.empty(n, dtype=torch.float32, device=device)
    log_sum = torch.empty(n, dtype=torch.float32, device=device)
    block_n = logprob_launch_config(v_local).merge_block_n
    launch(logprob_merge_kernel, (max(ceil_div(n, block_n), 1),),
        stats, target, logprobs, entropy, row_max, log_sum, errors,
        n, tp, tp * v_local, ignore_index,
        stats.stride(0), stats.stride(1),
        HAS_ENTROPY=with_entropy,
        BLOCK_N=block_n,
    )
    return Merged(logprobs, entropy, row_max, log_sum, errors)


class Gathered(NamedTuple):
    """The all-gathered statistics and where the merge adds its error counts."""

    stats: torch.Tensor
    """[TP, N + 1, 4] fp32."""
    errors: torch.Tensor
    """[3] int64 counters (the deferred ledger's own slots, fresh zeros, or a scratch)."""
    kinds: tuple
    """The three error kinds of ``errors`` (``merge_error_kinds``)."""
    deferred: bool
    """The counters are the ledger's: nothing to read at the call."""


def gather_statistics(
    stats: torch.Tensor,  # [N + 1, 4] fp32, filled by shard_statistics
    *,
    tp_group: ProcessGroup | None,
    v_local: int,
    ignore_index: int,
    check_inputs: CheckInputs,
) -> Gathered:
    """Forward step 2 of both log-prob ops: the one all-gather of the statistics over ``tp_group``, and the error
    counters the merge will add into."""
    gathered = all_gather_stacked(stats, tp_group)
    kinds = merge_error_kinds(v_global=gathered.shape[0] * v_local, ignore_index=ignore_index, gathered_stats=gathered)
    # Deferred (GPU): the kernel adds into the ledger's own counters — nothing else to launch or read.
    errors, deferred = kernel_counters(kinds, stats.device, check_inputs)
    return Gathered(gathered, errors, kinds, deferred)


def raise_on_merge_errors(gathered: Gathered, check_inputs: CheckInputs) -> None:
    """After the merge: raise at the call unless the counts were deferred (or nothing is checked)."""
    if not gathered.deferred and check_inputs is not CheckInputs.OFF:
        raise_on_kernel_errors(gathered.errors, gathered.kinds, check_inputs)


def gather_and_merge(
    stats: torch.Tensor,  # [N + 1, 4] fp32, filled by shard_statistics
    target: torch.Tensor,  # [N] int64
    *,
    tp_group: ProcessGroup | None,
    v_local: int,
    ignore_index: int,
    with_entropy: bool,
    check_inputs: CheckInputs,
) -> Merged:
    """Forward steps 2–3 of both log-prob ops: the one all-gather of the statistics over ``tp_group``,
    the merge, and the merge's error counts to the ledger (``check_inputs``; no host read unless SYNC)."""
    gathered = gather_statistics(stats, tp_group=tp_group, v_local=v_local, ignore_index=ignore_index,
                                 check_inputs=check_inputs)
    merged = merge_statistics(gathered.stats, target, v_local=v_local, ignore_index=ignore_index,
                              with_entropy=with_entropy, errors=gathered.errors)
    raise_on_merge_errors(gathered, check_inputs)
    return merged


def flat_upstream_grads(
    grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None, rows: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The upstream gradients as the backward kernel reads them: ``[N]`` fp32, contiguous (a missing
    log-prob gradient is zeros; a missing entropy gradient stays None, so its term is skipped)."""
    if grad_logprobs is None:
        grad_logprobs = torch.zeros(rows, dtype=torch.float32, device=device)
    grad_logprobs = grad_logprobs.reshape(-1).float().contiguous()
    if grad_entropy is not None:
        grad_entropy = grad_entropy.reshape(-1).float().contiguous()
    return grad_logprobs, grad_entropy


def logprob_backward(
    logits: torch.Tensor,  # [n, V_local]
    grad_logits: torch.Tensor,  # [n, V_local] out; may be ``logits`` itself
    target: torch.Tensor,  # [n] int64
    row_max: torch.Tensor,  # [n] fp32
    log_sum: torch.Tensor,  # [n] fp32
    entropy: torch.Tensor | None,  # [n] fp32, or None when no entropy gradient flows
    grad_logprobs: torch.Tensor,  # [n] fp32
    grad_entropy: torch.Tensor | None,  # [n] fp32, or None
    *,
    vocab_start: int,
    ignore_index: int,
    inv_temperature: float,
    threshold: torch.Tensor | None = None,  # [n] fp32 raw-logit threshold of a sampling filter
    grad_scale: torch.Tensor | None = None,  # 0-dim fp32 factor of both upstream gradients
) -> None:
    """Write d(loss)/d(logits) into ``grad_logits`` (one read, one write of the shard); with
    ``threshold`` the columns below it get no gradient; with ``grad_scale`` the upstream gradients are
    ``grad_scale · grad_logprobs`` and ``grad_scale · grad_entropy`` (read on the device)."""
    n, v_local = logits.shape
    if n == 0:
        return
    cfg = logprob_launch_config(v_local)
    has_entropy_grad = grad_entropy is not None
    meta = _backward_meta(cfg, has_entropy_grad, threshold is not None, grad_scale is not None)
    launch_meta(logprob_backward_kernel, (n, ceil_div(v_local, cfg.backward_block_v)), meta,
        logits, grad_logits, target, row_max, log_sum,
        entropy if has_entropy_grad else log_sum,  # unused placeholder pointer without entropy
        grad_logprobs,
        grad_entropy if has_entropy_grad else grad_logprobs,  # unused placeholder pointer
        threshold if threshold is not None else grad_logprobs,  # unused placeholder pointer without a filter
        grad_scale if grad_scale is not None else grad_logprobs,  # unused placeholder pointer without a scale
        v_local, vocab_start, ignore_index,
        logits.stride(0), grad_logits.stride(0),
        inv_temperature,
    )


RADIX_COUNT_BITS = 8
"""Key bits per counting pass of the threshold search (256 digits: ``tl.histogram``, memory-bound)."""
RADIX_MASS_BITS = 4
"""Key bits per mass pass (16 digits: a weighted one-hot sum, ~3 instructions per element per digit)."""
_MODE_COUNT, _MODE_MASS, _MODE_EXACT = 0, 1, 2


def radix_histogram(
    logits: torch.Tensor,  # [n, V_local], last dim contiguous
    tau: torch.Tensor,  # [n] fp32: only columns with logit >= tau count
    prefix: torch.Tensor,  # [n] int32 digits chosen so far
    *,
    shift: int,
    digit_bits: int,
    mass: bool,
    row_max: torch.Tensor | None = None,  # [n] fp32 row maximum over the whole vocabulary (masses)
    inv_temperature: float = 1.0,
    first: bool,
    row_max_out: torch.Tensor | None = None,  # [n] fp32 out: this shard's row maximum
) -> torch.Tensor:
    """``[n, 2**digit_bits]`` histogram of one digit of the logits' key (one read of the shard): int32 counts,
    or with ``mass`` fp32 masses exp((x - M) / T) — summed per digit (``digit_bits = 4``) or, on the last
    pass (``shift == 0``, ``digit_bits = 8``), counts times the exact weight of each digit's value.
    See ``kernels/logprob_filter.py``."""
    n, v_local = logits.shape
    bins = 1 << digit_bits
    exact = mass and digit_bits == RADIX_COUNT_BITS
    hist = torch.empty(n, bins, dtype=torch.float32 if mass else torch.int32, device=logits.device)
    if n == 0:
        return hist
    cfg = logprob_launch_config(v_local)
    one_hot = mass and not exact
    launch(logprob_radix_hist_kernel, (n,),
        logits, tau, prefix, row_max if row_max is not None else tau, hist,
        row_max_out if row_max_out is not None else tau,
        v_local, logits.stride(0), hist.stride(0), inv_temperature, shift,
        KEY_BITS=16 if logits.dtype in (torch.bfloat16, torch.float16) else 32,
        DIGIT_BITS=digit_bits,
        MODE=_MODE_EXACT if exact else (_MODE_MASS if mass else _MODE_COUNT),
        HAS_PREFIX=not first,
        HAS_ROW_MAX_OUT=row_max_out is not None,
        BLOCK_V=cfg.filter_mass_block_v if one_hot else cfg.filter_count_block_v,
        num_warps=cfg.filter_mass_warps if one_hot else cfg.filter_count_warps,
    )
    return hist


def radix_select(
    hist: torch.Tensor,  # [n, 2**digit_bits] TP-summed
    logits: torch.Tensor,  # [n, V_local] (its dtype only)
    prefix: torch.Tensor,  # [n] int32 in/out
    budget: torch.Tensor,  # [n] in/out: int32 k left (top-k) or fp32 p * S (top-p)
    tau: torch.Tensor,  # [n] fp32 in/out
    *,
    digit_bits: int,
    first: bool,
    last: bool,
    above: torch.Tensor | None = None,  # [n] fp32 in/out (top-p)
    top_p: torch.Tensor | None = None,  # [n] fp32 (top-p)
) -> None:
    """Pick each row's digit from the histogram, update the search state in place; on the last pass raise
    ``tau`` to the threshold's logit (one tiny launch, one program per row)."""
    n = hist.shape[0]
    if n == 0:
        return
    is_top_p = top_p is not None
    launch(logprob_radix_select_kernel, (n,),
        hist, logits, prefix, budget, above if is_top_p else tau, top_p if is_top_p else tau, tau,
        n, hist.stride(0),
        KEY_BITS=16 if logits.dtype in (torch.bfloat16, torch.float16) else 32,
        DIGIT_BITS=digit_bits, IS_TOP_P=is_top_p, IS_FIRST=first, IS_LAST=last,
        num_warps=1,
    )
