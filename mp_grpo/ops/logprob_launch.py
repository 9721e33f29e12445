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
    logprob_launch_config,
    logprob_merge_kernel,
    logprob_stats_kernel,
)
from mp_grpo.kernels.launch_config import ceil_div
from mp_grpo.ops.checks import CheckInputs, kernel_counters, merge_error_kinds, raise_on_kernel_errors
from mp_grpo.ops.launcher import LaunchMeta, launch, launch_meta

STATS_WIDTH = 4
"""Columns of the per-row statistics: (max, sum-exp, sum-exp*(z - max), target logit); the sums without the
target's column (``kernels/logprob_stats.py``)."""


@functools.lru_cache(maxsize=256)
def _stats_meta(cfg: LogprobLaunchConfig, with_entropy: bool, has_threshold: bool, has_skip: bool) -> LaunchMeta:
    return LaunchMeta(HAS_ENTROPY=with_entropy, HAS_THRESHOLD=has_threshold, HAS_SKIP=has_skip,
                      BLOCK_V=cfg.stats_block_v, num_warps=cfg.stats_warps)


@functools.lru_cache(maxsize=256)
def _backward_meta(cfg: LogprobLaunchConfig, entropy_grad: bool, has_threshold: bool, grad_scale: bool,
                   row_loop: bool) -> LaunchMeta:
    return LaunchMeta(HAS_ENTROPY_GRAD=entropy_grad, HAS_THRESHOLD=has_threshold, HAS_GRAD_SCALE=grad_scale,
                      ROW_LOOP=row_loop, BLOCK_V=cfg.backward_block_v, num_warps=cfg.backward_warps)


def new_stats_buffer(rows: int, device: torch.device) -> torch.Tensor:
    """``[rows + 1, 4]`` fp32 buffer for :func:`shard_statistics`.

    The extra last row carries this shard's vocabulary size through the same all-gather as the
    statistics, so the merge can check that every TP rank holds a shard of the same size without a
    collective of its own. The statistics kernel writes it.
    """
    return torch.empty(rows + 1, STATS_WIDTH, dtype=torch.float32, device=device)


class StatsBuffer(NamedTuple):
    """A statistics buffer with a payload after its rows, sent by one all-gather (:func:`new_stats_buffer_with`)."""

    buffer: torch.Tensor
    """``[rows + 1 + payload_rows, 4]`` fp32: what :func:`gather_statistics` sends (``payload_rows=``)."""
    stats: torch.Tensor
    """``[rows + 1, 4]``: the statistics and the size row, as :func:`new_stats_buffer` makes them."""
    payload: torch.Tensor
    """``[payload]`` fp32 over the rows after them (the raw logits at the engine's top-K ids)."""
    payload_rows: int


def new_stats_buffer_with(rows: int, payload: int, device: torch.device) -> StatsBuffer:
    """:func:`new_stats_buffer` followed by ``payload`` fp32 values in rows of its own: one buffer, one all-gather."""
    payload_rows = ceil_div(payload, STATS_WIDTH)
    buffer = torch.empty(rows + 1 + payload_rows, STATS_WIDTH, dtype=torch.float32, device=device)
    return StatsBuffer(buffer, buffer[: rows + 1], buffer[rows + 1:].view(-1)[:payload], payload_rows)


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
    skip: torch.Tensor | None = None,  # [n] int8: rows whose statistics are written already (nonzero)
) -> None:
    """Write the statistics of ``logits`` into ``stats[row_start : row_start + n]`` (one read of the
    logits) and the shard size into ``stats[N]``. Chunked callers pass their chunk's ``row_start``.
    With ``threshold`` only the columns whose logit is >= it count (a sampling filter's kept set); rows
    flagged in ``skip`` are neither read nor written."""
    n, v_local = logits.shape
    cfg = logprob_launch_config(v_local)
    meta = _stats_meta(cfg, with_entropy, threshold is not None, skip is not None)
    launch_meta(logprob_stats_kernel, (max(n, 1),), meta,
        logits, target, stats,
        threshold if threshold is not None else stats,  # unused placeholder pointer without a filter
        skip if skip is not None else stats,  # unused placeholder pointer
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
    """[N] fp32 row maximum M of the raw logits over the whole vocabulary (saved for backward)."""
    log_sum: torch.Tensor
    """[N] fp32 log S, S = sum exp((logits - M) / T); logZ = M / T + log S (saved for backward)."""
    complement: torch.Tensor
    """[N] fp32 1 - p_t, the other tokens' mass summed apart (saved for backward: the target's own gradient)."""
    centered: torch.Tensor
    """[N] fp32 log p_t + H, from the other tokens' sums (saved for backward: the target's own entropy gradient);
    empty (0 rows) when the merge was asked for no entropy."""
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
    inv_temperature: float,
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
    complement = torch.empty(n, dtype=torch.float32, device=device)
    centered = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=device)
    block_n = logprob_launch_config(v_local).merge_block_n
    launch(logprob_merge_kernel, (max(ceil_div(n, block_n), 1),),
        stats, target, logprobs, entropy, row_max, log_sum, complement, centered, errors,
        n, tp, tp * v_local, ignore_index,
        stats.stride(0), stats.stride(1),
        inv_temperature,
        HAS_ENTROPY=with_entropy,
        BLOCK_N=block_n,
    )
    return Merged(logprobs, entropy, row_max, log_sum, complement, centered, errors)


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
    payload: torch.Tensor | None = None
    """[TP, payload_rows * 4] fp32: every rank's payload rows (:class:`StatsBuffer`), when sent."""


