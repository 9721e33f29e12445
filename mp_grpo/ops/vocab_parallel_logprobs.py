"""Log-probabilities (and entropy) of sampled tokens from a vocabulary sharded over TP ranks.

Schedule of :class:`VocabParallelLogProbs` (``N`` rows, ``V_local`` columns on each of ``TP`` ranks)

Forward
    0. Only with a ``sampling_filter`` (``ops/sampling_filter.py``, ``filtered_statistics``): the filter is
       reduced to one raw-logit threshold per row, and steps 1–3 and backward count only the kept columns
       (logit >= threshold): the filtered, renormalized distribution. A read of the shard keeps each group's
       maximum, a small kernel a row re-reads the chosen groups for the row's largest logits (the candidates);
       one all-gather of them over ``tp_group`` and a select kernel give the threshold and the statistics of
       the rows they decide (a trained policy's rows: all of top-k <= 128, top-p where the candidates hold >= p
       of the mass); the other rows take the exact radix passes (one read of the shard and one all-reduce each)
       and step 1 with the threshold, for those rows only.
    1. ``logprob_stats_kernel``: one pass over this rank's shard writes per-row (max, sum-exp,
       sum-exp·z, target logit), the sums without the target's column — 16 bytes a row; the logits are read
       once.
    2. One collective: all-gather of the ``[N + 1, 4]`` fp32 statistics over ``tp_group`` (skipped
       for a group of size 1). Row N carries this shard's size, so shard sizes are checked without a
       collective of their own.
    3. ``logprob_merge_kernel``: merge the TP shards' statistics into log-prob, entropy, logZ (as M and
       log S), and the target's 1 - p_t and log p_t + H from the other tokens' sums (no cancellation near
       p_t = 1) per row; count bad targets and shard-size mismatches (their outputs are NaN); with
       ``check_inputs`` the counts go to the deferred error ledger (``mp_grpo.ops.checks``): raised at once on
       the CPU, at the next ``mp_grpo.check_errors()`` on a GPU — no host read here.
    Saved for backward: the logits (not a copy), targets, M, log S, 1 - p_t, the entropy and log p_t + H —
    28 bytes a row beyond the logits, no ``[N, V]`` fp32 buffer (with a filter also the threshold and the
    outside-the-kept-set mask, 5 bytes a row).

Backward
    1. ``logprob_backward_kernel``: one pass reads the shard once and writes its gradient once, in
       the logits' dtype (into the logits buffer itself with ``inplace_backward=True``). logZ and
       the entropy already describe the whole vocabulary, so no collective is needed.
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from mp_grpo.collectives import ProcessGroup, group_rank, group_size
from mp_grpo.ops.checks import (
    CheckInputs,
    check_inputs_mode,
    check_logits_and_target,
    check_runs_here,
    check_temperature,
)
from mp_grpo.ops.sampling_filter import (
    SamplingFilter,
    check_sampling_filter,
    filtered_statistics,
    targets_outside_filter,
)
from mp_grpo.ops.logprob_launch import (
    flat_upstream_grads,
    gather_and_merge,
    logprob_backward,
    new_stats_buffer,
    shard_statistics,
)


class VocabParallelLogProbs(torch.autograd.Function):
    """Differentiable w.r.t. ``logits``; see the module docstring for the schedule."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,  # [..., V_local]
        target: torch.Tensor,  # [...]
        tp_group: ProcessGroup | None,
        inv_temperature: float,
        with_entropy: bool,
        ignore_index: int,
        inplace_backward: bool,
        check_inputs: CheckInputs,
        sampling_filter: SamplingFilter | None,
    ):
        ctx.set_materialize_grads(False)
        v_local = logits.shape[-1]
        x = logits.reshape(-1, v_local)  # a view whenever the leading dims allow one
        if x.stride(-1) != 1:
            x = x.contiguous()
        t = target.reshape(-1).to(torch.int64).contiguous()  # the kernels read targets densely
        n = x.shape[0]
        vocab_start = group_rank(tp_group) * v_local

        # --- 0.–1. statistics of this rank's shard (one read of the logits); with a filter, of its kept set ---
        stats = new_stats_buffer(n, x.device)
        threshold = None
        if sampling_filter is None:
            shard_statistics(x, t, stats, vocab_start=vocab_start, inv_temperature=inv_temperature,
                             with_entropy=with_entropy)
        else:
            threshold = filtered_statistics(x, t, stats, sampling_filter, target.shape, tp_group=tp_group,
                                            inv_temperature=inv_temperature, with_entropy=with_entropy)

        # --- 2.–3. the one collective (all-gather of the [N + 1, 4] statistics) and the merge into
        #          log-prob, entropy, logZ = M + log S; raise on bad input ---
        merged = gather_and_merge(
            stats, t, tp_group=tp_group, v_local=v_local, ignore_index=ignore_index, inv_temperature=inv_temperature,
            with_entropy=with_entropy, check_inputs=check_inputs,
        )

        outside = None
        if threshold is not None:
            # A target outside the kept set has log-prob -inf (its stats row wrote z_t = -inf).
            outside = targets_outside_filter(merged.logprobs, t, ignore_index, check_inputs)
        ctx.save_for_backward(x, t, merged.row_max, merged.log_sum, merged.complement, merged.entropy,
                              merged.centered, threshold, outside)
        ctx.logits_shape = logits.shape
        ctx.vocab_start = vocab_start
        ctx.inv_temperature = inv_temperature
        ctx.ignore_index = ignore_index
        ctx.inplace_backward = inplace_backward
        logprobs = merged.logprobs.view(target.shape)
        if with_entropy:
            return logprobs, merged.entropy.view(target.shape)
        return logprobs

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None = None):
        x, t, row_max, log_sum, complement, entropy, centered, threshold, outside = ctx.saved_tensors
        if grad_logprobs is None and grad_entropy is None:
            return (None,) * 9
        grad_logprobs, grad_entropy = flat_upstream_grads(grad_logprobs, grad_entropy, row_max.shape[0], row_max.device)
        if outside is not None:
            # The log-prob of a target outside the kept set is the constant -inf: no gradient from it.
            grad_logprobs = torch.where(outside, 0.0, grad_logprobs)

        # --- 1. one pass: recompute p from the logits and logZ, write the gradient ---
        grad_x = x if ctx.inplace_backward else torch.empty_like(x)
        logprob_backward(
            x, grad_x, t, row_max, log_sum, complement, entropy, centered,
            grad_logprobs, grad_entropy,
            vocab_start=ctx.vocab_start, ignore_index=ctx.ignore_index, inv_temperature=ctx.inv_temperature,
            threshold=threshold,
        )
        return grad_x.view(ctx.logits_shape), None, None, None, None, None, None, None, None


