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
       Or with a ``captured_support`` (``ops/captured_support.py``, ``support_statistics``): the statistics of
       each row's support, a gather of this shard's logits at the support's ids (the rows without one: step 1);
       no collective of its own.
    1. ``logprob_stats_kernel``: one pass over this rank's shard writes per-row (max, sum-exp,
       sum-exp·z, target logit), the sums without the target's column — 16 bytes a row; the logits are read
       once. With ``top_k_ids`` (:func:`vocab_parallel_logprobs_with_top_k`, ``ops/top_k_logprobs.py``): this
       shard's logits at the ids it owns into a payload after the statistics' rows.
    2. One collective: all-gather of the ``[N + 1, 4]`` fp32 statistics over ``tp_group`` (skipped
       for a group of size 1). Row N carries this shard's size, so shard sizes are checked without a
       collective of their own. With ``top_k_ids`` the payload travels in it (4 bytes an id more).
    3. ``logprob_merge_kernel``: merge the TP shards' statistics into log-prob, entropy, logZ (as M and
       log S), and the target's 1 - p_t and log p_t + H from the other tokens' sums (no cancellation near
       p_t = 1) per row; count bad targets and shard-size mismatches (their outputs are NaN); with
       ``check_inputs`` the counts go to the deferred error ledger (``mp_grpo.ops.checks``): raised at once on
       the CPU, at the next ``mp_grpo.check_errors()`` on a GPU — no host read here.
    4. With ``top_k_ids``: the log-probs at the ids, from the gathered payload and statistics (one small kernel).
    Saved for backward: the logits (not a copy), targets, M, log S, 1 - p_t, the entropy and log p_t + H —
    28 bytes a row beyond the logits, no ``[N, V]`` fp32 buffer (with a filter also the threshold and the
    outside-the-kept-set mask, 5 bytes a row; with a support its CSR, a flag and the outside mask, 2 bytes a row).

