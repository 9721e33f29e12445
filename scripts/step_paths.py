"""The paths ``bench_step.py`` compares, as closures over a :class:`~step_model.Rig` and its micro-batches.

Every path runs through the rig's ``forward_backward_func`` (Megatron's schedule on the GPU), one model:

- ``floor``: the decoder alone — GPTModel with its output layer skipped
  (:func:`mp_grpo.megatron.fused_output.call_for_hidden_states`) and no loss: backward starts from a fixed
  random gradient of the final hidden states. The bare output-layer matmuls are timed apart
  (:func:`output_matmuls`) and added to its time.
- ``common``: what verl's Megatron actor does, written from its public description: the model's logits as
  ``Float16Module`` returns them by default (fp32), divided by the temperature in place, per-token log-probs
  as minus megatron-core's ``vocab_parallel_cross_entropy``, masked with ``masked_fill``, then the vanilla PPO
  loss in torch (:func:`common_ppo_loss`: clipped ratio, dual clip on negative advantages, token mean).
- ``logits``: ``MegatronGRPO(output_path=LOGITS)`` — bf16 logits from the batch-major output layer,
  ``GRPOLoss.on_logits`` writing the logits' gradient in place.
- ``fused``: ``MegatronGRPO(output_path=FUSED)`` — the output layer fused with the loss, no logits held.
- ``logits_model_layer``: the ``logits`` path as it was before the batch-major output layer — GPTModel's own
  output layer (its transposed copies) and the logits' gradient in a new buffer; kept to measure that change.

The loss is the same objective on every path: PPO clip (ε = 0.2) with dual clip c = 3, token mean over the
step's trained tokens, no entropy, no KL; without old log-probs the pass is on-policy (ratio 1: every token
has a gradient, as in the first mini-batch of a GRPO step).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from functools import partial

import torch

from mp_grpo.config import LossConfig, load_config
from mp_grpo.config.job import OutputPath
from mp_grpo.megatron import IGNORE_INDEX, MegatronGRPO, MegatronScaling, MicroBatch
from mp_grpo.megatron.forward_only import forward_logprobs
from mp_grpo.megatron.fused_output import call_for_hidden_states
from mp_grpo.ops import vocab_parallel_logprobs

TEMPERATURE = 1.0
"""Sampling temperature of the rollouts (the common path still divides by it, as verl does)."""
EPS_CLIP = 0.2
"""PPO clip range (verl's ``clip_ratio``)."""
DUAL_CLIP_C = 3.0
"""Dual-clip bound on negative advantages (verl's ``clip_ratio_c``)."""
LOG_RATIO_CLAMP = 20.0
"""Bound on |log π − log π_old| before ``exp`` in the common path's ratio (verl's vanilla PPO loss)."""
FLOOR_GRADIENT_SEED = 29
"""Seed of the floor's random gradient of the final hidden states (the same in every pass)."""
LOSS_OVERRIDES = [f"policy.eps_low={EPS_CLIP}", f"policy.eps_high={EPS_CLIP}", f"policy.dual_clip_c={DUAL_CLIP_C}"]
"""mp_grpo's config of the same objective (token mean is its default aggregation)."""


class Path(str, Enum):
    FLOOR = "floor"
    COMMON = "common"
    LOGITS = "logits"
    FUSED = "fused"
    LOGITS_MODEL_LAYER = "logits_model_layer"


def loss_config() -> LossConfig:
    return load_config(None, LOSS_OVERRIDES)


# ------------------------------------------------------------------------------------- the common path
def common_logprobs(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor, *,
                    temperature: float = TEMPERATURE) -> torch.Tensor:
    """verl's log-probs: ``logits /= T`` in place, minus megatron-core's vocab-parallel cross entropy, 0 where not trained."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits.div_(temperature)
    logprobs = -vocab_parallel_cross_entropy(logits, targets)
    return logprobs.masked_fill(~loss_mask, 0.0)


def common_ppo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    loss_mask: torch.Tensor, *, denominator: float) -> torch.Tensor:
    """Vanilla PPO loss as verl describes it: ``r = exp(clamp(log π − log π_old, ±20))``, the larger of
    ``−A·r`` and ``−A·clip(r, 1 − ε, 1 + ε)``, for A < 0 at most ``−A·c``; summed over trained tokens / ``denominator``."""
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - EPS_CLIP, 1.0 + EPS_CLIP)
    pg = torch.maximum(unclipped, clipped)
    pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * DUAL_CLIP_C), pg)
    return torch.where(loss_mask, pg, torch.zeros_like(pg)).sum() / denominator


def _token_advantages(mb: MicroBatch) -> torch.Tensor:
    adv = mb.advantages
    return adv.unsqueeze(1).expand(mb.targets.shape) if adv.dim() == 1 else adv


def _trained_tokens(micro: list[MicroBatch]) -> float:
    return float(sum(int(mb.loss_mask.sum()) for mb in micro))


# ------------------------------------------------------------------------------------- forward steps
def _floor_step(rig, upstream: dict, forward_only: bool):
    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        hidden, _ = call_for_hidden_states(model, mb.input_ids, mb.position_ids, None, **rig.model_kwargs)

        def loss_func(out):
            if forward_only:
                return out.new_zeros(()), {}
            key = tuple(out.shape)
            if key not in upstream:  # one fixed random gradient per shape, made in the first (warm-up) step
                gen = torch.Generator(device=out.device).manual_seed(FLOOR_GRADIENT_SEED)
                upstream[key] = torch.randn(key, device=out.device, generator=gen).to(out.dtype)
            return (out * upstream[key]).sum(), {}

        return hidden, loss_func

    return forward_step


def _common_step(micro: list[MicroBatch], forward_only: bool):
    denominator = _trained_tokens(micro)

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        logits = model(mb.input_ids, mb.position_ids, None)  # verl's call: Float16Module's default fp32 output

        def loss_func(out):
            logprobs = common_logprobs(out, mb.targets, mb.loss_mask)
            if forward_only:
                return logprobs.new_zeros(()), {"logprobs": logprobs}
            old = logprobs.detach() if mb.old_logprobs is None else mb.old_logprobs
            loss = common_ppo_loss(logprobs, old, _token_advantages(mb), mb.loss_mask, denominator=denominator)
            return loss * len(micro), {}  # Megatron's schedule divides by the number of micro-batches

        return logits, loss_func

    return forward_step


def _model_layer_step(rig, grpo: MegatronGRPO, batch, micro: list[MicroBatch]):
    """The logits path before the batch-major output layer: GPTModel's own layer, a new gradient buffer."""
    scaling = MegatronScaling(calculate_per_token_loss=False, num_microbatches=len(micro), dp_size=rig.groups.dp_size)

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        logits = model(mb.input_ids, mb.position_ids, None, **rig.model_kwargs)

        def loss_func(out):
            share, metrics = grpo.loss.on_logits(
                out, mb.targets, mb.old_logprobs, mb.advantages, mb.loss_mask, tp_group=rig.groups.tp,
                temperature=TEMPERATURE, with_entropy=False, ignore_index=IGNORE_INDEX, batch=batch, layout=mb.sequences,
            )
            return scaling.megatron_loss(share, batch.valid_tokens), metrics

        return logits, loss_func

    return forward_step


def _grpo(rig, path: Path, micro: list[MicroBatch]) -> MegatronGRPO:
    output_path = OutputPath.FUSED if path == Path.FUSED else OutputPath.LOGITS
    return MegatronGRPO(loss_config(), temperature=TEMPERATURE, calculate_per_token_loss=False,
                        num_microbatches=len(micro), groups=rig.groups, with_entropy=False, output_path=output_path)


# ------------------------------------------------------------------------------------- passes
def training_pass(rig, path: Path, micro: list[MicroBatch]) -> Callable[[], list]:
    """One training ``forward_backward_func`` over ``micro`` on ``path`` (the step's GlobalBatch built here, once)."""
    path = Path(path)
    if path == Path.FLOOR:
        step = _floor_step(rig, {}, forward_only=False)
    elif path == Path.COMMON:
        step = _common_step(micro, forward_only=False)
    else:
        grpo = _grpo(rig, path, micro)
        batch = grpo.global_batch(micro, step=0)
        if path == Path.LOGITS_MODEL_LAYER:
            step = _model_layer_step(rig, grpo, batch, micro)
        else:
            step = grpo.forward_step_func(batch, step=0, model_kwargs=rig.model_kwargs)
    return partial(rig.schedule, step, micro, forward_only=False)


def forward_pass(rig, path: Path, micro: list[MicroBatch]) -> Callable[[], list[torch.Tensor] | None]:
    """The forward-only log-prob pass (old / reference policy) over ``micro`` on ``path``, under ``no_grad``:
    the log-probs per micro-batch (the floor: None — the decoder alone, no output layer)."""
    path = Path(path)
    grpo = None if path in (Path.FLOOR, Path.COMMON) else _grpo(rig, path, micro)  # once, as a training loop does

    def run():
        with torch.no_grad():
            if path == Path.FLOOR:
                rig.schedule(_floor_step(rig, {}, forward_only=True), micro, forward_only=True)
                return None
            if path == Path.COMMON:
                return [d["logprobs"] for d in rig.schedule(_common_step(micro, forward_only=True), micro,
                                                            forward_only=True)]
            if path == Path.LOGITS_MODEL_LAYER:
                def step(data_iterator, model):
                    mb = next(data_iterator)

                    def loss_func(out):
                        lp = vocab_parallel_logprobs(out, mb.targets, tp_group=rig.groups.tp, temperature=TEMPERATURE,
                                                     ignore_index=IGNORE_INDEX)
                        return lp.new_zeros(()), {"logprobs": lp}

                    return model(mb.input_ids, mb.position_ids, None, **rig.model_kwargs), loss_func

                return [d["logprobs"] for d in rig.schedule(step, micro, forward_only=True)]
            out = forward_logprobs(grpo, rig.forward_backward_func, rig.model, micro, model_kwargs=rig.model_kwargs)
            return out.logprobs

    return run


def grpo_step(rig, path: Path, micro: list[MicroBatch], optimizer) -> Callable[[], None]:
    """A whole GRPO step on ``path``: the forward-only pass (old log-probs), the training pass on them (its
    GlobalBatch built in the step), megatron-core's optimizer step. The floor runs the decoder in both passes."""
    path = Path(path)
    old_pass = forward_pass(rig, path, micro)

    def step():
        old = old_pass()
        with_old = micro if old is None else [mb.with_logprobs(old_logprobs=lp) for mb, lp in zip(micro, old)]
        rig.zero_grad()
        optimizer.zero_grad()
        training_pass(rig, path, with_old)()
        optimizer.step()

    return step


def output_matmuls(tokens: int, hidden: int, vocab: int, *, backward: bool, device, dtype=torch.bfloat16):
    """The bare output layer, timed apart for the floor: ``h @ Wᵀ`` (forward-only pass) or that and its two
    backward GEMMs from a random logits gradient (training pass). Random operands, made once."""
    gen = torch.Generator(device=device).manual_seed(5)
    h = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype).requires_grad_(backward)
    w = (torch.randn(vocab, hidden, device=device, generator=gen) * hidden**-0.5).to(dtype).requires_grad_(backward)
    if not backward:
        def fwd():
            with torch.no_grad():
                h @ w.t()

        return fwd
    grad = torch.randn(tokens, vocab, device=device, generator=gen).to(dtype)

    def fwd_bwd():
        h.grad = w.grad = None
        (h @ w.t()).backward(grad)

    return fwd_bwd
