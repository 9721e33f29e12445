"""Which loss configs are token-separable: a token's gradient reads no other token's log-prob or entropy.

For such a config the step's normalizers (token and sequence counts, the IS-weight mean, the entropy
threshold, the skip decision) come from the :class:`~mp_grpo.GlobalBatch` and the per-sequence valid
counts from the mask, so d loss / d logp_t and d loss / d entropy_t are functions of token t's own
inputs: they can be taken from the loss on a partially filled micro-batch (the fused output layer
with the loss in forward, :mod:`mp_grpo.ops.fused_linear_loss`). Not separable — the gradient of a
token reads a per-sequence sum of log-probs of the current policy:

- sequence-mean objectives (``gspo``, ``gmpo``: exp of the sequence's mean log-ratio);
- OPSM (the sequence's mean divergence from the behaviour policy, with stopgrad of log π_θ);
- rollout correction in bypass mode at sequence or geometric level (the trainer log-probs are the
  current ones, summed over the sequence);
- the KL bias correction at sequence or geometric level (``kl.bias_correction_level``: each token's KL is
  weighted by its sequence's ratio of the current policy);
- ``clip_cov`` / ``kl_cov``: whether a token is selected depends on the covariance of the whole micro-batch
  (the mean of the current log-probs over its valid tokens, and the token's rank among the others).
"""

from __future__ import annotations

from mp_grpo.config.loss import LossConfig, RatioLevel
from mp_grpo.loss.covariance import COVARIANCE_OBJECTIVES
from mp_grpo.loss.objectives import needs_sequence_sum


def token_separable(config: LossConfig) -> bool:
    """True when every token's gradient depends only on its own log-prob and entropy (see the module docstring)."""
    if config.policy.objective in COVARIANCE_OBJECTIVES:
        return False
    if needs_sequence_sum(config.policy) or config.opsm.delta is not None:
        return False
    rc = config.rollout_correction
    sequence_levels = (RatioLevel.SEQUENCE, RatioLevel.GEOMETRIC)
    if rc.bypass and (rc.weight_level in sequence_levels or rc.reject_level in sequence_levels):
        return False
    kl = config.kl
    return not (kl.coef != 0.0 and kl.bias_correction and kl.bias_correction_level in sequence_levels)
