"""mp_grpo inside verl: every preset as a verl policy loss, and mp_grpo's log-prob kernel in verl's Megatron engine.

After ``pip install mp_grpo`` (next to verl), one line of verl's config switches the policy loss::

    actor_rollout_ref.actor.policy_loss.loss_mode=mp_grpo:<preset>

``import verl`` loads mp_grpo's plugin (entry point group ``verl.plugins``), which registers every shipped
preset under that name — no user code. ``actor.loss_agg_mode`` must be the preset's aggregation.

- :mod:`.policy_loss`: :class:`VerlPolicyLoss` — verl's policy-loss signature over :class:`~mp_grpo.GRPOLoss`,
  normalized by verl's ``global_batch_info`` (``GlobalBatch.from_counts``); what runs and what is refused.
- :mod:`.registration`: :func:`register_presets`, and :func:`register` for a config of your own under a name.
- :mod:`.lm_head`: the switch (``MP_GRPO_VERL_LOGPROBS=1`` or :func:`use_vocab_parallel_logprobs`) that puts
  :func:`mp_grpo.vocab_parallel_logprobs` in place of the Megatron engine's LM-head log-prob + entropy processor
  (``MP_GRPO_VERL_LOGIT_DTYPE=fp32``: with fp32 logits from the output layer's GEMM).
- :mod:`.plugin`: the entry point.

Importing this package imports verl's policy-loss module when a function here needs it; ``import mp_grpo``
never imports it.
"""

from mp_grpo.integrations.verl.lm_head import ENV_SWITCH, lm_head_logprobs, use_vocab_parallel_logprobs
from mp_grpo.integrations.verl.policy_loss import VERL_AGGREGATIONS, VerlPolicyLoss, verl_refusals
from mp_grpo.integrations.verl.registration import PREFIX, RefusedPolicyLoss, register, register_presets

__all__ = [
    "ENV_SWITCH",
    "PREFIX",
    "VERL_AGGREGATIONS",
    "RefusedPolicyLoss",
    "VerlPolicyLoss",
    "lm_head_logprobs",
    "register",
    "register_presets",
    "use_vocab_parallel_logprobs",
    "verl_refusals",
]
