"""Replay of the rollout engine's captured support: each token's log-prob, entropy and gradient of its distribution
renormalized over the ids the engine sampled it from (:class:`~mp_grpo.ops.token_ids.CapturedSupport`), on
vocab-parallel logits, without a ``[tokens, V]`` mask or tensor.

Why a captured support rather than the recomputed filter (``ops/sampling_filter.py``): the engine's kept set is
what it sampled from; a filter recomputed from the trainer's logits puts the boundary where the trainer's numerics
put it, and a token near it can fall on the other side (``docs/mismatch.md`` (e), (f), (h)). vLLM returns the
support (#49577, ``SamplingMask``), sglang the exact final one (#36630), and prime-rl (#3431, capped at 512 ids),
SkyRL and miles replay it; miles (#2200) builds a boolean ``[T, V / TP]`` mask for it, here each shard gathers the
logits at the support's ids it owns.

Schedule (``N`` rows, ``V_local`` columns on each of ``TP`` ranks; a row with no ids has no support)

Forward — :func:`support_statistics`, in place of the statistics' read of ``logprob_launch.shard_statistics``
    1. ``logprob_support_stats_kernel`` (one program a row): this shard's logits at the support's ids (a gather of
       at most the support's size), the statistics (m, s, u, x_t) of the support's columns in the exact form of
       the unrestricted kernel; x_t = -inf where the target is not in its support; a flag per row with a support.
    2. ``logprob_stats_kernel`` with ``HAS_SKIP`` for the rows without a support (the whole shard, as unrestricted;
       the support rows are skipped: no read).
    Then the ops' one all-gather of the ``[N + 1, 4]`` statistics and the merge, unchanged — no collective of its
    own. Every TP rank receives the same (global) ids and takes those of its shard.

Backward — :func:`support_backward`, in place of ``logprob_launch.logprob_backward``
    1. ``logprob_support_grad_kernel``: the gradient at this shard's support ids into a ``[nnz]`` buffer (the
       logits read first: the gradient may overwrite them, ``inplace_backward``).
    2. ``logprob_backward_kernel`` for every row, the support rows with no column kept (threshold NaN: no logit
       compares ``>=`` it, a NaN or +inf one outside the support included) and no log-prob gradient: their rows
       are written 0.
    3. ``logprob_support_scatter_kernel``: the buffered gradient written at the support's columns.
    No collective.

Checks: :func:`check_captured_support` on the host (type, one row per token, device; a ``sampling_filter`` beside
it is refused); the CSR's values on the device (``token_ids.record_token_ids_errors``); a target outside its support
through :func:`targets_outside_support` (ledger, with the first such token's index).

Not read: the logits outside a row's support — a NaN or +inf logit there is neither reported nor able to reach the
row's results or gradient (0 there); inside the support it makes the row non-finite and is reported as for the
unrestricted op.
"""

from __future__ import annotations

import functools

import torch

from mp_grpo.kernels.launch_config import LogprobLaunchConfig, logprob_launch_config
from mp_grpo.kernels.logprob_support import (
    logprob_support_grad_kernel,
    logprob_support_scatter_kernel,
    logprob_support_stats_kernel,
)
from mp_grpo.ops.checks import CheckInputs, record_flagged
from mp_grpo.ops.launcher import LaunchMeta, launch_meta
from mp_grpo.ops.logprob_launch import logprob_backward, shard_statistics
from mp_grpo.ops.sampling_filter import SamplingFilter, check_sampling_filter
from mp_grpo.ops.token_ids import CapturedSupport, check_token_ids

NO_COLUMN = float("nan")
"""The unrestricted backward kernel's threshold for a support row: ``x >= NaN`` is false for every logit (a NaN or
+inf one too), so the row keeps no column there and is written 0; the support's columns come from step 3."""