def gather_statistics(
    stats: torch.Tensor,  # [N + 1, 4] fp32, filled by shard_statistics (+ payload_rows: a StatsBuffer's buffer)
    *,
    tp_group: ProcessGroup | None,
    v_local: int,
    ignore_index: int,
    check_inputs: CheckInputs,
    payload_rows: int = 0,
) -> Gathered:
    """Forward step 2 of both log-prob ops: the one all-gather of the statistics over ``tp_group`` (with the last
    ``payload_rows`` rows of ``stats`` a payload that travels with them: :class:`StatsBuffer`), and the error
    counters the merge will add into."""
    everything = all_gather_stacked(stats, tp_group)
    rows = everything.shape[1] - payload_rows
    gathered = everything[:, :rows]
    payload = everything[:, rows:].reshape(everything.shape[0], -1) if payload_rows else None
    kinds = merge_error_kinds(v_global=gathered.shape[0] * v_local, ignore_index=ignore_index, gathered_stats=gathered)
    # Deferred (GPU): the kernel adds into the ledger's own counters — nothing else to launch or read.
    errors, deferred = kernel_counters(kinds, stats.device, check_inputs)
    return Gathered(gathered, errors, kinds, deferred, payload)


def raise_on_merge_errors(gathered: Gathered, check_inputs: CheckInputs) -> None:
    """After the merge: raise at the call unless the counts were deferred (or nothing is checked)."""
    if not gathered.deferred and check_inputs is not CheckInputs.OFF:
        raise_on_kernel_errors(gathered.errors, gathered.kinds, check_inputs)


def gather_and_merge(
    stats: torch.Tensor,  # [N + 1, 4] fp32, filled by shard_statistics (+ payload_rows: a StatsBuffer's buffer)
    target: torch.Tensor,  # [N] int64
    *,
    tp_group: ProcessGroup | None,
    v_local: int,
    ignore_index: int,
    inv_temperature: float,
    with_entropy: bool,
    check_inputs: CheckInputs,
    payload_rows: int = 0,
) -> tuple[Merged, Gathered]:
    """Forward steps 2–3 of the log-prob ops: the one all-gather of the statistics over ``tp_group``, the merge, and
    the merge's error counts to the ledger (``check_inputs``; no host read unless SYNC). Returns the merge and what was
    gathered (the statistics of every rank and, with ``payload_rows``, the payloads that travelled with them)."""
    gathered = gather_statistics(stats, tp_group=tp_group, v_local=v_local, ignore_index=ignore_index,
                                 check_inputs=check_inputs, payload_rows=payload_rows)
    merged = merge_statistics(gathered.stats, target, v_local=v_local, ignore_index=ignore_index,
                              inv_temperature=inv_temperature, with_entropy=with_entropy, errors=gathered.errors)
    raise_on_merge_errors(gathered, check_inputs)
    return merged, gathered


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


def narrowed_in_place(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[n, V_local]`` of ``dtype`` over the front of each row of the contiguous ``logits`` (a wider dtype): where
    :func:`logprob_backward` writes the gradient of fp32 logits in the operands' bf16 / fp16 without a second
    buffer (row stride ``2·V_local``, a layout cuBLAS reads as it is)."""
    n, v_local = logits.shape
    ratio = logits.element_size() // torch.empty((), dtype=dtype).element_size()
    return logits.view(dtype).view(n, ratio * v_local)[:, :v_local]


def logprob_backward(
    logits: torch.Tensor,  # [n, V_local]
    grad_logits: torch.Tensor,  # [n, V_local] out; may be ``logits`` itself, or narrowed_in_place(logits, ...)
    target: torch.Tensor,  # [n] int64
    row_max: torch.Tensor,  # [n] fp32
    log_sum: torch.Tensor,  # [n] fp32
    complement: torch.Tensor,  # [n] fp32 1 - p_t (Merged.complement)
    entropy: torch.Tensor | None,  # [n] fp32 H (Merged.entropy), read only with ``grad_entropy``
    centered: torch.Tensor | None,  # [n] fp32 log p_t + H (Merged.centered), read only with ``grad_entropy``
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
    ``grad_scale · grad_logprobs`` and ``grad_scale · grad_entropy`` (read on the device).

    ``grad_logits`` is a buffer of its own, ``logits`` itself (in place), or :func:`narrowed_in_place` of
    ``logits`` (a narrower dtype over the same rows): then one program walks each row's column blocks in order
    (the kernel's ROW_LOOP), so that no gradient overwrites a logit before it is read."""
    n, v_local = logits.shape
    if n == 0:
        return
    cfg = logprob_launch_config(v_local)
    has_entropy_grad = grad_entropy is not None
    row_loop = grad_logits.dtype != logits.dtype and grad_logits.data_ptr() == logits.data_ptr()
    meta = _backward_meta(cfg, has_entropy_grad, threshold is not None, grad_scale is not None, row_loop)
    grid = (n, 1) if row_loop else (n, ceil_div(v_local, cfg.backward_block_v))
    launch_meta(logprob_backward_kernel, grid, meta,
        logits, grad_logits, target, row_max, log_sum, complement,
        centered if has_entropy_grad else log_sum,  # unused placeholder pointer without entropy
        entropy if has_entropy_grad else log_sum,  # unused placeholder pointer without entropy
        grad_logprobs,
        grad_entropy if has_entropy_grad else grad_logprobs,  # unused placeholder pointer
        threshold if threshold is not None else grad_logprobs,  # unused placeholder pointer without a filter
        grad_scale if grad_scale is not None else grad_logprobs,  # unused placeholder pointer without a scale
        v_local, vocab_start, ignore_index,
        logits.stride(0), grad_logits.stride(0),
        inv_temperature,
    )
