"""The GRPO-family loss straight from a vocabulary shard of logits, as one autograd Function.

``GRPOLoss.on_logits(logits, target, ...)`` runs this: the values, gradients and metrics of
``GRPOLoss(vocab_parallel_logprobs(logits, target), ...)`` with the fused loss, with less host work per
micro-batch — one autograd node instead of two, and no launch of its own for the loss's backward: the
loss writes its per-token gradient coefficients d share / d log π and d share / d H in forward, and the
log-prob backward kernel reads them, scaled on the device by the loss's upstream gradient
(``HAS_GRAD_SCALE``). At V_local = 18992 the host, not the GPU, sets the time of logits → loss
(``docs/benchmarks/logprob.md``), so each host step saved is time saved.

Schedule of :class:`LogitsGRPOLossFunction` (N rows, V_local columns on each of TP ranks)

Forward
    1. ``logprob_stats_kernel``: per-row statistics of this rank's shard (the logits read once). With a
       ``sampling_filter``: ``filtered_statistics`` (``ops/sampling_filter.py``), the statistics of the kept set
       and the per-row thresholds — what ``vocab_parallel_logprobs`` runs, with its collectives. With a
       ``captured_support``: ``support_statistics`` (``ops/captured_support.py``), each row's support's (a gather).
    2. The one collective of the log-prob op: all-gather of the ``[N + 1, 4]`` statistics over ``tp_group``
       (skipped for a group of size 1).
    3. The fused loss's forward (:func:`mp_grpo.ops.grpo_loss.loss_forward`, its steps 1–5) on the statistics
       (``FROM_STATS``): its token kernel (per-sequence sums, when the config has any) and its combine kernel
       merge the TP shards' statistics into log-probs and entropy themselves — the log-prob op's merge
       (``logprob_merge.merge_rows``), a few loads a position — instead of reading a log-prob tensor; the
       combine kernel also stores M, log S, the entropy and 1 - p_t for backward and adds the merge's error counts
       into the deferred ledger (no host read). Then the finalize kernel: the loss and the metric entries.
    4. With a filter or a support: the targets outside the kept set or the support (log-prob -inf) are recorded
       through the deferred ledger (``check_inputs``), as ``vocab_parallel_logprobs`` records them.
Backward
    1. gspo / gmpo under context parallelism only (without, the finalize kernel folded it in forward): the
       fused loss's backward kernel adds the path through the sequence mean (after the CP all-reduce of its
       per-sequence factor) and applies the upstream gradient g.
    2. ``logprob_backward_kernel``: one read of the shard, one write of its gradient, with upstream gradients
       g · d share / d log π and g · d share / d H — g read on the device (``HAS_GRAD_SCALE``); gspo / gmpo:
       step 1's, unscaled. No collective: logZ and H describe the whole vocabulary already. With a filter the
       columns below the threshold get no gradient, and neither do targets outside the kept set (d share / d log π
       set to 0 first, as the log-prob op's backward does). With a support: ``support_backward`` (the gradient at
       the support's columns, 0 elsewhere; three launches).

Launches: forward 3 (stats, combine, finalize; + memset and token kernel with per-sequence sums; a sampling filter
adds its own: group maxima, candidates, select, the fallback's passes and a statistics pass, ops/sampling_filter.py),
backward 1 (gspo / gmpo under context parallelism: 2) — against 4–6 and 2 for the log-prob op and the loss apart
(stats, merge; combine, finalize (+ memset, token); two backward kernels).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mp_grpo.collectives import ProcessGroup, group_rank, group_size
from mp_grpo.ops.checks import CheckInputs
from mp_grpo.ops.grpo_loss import FromStats, FusedGRPOLoss, LossSaved, _Call, loss_backward, loss_forward
from mp_grpo.ops.logprob_launch import (
    gather_statistics,
    logprob_backward,
    new_stats_buffer,
    raise_on_merge_errors,
    shard_statistics,
)
from mp_grpo.ops.captured_support import support_backward, support_statistics, targets_outside_support
from mp_grpo.ops.sampling_filter import SamplingFilter, filtered_statistics, targets_outside_filter
from mp_grpo.ops.token_ids import CapturedSupport, record_token_ids_errors


class LogitsSpec(NamedTuple):
    """How the log-probs are taken of the logits (the arguments of :func:`mp_grpo.vocab_parallel_logprobs`)."""

    tp_group: ProcessGroup | None
    inv_temperature: float
    ignore_index: int
    inplace_backward: bool
    check_inputs: CheckInputs
    sampling_filter: SamplingFilter | None = None
    """Checked, its no-op fields dropped (``SamplingFilter.without_noops``)."""
    captured_support: CapturedSupport | None = None
    """Checked on the host (``captured_support.check_replay``); its values are counted by the op."""


class LogitsGRPOLossFunction(torch.autograd.Function):
    """Differentiable w.r.t. ``logits``; see the module docstring for the schedule."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, spec: LogitsSpec, call: _Call):
        ctx.set_materialize_grads(False)  # the metric outputs get no gradient: no zeros made for them
        v_local = logits.shape[-1]
        x = logits.reshape(-1, v_local)  # a view whenever the leading dims allow one
        if x.stride(-1) != 1:
            x = x.contiguous()
        t = target.reshape(-1)
        if t.dtype != torch.int64 or not t.is_contiguous():
            t = t.to(torch.int64).contiguous()  # the kernels read targets densely
        n = x.shape[0]
        vocab_start = group_rank(spec.tp_group) * v_local
        with_entropy = call.plan.combine_flags["HAS_ENTROPY"]

        # --- 1. statistics of this rank's shard (one read of the logits); with a filter, of its kept set ---
        stats = new_stats_buffer(n, x.device)
        threshold = has_support = None
        if spec.sampling_filter is not None:
            threshold = filtered_statistics(x, t, stats, spec.sampling_filter, target.shape, tp_group=spec.tp_group,
                                            inv_temperature=spec.inv_temperature, with_entropy=with_entropy)
        elif spec.captured_support is not None:
            record_token_ids_errors(spec.captured_support, "captured_support", v_local * group_size(spec.tp_group),
                                    spec.check_inputs, strictly_increasing=True)
            has_support = support_statistics(x, t, stats, spec.captured_support, vocab_start=vocab_start,
                                             inv_temperature=spec.inv_temperature, with_entropy=with_entropy)
        else:
            shard_statistics(x, t, stats, vocab_start=vocab_start, inv_temperature=spec.inv_temperature,
                             with_entropy=with_entropy)
        # --- 2. the one collective: all-gather of the statistics ---
        gathered = gather_statistics(stats, tp_group=spec.tp_group, v_local=v_local, ignore_index=spec.ignore_index,
                                     check_inputs=spec.check_inputs)
        # --- 3. the fused loss on the merged log-probs: shares, per-token gradient coefficients, loss, metrics ---
        outside = None
        if threshold is not None or has_support is not None:
            # --- 4. targets outside the kept set (or support): their logit summed over the shards is -inf (the
            #        statistics' marker; the merge's log-prob is -inf exactly there), recorded as
            #        vocab_parallel_logprobs records them — before the loss, whose non-finite guard would otherwise
            #        report them first; no gradient from their log-prob in backward ---
            outside_of = targets_outside_filter if threshold is not None else targets_outside_support
            outside = outside_of(gathered.stats[:, :n, 3].sum(0), t, spec.ignore_index, spec.check_inputs)
        from_stats = FromStats(gathered.stats, t, gathered.errors, gathered.stats.shape[0] * v_local,
                               spec.ignore_index, spec.inv_temperature)
        loss, pairs, extremes, saved = loss_forward(None, None, call, from_stats)
        raise_on_merge_errors(gathered, spec.check_inputs)

        ctx.mark_non_differentiable(pairs, extremes)
        ctx.save_for_backward(x, t)  # the inputs; the forward's own buffers are kept on ctx (as autograd allows)
        ctx.threshold, ctx.outside, ctx.has_support = threshold, outside, has_support
        ctx.saved = saved
        ctx.logits_shape = logits.shape
        ctx.vocab_start = vocab_start
        ctx.spec = spec
        return loss, pairs, extremes

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor, _grad_pairs, _grad_extremes):
        if grad_loss is None:
            return None, None, None, None
        x, t = ctx.saved_tensors
        saved: LossSaved = ctx.saved
        row_max, log_sum, entropy, complement, centered = saved.rows.unbind(0)
        grad_lp, grad_ent = saved.grad_lp, saved.grad_ent
        spec: LogitsSpec = ctx.spec
        grad_scale = grad_loss if grad_loss.dtype == torch.float32 else grad_loss.float()
        # --- 1. gspo / gmpo: the path through the sequence mean, g applied ---
        if saved.seq_grad is not None:  # under context parallelism (else folded in forward)
            grad_lp, grad_ent = loss_backward(saved, grad_scale, torch.float32,
                                              torch.float32 if grad_ent is not None else None)
            grad_scale = None
        if ctx.outside is not None:
            # A target outside the kept set: its log-prob is the constant -inf, no gradient flows from it.
            # (grad_lp may be longer than the rows: a workspace slice rounded up to 16 bytes)
            grad_lp = torch.where(ctx.outside, 0.0, grad_lp[: ctx.outside.numel()])
        # --- 2. one pass over the shard: recompute p (over the kept set with a filter), write the gradient ---
        grad_x = x if spec.inplace_backward else torch.empty_like(x)
        rows = (x, grad_x, t, row_max, log_sum, complement, entropy, centered, grad_lp, grad_ent)
        if ctx.has_support is not None:
            support_backward(*rows, spec.captured_support, ctx.has_support, vocab_start=ctx.vocab_start,
                             ignore_index=spec.ignore_index, inv_temperature=spec.inv_temperature,
                             grad_scale=grad_scale)
        else:
            logprob_backward(*rows, vocab_start=ctx.vocab_start, ignore_index=spec.ignore_index,
                             inv_temperature=spec.inv_temperature, threshold=ctx.threshold, grad_scale=grad_scale)
        return grad_x.view(ctx.logits_shape), None, None, None


def logits_grpo_loss(
    loss: FusedGRPOLoss, logits: torch.Tensor, target: torch.Tensor, spec: LogitsSpec, call: _Call
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(this micro-batch's share, its metric dict) of ``loss`` on the log-probs of ``logits``; every input is
    checked already (``GRPOLoss.on_logits``)."""
    share, pairs, extremes = LogitsGRPOLossFunction.apply(logits, target, spec, call)
    return share, loss.metrics(call.plan, pairs, extremes)