def check_captured_support(support: CapturedSupport, target_shape: torch.Size, device: torch.device,
                           sampling_filter: object | None) -> None:
    """Host checks of ``captured_support`` for ``target``: its type, one CSR row per token, its device; refused beside
    a ``sampling_filter``. Its values are checked on the device by the op (``check_inputs``)."""
    check_token_ids(support, "captured_support", target_shape, device, CapturedSupport)
    if sampling_filter is not None:
        raise ValueError(
            "captured_support and sampling_filter: pass one. The captured support is the set the engine's filter "
            "kept when it sampled each token; replaying the filter as well would intersect it with the set the "
            "trainer's own logits keep, a distribution no engine samples from (vLLM, sglang, prime-rl, SkyRL and "
            "miles replay the support alone)")


def check_replay(sampling_filter: SamplingFilter | None, captured_support: CapturedSupport | None,
                 target_shape: torch.Size, device: torch.device, check_inputs: CheckInputs) -> None:
    """The ops' host checks of what restricts the distribution: a ``sampling_filter``
    (``sampling_filter.check_sampling_filter``; its tensors' values too, unless ``check_inputs`` is OFF) or a
    ``captured_support`` (:func:`check_captured_support`), not both."""
    if sampling_filter is not None:
        check_sampling_filter(sampling_filter, target_shape, device, check_tensors=check_inputs is not CheckInputs.OFF)
    if captured_support is not None:
        check_captured_support(captured_support, target_shape, device, sampling_filter)


@functools.lru_cache(maxsize=64)
def _stats_meta(cfg: LogprobLaunchConfig, with_entropy: bool) -> LaunchMeta:
    return LaunchMeta(HAS_ENTROPY=with_entropy, BLOCK_K=cfg.support_block_k, num_warps=cfg.support_warps)


@functools.lru_cache(maxsize=64)
def _grad_meta(cfg: LogprobLaunchConfig, entropy_grad: bool, grad_scale: bool) -> LaunchMeta:
    return LaunchMeta(HAS_ENTROPY_GRAD=entropy_grad, HAS_GRAD_SCALE=grad_scale, BLOCK_K=cfg.support_block_k,
                      num_warps=cfg.support_warps)


@functools.lru_cache(maxsize=64)
def _scatter_meta(cfg: LogprobLaunchConfig) -> LaunchMeta:
    return LaunchMeta(BLOCK_K=cfg.support_block_k, num_warps=cfg.support_warps)


def support_statistics(
    x: torch.Tensor,  # [n, V_local] logits shard, last dim contiguous
    target: torch.Tensor,  # [n] int64
    stats: torch.Tensor,  # [N + 1, 4] fp32 from new_stats_buffer(N)
    support: CapturedSupport,  # CSR over the op's N tokens
    *,
    row_start: int = 0,  # the stats row of x's first row
    csr_row_start: int = 0,  # the support's CSR row of x's first row
    vocab_start: int,
    inv_temperature: float,
    with_entropy: bool,
) -> torch.Tensor:
    """Forward steps 1–2: the statistics of ``x`` into ``stats[row_start : row_start + n]`` — over each row's
    support where it has one, over the whole shard where not — and the shard size into ``stats[N]``. Returns the
    ``[n]`` int8 flags of the rows with a support (saved for backward)."""
    n, v_local = x.shape
    has_support = torch.empty(n, dtype=torch.int8, device=x.device)
    if n > 0:
        cfg = logprob_launch_config(v_local)
        launch_meta(logprob_support_stats_kernel, (n,), _stats_meta(cfg, with_entropy),
            x, target, support.indptr, support.ids, stats, has_support,
            csr_row_start, row_start, support.nnz, v_local, vocab_start,
            x.stride(0), stats.stride(0),
            inv_temperature,
        )
    # --- 2. the rows without a support: the whole shard (also writes the size row, with no rows at all) ---
    shard_statistics(x, target, stats, row_start=row_start, vocab_start=vocab_start, inv_temperature=inv_temperature,
                     with_entropy=with_entropy, skip=has_support)
    return has_support


