"""The trainer's log-probs at the rollout engine's top-K ids of every token, taken in the log-prob ops' own forward.

What a top-K divergence between the trainer's policy and the engine's needs (DPPO's top-K TV / KL, TRL #5117:
``_compute_divergence_mask`` reads them under ``no_grad``): for each token the trainer's log-probs at the ids the
engine reported its top-K log-probs for, ``[nnz]`` fp32 aligned with the CSR of those ids
(:class:`~mp_grpo.ops.token_ids.TokenIds`). Normalized over the whole vocabulary, or over what the op restricts the
distribution to — a sampling filter's kept set or a captured support (-inf at an id outside it). Not
differentiable (a decision's input, as every peer uses them).

Schedule, inside :func:`mp_grpo.vocab_parallel_logprobs_with_top_k`, :func:`mp_grpo.fused_linear_logprobs_with_top_k`
and ``fused_linear_loss(..., top_k_ids=)`` (``kernels/logprob_at_ids.py``)

    1. :func:`gather_logits_at_ids`, right after a row block's statistics (a fused op's logits chunk is still
       logits): this shard's raw logit at each id it owns into a ``[nnz]`` fp32 payload, 0 at the others'.
    2. The payload rides in the statistics' all-gather (``logprob_launch.StatsBuffer``: rows after the statistics)
       — **no collective of its own**: ``4 · nnz`` bytes more per rank in it (K = 20 at N = 16384: 1.25 MiB). In
       ``fused_linear_loss`` that all-gather is per row chunk and carries the whole payload each time (the chunk's
       entries are a range of it that only the device knows): chunks × TP × 4 · nnz bytes received.
    3. :func:`logprobs_at_ids`: each entry's logit from the payload of the rank that owns the id and the row's
       (M, log S) merged from the gathered statistics.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from mp_grpo.kernels.launch_config import LogprobLaunchConfig, logprob_launch_config
from mp_grpo.kernels.logprob_at_ids import logprob_at_ids_kernel, logprob_gather_ids_kernel
from mp_grpo.ops.launcher import LaunchMeta, launch_meta
from mp_grpo.ops.logprob_launch import Gathered, Merged
from mp_grpo.ops.token_ids import CapturedSupport, TokenIds


class TokenLogprobs(NamedTuple):
    """What the ``*_with_top_k`` ops return."""

    logprobs: torch.Tensor
    """``target.shape`` fp32 log-probs of the targets (differentiable), as the op without top-K returns them."""
    entropy: torch.Tensor | None
    """``target.shape`` fp32 entropy (differentiable) with ``with_entropy=True``, else None."""
    top_k: torch.Tensor
    """``[nnz]`` fp32 log-probs at ``top_k_ids.ids`` (aligned with them; not differentiable); -inf at an id outside
    the op's kept set or support."""


@functools.lru_cache(maxsize=64)
def _gather_meta(cfg: LogprobLaunchConfig, has_threshold: bool, has_support: bool) -> LaunchMeta:
    return LaunchMeta(HAS_THRESHOLD=has_threshold, HAS_SUPPORT=has_support, BLOCK_K=cfg.ids_block_k,
                      BLOCK_S=cfg.ids_block_s, num_warps=cfg.ids_warps)


@functools.lru_cache(maxsize=64)
def _at_ids_meta(cfg: LogprobLaunchConfig) -> LaunchMeta:
    return LaunchMeta(BLOCK_K=cfg.ids_block_k, num_warps=cfg.ids_warps)


def gather_logits_at_ids(
    x: torch.Tensor,  # [n, V_local] logits shard
    payload: torch.Tensor,  # [nnz] fp32 out (StatsBuffer.payload)
    top_k_ids: TokenIds,
    *,
    csr_row_start: int = 0,  # the CSR row of x's first row
    vocab_start: int,
    threshold: torch.Tensor | None = None,  # [n] fp32 a sampling filter's thresholds
    support: CapturedSupport | None = None,  # the op's captured support (CSR over the same tokens)
) -> None:
    """Step 1 for the rows of ``x``: the raw logit of each id of theirs this shard owns into ``payload`` (-inf outside
    the kept set or the support; 0 at the ids of other shards)."""
    n, v_local = x.shape
    if n == 0:
        return
    cfg = logprob_launch_config(v_local)
    placeholder = top_k_ids.indptr  # unused pointers
    launch_meta(logprob_gather_ids_kernel, (n,), _gather_meta(cfg, threshold is not None, support is not None),
        x, top_k_ids.indptr, top_k_ids.ids, payload,
        threshold if threshold is not None else payload,
        support.indptr if support is not None else placeholder,
        support.ids if support is not None else placeholder,
        csr_row_start, top_k_ids.nnz, support.nnz if support is not None else 0, v_local, vocab_start,
        x.stride(0),
    )


def logprobs_at_ids(
    gathered: Gathered,  # the all-gathered statistics of the rows, with the payload (gather_statistics)
    target: torch.Tensor,  # [n] int64 the rows' targets
    top_k_ids: TokenIds,
    out: torch.Tensor,  # [nnz] fp32: the rows' entries are written
    *,
    csr_row_start: int = 0,  # the CSR row of the statistics' first row
    v_local: int,
    ignore_index: int,
    inv_temperature: float,
) -> None:
    """Step 3 for the rows of ``gathered``: their entries of ``out``."""
    stats, payload = gathered.stats, gathered.payload
    tp, rows_plus_one, _ = stats.shape
    n = rows_plus_one - 1
    if n == 0:
        return
    launch_meta(logprob_at_ids_kernel, (n,), _at_ids_meta(logprob_launch_config(v_local)),
        stats, target, payload, top_k_ids.indptr, top_k_ids.ids, out,
        n, tp, v_local, ignore_index, csr_row_start, top_k_ids.nnz,
        stats.stride(0), stats.stride(1), payload.stride(0),
        inv_temperature,
    )


def top_k_outputs(
    ctx,
    merged: Merged,
    gathered: Gathered,
    target: torch.Tensor,  # [N] int64
    top_k_ids: TokenIds,
    target_shape: torch.Size,
    *,
    v_local: int,
    ignore_index: int,
    inv_temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The log-prob ops' outputs with ``top_k_ids`` (their forward's last step): ``(logprobs, entropy — an empty
    placeholder without ``with_entropy`` —, top_k)``, step 3 run here, ``top_k`` and a placeholder marked
    non-differentiable on the autograd ``ctx``."""
    top_k = torch.empty(top_k_ids.nnz, dtype=torch.float32, device=target.device)
    logprobs_at_ids(gathered, target, top_k_ids, top_k, v_local=v_local, ignore_index=ignore_index,
                    inv_temperature=inv_temperature)
    entropy = merged.entropy.view(target_shape) if with_entropy else merged.entropy
    ctx.mark_non_differentiable(top_k, *(() if with_entropy else (entropy,)))
    return merged.logprobs.view(target_shape), entropy, top_k
