"""Megatron-LM RL's loss options as mp_grpo's: the LossConfig of a ``train_rl.py`` run, and the entropy term.

Megatron-LM's per-token loss (``megatron/rl/rl_utils.py::calculate_grpo_loss``)::

    −w · min(r·A, clip(r, 1 − eps_lower, 1 + eps_upper)·A) + β · k3(ref − log π) − λ · (−p·log p)

with r = exp(log π − old) (no clamp), w = min(exp(old − inference), c) under ``--rl-inference-logprobs-is-correction``
(c = ``--rl-importance-sampling-truncation-coef``, none when unset), k3 not clamped, and p = π(y_t) of the sampled
token alone. With ``--calculate-per-token-loss`` the step divides by its valid tokens (mp_grpo's ``token_mean``);
without it Megatron-LM averages the micro-batches' token means (× CP / M, then DDP's average) — a normalization
that changes with the micro-batch split, which mp_grpo does not reproduce: its GlobalBatch divides by the step's
valid tokens either way.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from mp_grpo.config import load_config
from mp_grpo.config.loss import LossConfig


class EntropyTerm(str, Enum):
    """What the entropy bonus (``entropy.bonus_coef``) multiplies (``GRPOForwardStep(entropy_term=...)``)."""

    FULL = "full"
    """The entropy of the whole distribution, −Σ_v p_v log p_v (the log-prob kernel computes it on the vocabulary
    shard: one extra sum in its pass)."""
    SAMPLED_TOKEN = "sampled_token"
    """Megatron-LM's ``entropy_term``: −p·log p of the sampled token only
    (:func:`mp_grpo.loss.entropy.sampled_token_entropy`)."""


def loss_config_from_args(args: Any) -> LossConfig:
    """The LossConfig equal to Megatron-LM's loss for a run's parsed arguments (``megatron.training.get_args()``):
    the ``megatron_lm_grpo`` preset with the run's clip, KL, entropy and IS-correction values. Use it with
    ``entropy_term=EntropyTerm.SAMPLED_TOKEN`` for Megatron-LM's exact loss."""
    overrides = [
        f"policy.eps_low={float(args.grpo_clamp_eps_lower)}",
        f"policy.eps_high={float(args.grpo_clamp_eps_upper)}",
        f"kl.coef={float(args.grpo_kl_beta)}",
        f"entropy.bonus_coef={float(args.grpo_entropy_term_weight)}",
    ]
    if getattr(args, "rl_inference_logprobs_is_correction", False):
        overrides.append("rollout_correction.weight_level=token")
        coef = getattr(args, "rl_importance_sampling_truncation_coef", None)
        if coef is not None:
            overrides.append(f"rollout_correction.weight_max={float(coef)}")
    return load_config("megatron_lm_grpo", overrides)