def support_backward(
    x: torch.Tensor,  # [n, V_local]
    grad_x: torch.Tensor,  # [n, V_local] out; may be x itself or logprob_launch.narrowed_in_place(x, ...)
    target: torch.Tensor,  # [n] int64
    row_max: torch.Tensor,  # [n] fp32
    log_sum: torch.Tensor,  # [n] fp32
    complement: torch.Tensor,  # [n] fp32
    entropy: torch.Tensor | None,  # [n] fp32 (read with grad_entropy)
    centered: torch.Tensor | None,  # [n] fp32 (read with grad_entropy)
    grad_logprobs: torch.Tensor,  # [n] fp32
    grad_entropy: torch.Tensor | None,  # [n] fp32, or None
    support: CapturedSupport,
    has_support: torch.Tensor,  # [n] int8 from support_statistics
    *,
    csr_row_start: int = 0,  # the support's CSR row of x's first row
    vocab_start: int,
    ignore_index: int,
    inv_temperature: float,
    grad_scale: torch.Tensor | None = None,  # 0-dim fp32 factor of both upstream gradients
) -> None:
    """Backward steps 1–3: d(loss)/d(logits) into ``grad_x`` (arguments as ``logprob_launch.logprob_backward``'s),
    each support row's gradient at its support's columns and 0 elsewhere, the other rows as unrestricted."""
    n, v_local = x.shape
    if n == 0:
        return
    cfg = logprob_launch_config(v_local)
    has_entropy_grad = grad_entropy is not None
    placeholder = grad_logprobs  # unused pointers
    # --- 1. the gradient at this shard's support ids, read before step 2 may overwrite the logits ---
    values = torch.empty(support.nnz, dtype=grad_x.dtype, device=x.device)
    launch_meta(logprob_support_grad_kernel, (n,), _grad_meta(cfg, has_entropy_grad, grad_scale is not None),
        x, values, target, support.indptr, support.ids, row_max, log_sum, complement,
        centered if has_entropy_grad else placeholder, entropy if has_entropy_grad else placeholder,
        grad_logprobs, grad_entropy if has_entropy_grad else placeholder,
        grad_scale if grad_scale is not None else placeholder,
        csr_row_start, support.nnz, v_local, vocab_start, ignore_index,
        x.stride(0),
        inv_temperature,
    )
    # --- 2. every row as unrestricted; a support row keeps no column and no log-prob gradient: written 0 ---
    rows_with = has_support.bool()
    threshold = torch.where(rows_with, NO_COLUMN, float("-inf"))
    logprob_backward(x, grad_x, target, row_max, log_sum, complement, entropy, centered,
                     torch.where(rows_with, 0.0, grad_logprobs), grad_entropy, vocab_start=vocab_start,
                     ignore_index=ignore_index, inv_temperature=inv_temperature, threshold=threshold,
                     grad_scale=grad_scale)
    # --- 3. the support's columns ---
    launch_meta(logprob_support_scatter_kernel, (n,), _scatter_meta(cfg),
        values, grad_x, support.indptr, support.ids,
        csr_row_start, support.nnz, v_local, vocab_start,
        grad_x.stride(0),
    )


def targets_outside_support(
    logprobs: torch.Tensor, target: torch.Tensor, ignore_index: int, mode: CheckInputs
) -> torch.Tensor:
    """Bool mask of the rows whose target lies outside its captured support (the op gave them log-prob -inf;
    ``ignore_index`` rows excluded); ``logprobs`` as ``sampling_filter.targets_outside_filter`` takes them. Unless
    ``mode`` is OFF their count and the first one's index go through the deferred error ledger
    (``mp_grpo.ops.checks.record_flagged``): raised at once on the CPU or with SYNC, at the next
    ``mp_grpo.check_errors()`` on a GPU — no host read here."""
    outside = torch.isneginf(logprobs) & (target != ignore_index)
    if mode is CheckInputs.OFF:
        return outside

    def message(count: int, first: int) -> str:
        return (
            f"target: {count} token(s) lie outside their captured_support (probability 0 under the distribution "
            f"renormalized over it); the first is token {first} (flattened index into target: its support is "
            f"captured_support.ids[indptr[{first}]:indptr[{first + 1}]]). Check that the support is aligned with the "
            f"tokens (token i's support holds the token sampled at i), or pass check_inputs=False to get log-prob -inf "
            f"and no gradient for them"
        )

    record_flagged("target outside the captured support", outside, message, mode=mode)
    return outside