@overload
def vocab_parallel_logprobs(
    logits: torch.Tensor, target: torch.Tensor, *, tp_group: ProcessGroup | None = ..., temperature: float = ...,
    with_entropy: Literal[False] = ..., ignore_index: int = ..., inplace_backward: bool = ...,
    check_inputs: CheckInputs | bool = ..., sampling_filter: SamplingFilter | None = ...,
) -> torch.Tensor: ...
@overload
def vocab_parallel_logprobs(
    logits: torch.Tensor, target: torch.Tensor, *, tp_group: ProcessGroup | None = ..., temperature: float = ...,
    with_entropy: Literal[True], ignore_index: int = ..., inplace_backward: bool = ...,
    check_inputs: CheckInputs | bool = ..., sampling_filter: SamplingFilter | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: ProcessGroup | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    ignore_index: int = -100,
    inplace_backward: bool = False,
    check_inputs: CheckInputs | bool = CheckInputs.DEFERRED,
    sampling_filter: SamplingFilter | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(logits / temperature)[target]`` over the whole vocabulary, shape ``target.shape``.

    Args:
        logits: ``[..., V_local]`` fp32 / bf16 / fp16 — this rank's contiguous vocabulary shard; rank
            r of ``tp_group`` owns global ids ``[r * V_local, (r + 1) * V_local)`` (Megatron's layout).
            Any leading shape (``[S, B]``, ``[B, S]``, ``[N]``); non-contiguous inputs are handled
            (copied when the leading dims cannot be flattened into a view).
        target: ``[...]`` integer global token ids, ``logits.shape[:-1]``.
        tp_group: the tensor-parallel process group; ``None`` means no tensor parallelism.
        temperature: logits are divided by it inside the kernels (no extra pass).
        with_entropy: also return the entropy of the whole distribution (differentiable).
        ignore_index: rows with this target get log-prob 0 and no gradient from it (their entropy is
            still computed).
        inplace_backward: write the gradient into the logits buffer, saving one ``[N, V_local]``
            allocation. The logits are overwritten during backward: use it only when nothing else
            reads them afterwards (for example the output of the model's last linear layer).
        check_inputs: a :class:`~mp_grpo.ops.checks.CheckInputs` (``True``: ``DEFERRED``, the default;
            ``False``: ``OFF``). ``DEFERRED`` raises ``ValueError`` on a target outside ``[0, V_global)``
            (other than ``ignore_index``) or on shards of unequal size across ``tp_group`` — at once on
            the CPU; on a GPU the kernel's error counters are added on the device without a host read
            (the call stays CUDA-graph capturable) and the error is raised at the next sync point
            (``mp_grpo.check_errors()``, which ``reduce_metrics`` and ``GlobalBatch.skip_step`` call;
            see ``mp_grpo.ops.checks``). ``SYNC`` raises at the call (one host read). ``OFF`` records
            nothing. Bad input is never silently wrong: a bad target's log-prob is NaN, and unequal
            shards make every output NaN.

        sampling_filter: replay the rollout's ``SamplingFilter(top_k=, top_p=, min_p=)`` (vLLM's
            convention, ties at the threshold kept; ``ops/sampling_filter.py``): the log-probs, entropy
            and gradient are those of the filtered, renormalized distribution. A target outside the
            kept set raises ``ValueError`` with ``check_inputs`` (deferred like the other checks: no
            host read on a GPU); otherwise its
            log-prob is -inf and no gradient flows from it — count them with
            ``mp_grpo.ops.sampling_filter.count_outside_filter(logprobs, target, ignore_index)``.
            Collectives added: see the module docstring (step 0).

    Returns:
        fp32 log-probs ``[...]``; with ``with_entropy=True`` the pair ``(logprobs, entropy)``. The
        return type follows the literal value of ``with_entropy`` (see the overloads).

    One all-gather of a ``[N + 1, 4]`` fp32 tensor per call (plus the filter's, module docstring step 0).

    Batch invariance: a row's log-prob, entropy and gradient are bitwise identical whatever the number
    of rows, their position and the leading shape (docs/kernel.md, "Batch invariance").
    """
    check_logits_and_target(logits, target)
    check_runs_here(logits, "logits")
    inv_temperature = check_temperature(temperature)
    check_inputs = check_inputs_mode(check_inputs)
    if sampling_filter is not None:
        check_sampling_filter(
            sampling_filter, target.shape, logits.device, check_tensors=check_inputs is not CheckInputs.OFF
        )
    return vocab_parallel_logprobs_unchecked(
        logits, target, tp_group=tp_group, inv_temperature=inv_temperature, with_entropy=bool(with_entropy),
        ignore_index=int(ignore_index), inplace_backward=bool(inplace_backward), check_inputs=check_inputs,
        sampling_filter=sampling_filter,
    )


def vocab_parallel_logprobs_unchecked(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: ProcessGroup | None,
    inv_temperature: float,
    with_entropy: bool,
    ignore_index: int,
    inplace_backward: bool,
    check_inputs: CheckInputs,
    sampling_filter: SamplingFilter | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`vocab_parallel_logprobs` without its argument checks, for a caller that made them once at its own
    boundary (``GRPOLoss.on_logits``, ``MegatronGRPO.loss_func``): ``logits`` and ``target`` as
    :func:`~mp_grpo.ops.checks.check_logits_and_target` and :func:`~mp_grpo.ops.checks.check_runs_here` accept
    them, ``inv_temperature`` from :func:`~mp_grpo.ops.checks.check_temperature`, ``check_inputs`` a
    :class:`CheckInputs`, ``sampling_filter`` passed by :func:`check_sampling_filter` for ``target``. What only
    the device sees (``check_inputs``) is still counted here."""
    if sampling_filter is not None:
        # Fields that keep everything (top_p = 1, top_k >= V, min_p = 0) cost nothing.
        sampling_filter = sampling_filter.without_noops(logits.shape[-1] * group_size(tp_group))
    return VocabParallelLogProbs.apply(
        logits, target, tp_group, inv_temperature, with_entropy, ignore_index, inplace_backward, check_inputs,
        sampling_filter,
    )
