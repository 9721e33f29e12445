"""Shared pieces of the Megatron adapter tests: synthetic rollouts, loss configs, the one-process reference.

The reference is the definition of the step objective J: the whole global batch in ONE padded
micro-batch on one process (TP = CP = DP = 1, one call of GRPOLoss, no GlobalBatch, no Megatron
scaling), differentiated by autograd. Every parallel layout must reproduce its gradient.
"""

from __future__ import annotations

import torch

from mp_grpo.collectives import group_size
from mp_grpo.config import LossConfig, load_config
from mp_grpo.config.job import RolloutConfig
from mp_grpo.loss.grpo_loss import GRPOLoss
from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config, random_full_weights
from mp_grpo.megatron.micro_batch import prepare_micro_batch
from mp_grpo.megatron.rollouts import Rollouts
from mp_grpo.train.synthetic import synthesize_rollouts
from mp_grpo.ops import vocab_parallel_logprobs

VOCAB = 64
HIDDEN = 16
MAX_LEN = 32
TEMPERATURE = 0.7

# Loss configurations (dotlists): one plain, one with every sequence-level quantity (the ones CP must
# reduce over whole sequences), one with the step-level quantities the GlobalBatch decides.
LOSS_CONFIGS: dict[str, list[str]] = {
    "ppo_token_tis": ["rollout_correction.weight_level=token", "rollout_correction.weight_max=2.0"],
    "sequence_level": [
        "policy.objective=gspo", "policy.eps_low=0.05", "policy.eps_high=0.05",
        "aggregation.mode=seq_mean_token_mean",
        "rollout_correction.weight_level=geometric", "rollout_correction.weight_max=1.5",
        "rollout_correction.reject_level=sequence", "rollout_correction.reject_min=0.2",
        "rollout_correction.reject_max=5.0", "opsm.delta=0.05", "kl.coef=0.02", "entropy.bonus_coef=0.01",
    ],
    "step_level": [
        "aggregation.mode=seq_mean_token_sum_norm", "aggregation.norm_constant=16",
        "aggregation.count_empty_sequences=true",
        "rollout_correction.weight_level=token", "rollout_correction.weight_max=2.0",
        "rollout_correction.normalize_weights=true", "entropy.top_quantile=0.5", "trust_region.mode=binary_tv",
        "trust_region.delta_high=0.05", "m2po.bound=0.02", "m2po.scope=clip_quadrants", "mismatch.skip_threshold=10.0",
    ],
}


def loss_config(name: str) -> LossConfig:
    return load_config(None, LOSS_CONFIGS[name])


def make_rollouts(num_sequences: int, seed: int) -> Rollouts:
    """Synthetic rollouts with old / rollout / reference log-probs; one sequence has no trained token."""
    cfg = RolloutConfig(group_size=2, prompt_min_length=2, prompt_max_length=6, completion_min_length=1,
                        completion_max_length=12, tool_mask_fraction=0.25)
    r = synthesize_rollouts(cfg, num_sequences=num_sequences, vocab_size=VOCAB, seed=seed).rollouts
    gen = torch.Generator().manual_seed(seed + 1)
    shape = r.tokens.shape
    old = -torch.rand(shape, generator=gen) * 4.0 - 0.5
    rollout = old + torch.randn(shape, generator=gen) * 0.2
    ref = old + torch.randn(shape, generator=gen) * 0.5
    loss_mask = r.loss_mask.clone()
    loss_mask[1] = False  # an empty sequence
    return Rollouts(tokens=r.tokens, lengths=r.lengths, loss_mask=loss_mask, advantages=r.advantages,
                    rollout_logprobs=rollout, old_logprobs=old, ref_logprobs=ref)


def full_weights(seed: int = 7) -> dict[str, torch.Tensor]:
    return random_full_weights(cpu_model_config(hidden_size=HIDDEN), vocab_size=VOCAB, max_sequence_length=MAX_LEN, seed=seed)


TRAINED_OUTPUT_SCALE = 12.0
"""The stand-in's output weight × this: row maxima of its logits in 10–40, as a trained model's."""


def trained_scale_stand_in(tp_group, tensor_model_parallel_size: int = 1) -> CpuGPTStandIn:
    """The stand-in in bf16 with :func:`full_weights` (seed 9), its output weight × :data:`TRAINED_OUTPUT_SCALE`: logits
    at a trained model's scale, where bf16 and fp32 logits give log-probs measurably apart (the logit-dtype tests)."""
    weights = full_weights(seed=9)
    weights["output_layer.weight"] = weights["output_layer.weight"] * TRAINED_OUTPUT_SCALE
    config = cpu_model_config(hidden_size=HIDDEN, tensor_model_parallel_size=tensor_model_parallel_size,
                              params_dtype=torch.bfloat16)
    model = CpuGPTStandIn(config, vocab_size=VOCAB, max_sequence_length=MAX_LEN, tp_group=tp_group)
    model.load_full_weights(weights)
    return model


def full_grads(model: CpuGPTStandIn) -> dict[str, torch.Tensor]:
    """Unsharded gradients of ``model`` (``main_grad`` where Megatron DDP keeps them there): vocab-sharded ones
    all-gathered over its TP group."""
    group = model.word_embeddings.tp_group
    out = {}
    for name, param in model.named_parameters():
        grad = getattr(param, "main_grad", param.grad)
        grad = torch.zeros_like(param) if grad is None else grad
        if getattr(param, "tensor_model_parallel", False) and group_size(group) > 1:
            parts = [torch.empty_like(grad) for _ in range(group_size(group))]
            torch.distributed.all_gather(parts, grad.contiguous(), group=group)
            grad = torch.cat(parts)
        out[name] = grad.clone()
    return out


def reference(config: LossConfig, rollouts: Rollouts, weights: dict[str, torch.Tensor], tp_group) -> tuple[float, dict[str, torch.Tensor]]:
    """(J, ∇J) of the whole batch in one call on one process; ``tp_group`` must be a group of size 1."""
    model = CpuGPTStandIn(cpu_model_config(hidden_size=HIDDEN), vocab_size=VOCAB, max_sequence_length=MAX_LEN, tp_group=tp_group)
    model.load_full_weights(weights)
    mb = prepare_micro_batch(rollouts)
    logits = model(mb.input_ids, mb.position_ids)
    logprobs, entropy = vocab_parallel_logprobs(logits, mb.targets, temperature=TEMPERATURE, with_entropy=True)
    loss, _ = GRPOLoss(config)(
        logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask, rollout_logprobs=mb.rollout_logprobs,
        ref_logprobs=mb.ref_logprobs, entropy=entropy, layout=mb.sequences,
    )
    loss.backward()
    return float(loss), {name: p.grad.clone() for name, p in model.named_parameters()}