Backward
    1. ``logprob_backward_kernel``: one pass reads the shard once and writes its gradient once, in
       the logits' dtype (into the logits buffer itself with ``inplace_backward=True``). logZ and
       the entropy already describe the whole vocabulary, so no collective is needed. With a captured support:
       ``captured_support.support_backward`` (the gradient at the support's ids, this kernel writing 0 across
       the support rows, a scatter of the former).
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
from mp_grpo.ops.sampling_filter import SamplingFilter, filtered_statistics, targets_outside_filter
from mp_grpo.ops.captured_support import (
    check_replay,
    support_backward,
    support_statistics,
    targets_outside_support,
)
from mp_grpo.ops.logprob_launch import (
    flat_upstream_grads,
    gather_and_merge,
    logprob_backward,
    new_stats_buffer_with,
    shard_statistics,
)
from mp_grpo.ops.token_ids import CapturedSupport, TokenIds, check_token_ids, record_token_ids_errors
from mp_grpo.ops.top_k_logprobs import TokenLogprobs, gather_logits_at_ids, top_k_outputs


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
        captured_support: CapturedSupport | None = None,
        top_k_ids: TokenIds | None = None,
    ):
        ctx.set_materialize_grads(False)
        v_local = logits.shape[-1]
        x = logits.reshape(-1, v_local)  # a view whenever the leading dims allow one
        if x.stride(-1) != 1:
            x = x.contiguous()
        t = target.reshape(-1).to(torch.int64).contiguous()  # the kernels read targets densely
        n = x.shape[0]
        vocab_start = group_rank(tp_group) * v_local
        v_global = v_local * group_size(tp_group)

        # --- 0.–1. statistics of this rank's shard (one read of the logits); with a filter, of its kept set; with a
        #          captured support, of each row's support (a gather) ---
        buffer = new_stats_buffer_with(n, top_k_ids.nnz if top_k_ids is not None else 0, x.device)
        stats = buffer.stats
        threshold = has_support = None
        if sampling_filter is not None:
            threshold = filtered_statistics(x, t, stats, sampling_filter, target.shape, tp_group=tp_group,
                                            inv_temperature=inv_temperature, with_entropy=with_entropy)
        elif captured_support is not None:
            record_token_ids_errors(captured_support, "captured_support", v_global, check_inputs,
                                    strictly_increasing=True)
            has_support = support_statistics(x, t, stats, captured_support, vocab_start=vocab_start,
                                             inv_temperature=inv_temperature, with_entropy=with_entropy)
        else:
            shard_statistics(x, t, stats, vocab_start=vocab_start, inv_temperature=inv_temperature,
                             with_entropy=with_entropy)
        if top_k_ids is not None:  # this shard's logits at the engine's top-K ids, after the statistics' rows
            record_token_ids_errors(top_k_ids, "top_k_ids", v_global, check_inputs, strictly_increasing=False)
            gather_logits_at_ids(x, buffer.payload, top_k_ids, vocab_start=vocab_start, threshold=threshold,
                                 support=captured_support)

        # --- 2.–3. the one collective (all-gather of the [N + 1, 4] statistics, the payload with them) and the merge
        #          into log-prob, entropy, logZ = M + log S; raise on bad input ---
        merged, gathered = gather_and_merge(
            buffer.buffer, t, tp_group=tp_group, v_local=v_local, ignore_index=ignore_index,
            inv_temperature=inv_temperature, with_entropy=with_entropy, check_inputs=check_inputs,
            payload_rows=buffer.payload_rows,
        )

        outside = None
        if threshold is not None:
            # A target outside the kept set has log-prob -inf (its stats row wrote z_t = -inf).
            outside = targets_outside_filter(merged.logprobs, t, ignore_index, check_inputs)
        elif has_support is not None:
            outside = targets_outside_support(merged.logprobs, t, ignore_index, check_inputs)
        ctx.save_for_backward(x, t, merged.row_max, merged.log_sum, merged.complement, merged.entropy,
                              merged.centered, threshold, outside)
        ctx.support, ctx.has_support = captured_support, has_support
        ctx.logits_shape = logits.shape
        ctx.vocab_start = vocab_start
        ctx.inv_temperature = inv_temperature
        ctx.ignore_index = ignore_index
        ctx.inplace_backward = inplace_backward
        logprobs = merged.logprobs.view(target.shape)
        if top_k_ids is not None:
            # --- 4. the log-probs at the engine's top-K ids (not differentiable) ---
            return top_k_outputs(ctx, merged, gathered, t, top_k_ids, target.shape, v_local=v_local,
                                 ignore_index=ignore_index, inv_temperature=inv_temperature, with_entropy=with_entropy)
        if with_entropy:
            return logprobs, merged.entropy.view(target.shape)
        return logprobs

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None = None, _grad_top_k=None):
        x, t, row_max, log_sum, complement, entropy, centered, threshold, outside = ctx.saved_tensors
        not_differentiable = (None,) * 10
        if grad_logprobs is None and grad_entropy is None:
            return (None, *not_differentiable)
        if entropy.numel() == 0:  # the entropy was not asked for (with top-K its output is an empty placeholder)
            grad_entropy = None
        grad_logprobs, grad_entropy = flat_upstream_grads(grad_logprobs, grad_entropy, row_max.shape[0], row_max.device)
        if outside is not None:
            # The log-prob of a target outside the kept set (or support) is the constant -inf: no gradient from it.
            grad_logprobs = torch.where(outside, 0.0, grad_logprobs)

        # --- 1. one pass: recompute p from the logits and logZ, write the gradient (captured support: 3 kernels) ---
        grad_x = x if ctx.inplace_backward else torch.empty_like(x)
        support = getattr(ctx, "support", None)  # (scripts/filter_before.py reuses this backward without one)
        if support is not None:
            support_backward(x, grad_x, t, row_max, log_sum, complement, entropy, centered, grad_logprobs,
                             grad_entropy, support, ctx.has_support, vocab_start=ctx.vocab_start,
                             ignore_index=ctx.ignore_index, inv_temperature=ctx.inv_temperature)
        else:
            logprob_backward(
                x, grad_x, t, row_max, log_sum, complement, entropy, centered,
                grad_logprobs, grad_entropy,
                vocab_start=ctx.vocab_start, ignore_index=ctx.ignore_index, inv_temperature=ctx.inv_temperature,
                threshold=threshold,
            )
        return (grad_x.view(ctx.logits_shape), *not_differentiable)


