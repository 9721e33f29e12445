"""Per-token log-probs of a step's micro-batches through ``forward_backward_func(forward_only=True)``.

The old-policy and reference passes of a GRPO step (verl's ``compute_log_prob``, NeMo-RL's
``get_logprobs``): the same model call and the same log-prob kernel as the training step (logits or
fused output path, the rollout's temperature), run through Megatron's schedule so that pipeline
parallelism works, and needing no :class:`~mp_grpo.GlobalBatch` — the step-level decisions that the
GlobalBatch makes (IS-weight normalization, mismatch skip, entropy threshold) need these very log-probs.

Schedule of :func:`forward_logprobs`

1. Under ``torch.no_grad()``: ``forward_backward_func(forward_only=True)`` over the micro-batches with a
   ``forward_step_func`` that calls the model as the training step does
   (:meth:`MegatronGRPO.call_model`) and a loss function that returns a zero loss and, as Megatron's
   ``loss_reduced``, this micro-batch's ``{"logprobs", "entropy"}`` from
   :meth:`MegatronGRPO.token_logprobs` (one log-prob kernel pass; its TP collective: one all-gather of
   16 bytes a row). Only the last pipeline stage runs the loss function. A micro-batch that carries the
   rollout's sampling filter (:meth:`MicroBatch.with_sampling_filter`) gets the log-probs of the filtered,
   renormalized distribution, as in the training step (plus the filter's threshold search, docs/kernel.md).
2. Pipeline parallelism (``groups.pp`` of size > 1) and ``broadcast=True``: the last stage's log-probs
   (and entropies) broadcast over the PP group, one broadcast per micro-batch and field, so every stage
   holds them — what step-level decisions taken on every stage need. With ``broadcast=False`` the other
   stages get ``logprobs=None``.

Returned per micro-batch in the layout the training step consumes: ``[*mb.targets.shape]`` fp32, 0 at
positions not trained on (target ``IGNORE_INDEX``) — pass them to :meth:`MicroBatch.with_logprobs`. With
``OutputRows.LOSS`` (MegatronGRPO's default) the output layer runs on the loss rows alone and the entropy is 0 at the
other positions too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from mp_grpo.collectives import broadcast_from_last, group_rank, group_size
from mp_grpo.megatron.loss_func import MegatronGRPO
from mp_grpo.megatron.micro_batch import MicroBatch
from mp_grpo.megatron.moe import end_routing_replay, replay_routing


@dataclass(frozen=True)
class TokenLogprobs:
    """Per-micro-batch results of :func:`forward_logprobs`, in the micro-batches' order."""

    logprobs: list[torch.Tensor] | None
    """``[*mb.targets.shape]`` fp32 log-probs per micro-batch; None on a pipeline stage that was not sent them."""
    entropy: list[torch.Tensor] | None
    """Same layout, the policy entropy; None when the MegatronGRPO does not compute it (``with_entropy``)
    or on a stage that was not sent it."""


def forward_logprobs(
    grpo: MegatronGRPO,
    forward_backward_func: Callable,
    model: torch.nn.Module | list[torch.nn.Module],
    micro_batches: Sequence[MicroBatch],
    *,
    model_kwargs: Mapping[str, object] | None = None,
    broadcast: bool = True,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
) -> TokenLogprobs:
    """Log-probs (and entropy) of every micro-batch's targets; see the module docstring.

    Args:
        grpo: gives the output path, the temperature, the TP group and whether entropy is computed.
        forward_backward_func: Megatron's (``get_forward_backward_func()``) or an equivalent with its
            keyword signature.
        model: as passed to ``forward_backward_func`` (e.g. the policy, or a frozen reference model).
        micro_batches: this rank's micro-batches, in the order the schedule consumes them.
        model_kwargs: extra keyword arguments of the model call, e.g. ``{"fp32_output": False}``.
        broadcast: with pipeline parallelism, send the last stage's results to every stage.
        seq_length, micro_batch_size: for Megatron's p2p buffers under PP; default: the micro-batches' widest
            row and the first micro-batch's rows.
    """
    micro_batches = list(micro_batches)
    if not micro_batches:
        raise ValueError("micro_batches is empty: forward_logprobs needs at least one micro-batch")
    for i, mb in enumerate(micro_batches):
        if not isinstance(mb, MicroBatch):
            raise TypeError(f"micro_batches[{i}] must be a MicroBatch, got {type(mb).__name__}")
    extra = dict(model_kwargs or {})
    pp = grpo.groups.pp
    last_stage = group_rank(pp) == group_size(pp) - 1

    replayed = False

    def forward_step(data_iterator: Iterator[MicroBatch], step_model: torch.nn.Module):
        nonlocal replayed
        mb = next(data_iterator)
        if mb.routing is not None:  # the same recorded routing as the training step (MicroBatch.with_routing)
            replay_routing(step_model, mb.routing)
            replayed = True
        output, output_weight = grpo.call_model(step_model, mb, model_kwargs=extra)
        vocab_size = grpo._model_vocab_size(step_model)

        def loss_func(output_tensor: torch.Tensor):
            logprobs, entropy = grpo.token_logprobs(output_tensor, mb, vocab_size=vocab_size, output_weight=output_weight)
            return logprobs.new_zeros(()), {"logprobs": logprobs, "entropy": entropy}

        return output, loss_func

    # --- 1. the forward-only schedule; the last stage's loss function collects the log-probs ---
    with torch.no_grad():
        store = forward_backward_func(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=model,
            num_microbatches=len(micro_batches),
            seq_length=seq_length or max(int(mb.input_ids.shape[1]) for mb in micro_batches),
            micro_batch_size=micro_batch_size or int(micro_batches[0].input_ids.shape[0]), forward_only=True,
        )
    if replayed:
        end_routing_replay()
    has_entropy = grpo.with_entropy
    if last_stage:
        if len(store) != len(micro_batches):
            raise RuntimeError(f"forward_backward_func returned {len(store)} results for {len(micro_batches)} micro-batches")
        logprobs = [d["logprobs"] for d in store]
        entropy = [d["entropy"] for d in store] if has_entropy else None
    else:
        logprobs = entropy = None
    # --- 2. pipeline parallelism: the last stage's results on every stage ---
    if group_size(pp) > 1 and broadcast:
        def bcast(values):
            return [broadcast_from_last(v if last_stage else _placeholder(mb), pp) for v, mb in zip(values or [None] * len(micro_batches), micro_batches)]

        logprobs = bcast(logprobs)
        entropy = bcast(entropy) if has_entropy else None
    return TokenLogprobs(logprobs=logprobs, entropy=entropy)


def _placeholder(mb: MicroBatch) -> torch.Tensor:
    """The receive buffer of a non-last stage: the shape and dtype the last stage's log-probs have."""
    return torch.zeros(mb.targets.shape, dtype=torch.float32, device=mb.targets.device)