@overload
def vocab_parallel_logprobs(
    logits: torch.Tensor, target: torch.Tensor, *, tp_group: ProcessGroup | None = ..., temperature: float = ...,
    with_entropy: Literal[False] = ..., ignore_index: int = ..., inplace_backward: bool = ...,
    check_inputs: CheckInputs | bool = ..., sampling_filter: SamplingFilter | None = ...,
    captured_support: CapturedSupport | None = ...,
) -> torch.Tensor: ...
@overload
def vocab_parallel_logprobs(
    logits: torch.Tensor, target: torch.Tensor, *, tp_group: ProcessGroup | None = ..., temperature: float = ...,
    with_entropy: Literal[True], ignore_index: int = ..., inplace_backward: bool = ...,
    check_inputs: CheckInputs | bool = ..., sampling_filter: SamplingFilter | None = ...,
    captured_support: CapturedSupport | None = ...,
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
    captured_support: CapturedSupport | None = None,
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
        captured_support: replay the rollout engine's captured support (:class:`mp_grpo.CapturedSupport`, CSR
            over the flattened targets; ``ops/captured_support.py``): each token's log-prob, entropy and gradient
            are those of its distribution renormalized over its support (a token with no ids: the whole
            vocabulary); each rank gathers its logits at the ids of its shard, no collective of its own. A target
            outside its support raises ``ValueError`` naming the first such token (with ``check_inputs``, deferred
            as the other checks); otherwise its log-prob is -inf and no gradient flows from it
            (``count_outside_filter`` counts those too). Not with ``sampling_filter`` (the support is what the
            engine's filter kept).

    Returns:
        fp32 log-probs ``[...]``; with ``with_entropy=True`` the pair ``(logprobs, entropy)``. The
        return type follows the literal value of ``with_entropy`` (see the overloads).

    One all-gather of a ``[N + 1, 4]`` fp32 tensor per call (plus the filter's, module docstring step 0).

    Batch invariance: a row's log-prob, entropy and gradient are bitwise identical whatever the number
    of rows, their position and the leading shape (docs/kernel.md, "Batch invariance").
    """
    inv_temperature, check_inputs = _checked(logits, target, temperature, check_inputs, sampling_filter,
                                             captured_support)
    return vocab_parallel_logprobs_unchecked(
        logits, target, tp_group=tp_group, inv_temperature=inv_temperature, with_entropy=bool(with_entropy),
        ignore_index=int(ignore_index), inplace_backward=bool(inplace_backward), check_inputs=check_inputs,
        sampling_filter=sampling_filter, captured_support=captured_support,
    )


def vocab_parallel_logprobs_with_top_k(
    logits: torch.Tensor,
    target: torch.Tensor,
    top_k_ids: TokenIds,
    *,
    tp_group: ProcessGroup | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    ignore_index: int = -100,
    inplace_backward: bool = False,
    check_inputs: CheckInputs | bool = CheckInputs.DEFERRED,
    sampling_filter: SamplingFilter | None = None,
    captured_support: CapturedSupport | None = None,
) -> TokenLogprobs:
    """:func:`vocab_parallel_logprobs`, and in the same pass the log-probs at ``top_k_ids`` — the rollout engine's
    top-K ids of every token (:class:`mp_grpo.TokenIds`, CSR over the flattened targets, any order, ids in
    ``[0, V_global)``) — for a top-K divergence between the trainer and the engine (``ops/top_k_logprobs.py``).

    The arguments are :func:`vocab_parallel_logprobs`'s. Returns :class:`~mp_grpo.ops.top_k_logprobs.TokenLogprobs`
    ``(logprobs, entropy or None, top_k)``: ``top_k`` ``[nnz]`` fp32 aligned with ``top_k_ids.ids``, normalized as
    the target's log-prob is (over the kept set or the support, -inf at an id outside it), not differentiable.
    Collectives: none beyond :func:`vocab_parallel_logprobs`'s — this shard's logits at the ids it owns travel in
    the statistics' all-gather (4 bytes an id)."""
    inv_temperature, check_inputs = _checked(logits, target, temperature, check_inputs, sampling_filter,
                                             captured_support)
    check_token_ids(top_k_ids, "top_k_ids", target.shape, logits.device)
    return vocab_parallel_logprobs_unchecked(
        logits, target, tp_group=tp_group, inv_temperature=inv_temperature, with_entropy=bool(with_entropy),
        ignore_index=int(ignore_index), inplace_backward=bool(inplace_backward), check_inputs=check_inputs,
        sampling_filter=sampling_filter, captured_support=captured_support, top_k_ids=top_k_ids,
    )


def _checked(logits, target, temperature, check_inputs, sampling_filter, captured_support) -> tuple[float, CheckInputs]:
    """The public entries' argument checks: ``(1 / temperature, check_inputs as a CheckInputs)``."""
    check_logits_and_target(logits, target)
    check_runs_here(logits, "logits")
    inv_temperature = check_temperature(temperature)
    check_inputs = check_inputs_mode(check_inputs)
    check_replay(sampling_filter, captured_support, target.shape, logits.device, check_inputs)
    return inv_temperature, check_inputs


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
    captured_support: CapturedSupport | None = None,
    top_k_ids: TokenIds | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | TokenLogprobs:
    """:func:`vocab_parallel_logprobs` (with ``top_k_ids``: :func:`vocab_parallel_logprobs_with_top_k`) without its
    argument checks, for a caller that made them once at its own boundary (``GRPOLoss.on_logits``,
    ``MegatronGRPO.loss_func``): ``logits`` and ``target`` as :func:`~mp_grpo.ops.checks.check_logits_and_target` and
    :func:`~mp_grpo.ops.checks.check_runs_here` accept them, ``inv_temperature`` from
    :func:`~mp_grpo.ops.checks.check_temperature`, ``check_inputs`` a :class:`CheckInputs`, ``sampling_filter`` and
    ``captured_support`` passed by :func:`~mp_grpo.ops.captured_support.check_replay` for ``target``, ``top_k_ids`` by
    :func:`~mp_grpo.ops.token_ids.check_token_ids`. What only the device sees (``check_inputs``) is still counted
    here."""
    if sampling_filter is not None:
        # Fields that keep everything (top_p = 1, top_k >= V, min_p = 0) cost nothing.
        sampling_filter = sampling_filter.without_noops(logits.shape[-1] * group_size(tp_group))
    out = VocabParallelLogProbs.apply(
        logits, target, tp_group, inv_temperature, with_entropy, ignore_index, inplace_backward, check_inputs,
        sampling_filter, captured_support, top_k_ids,
    )
    if top_k_ids is None:
        return out
    logprobs, entropy, top_k = out
    return TokenLogprobs(logprobs, entropy if with_entropy else None, top_k)
