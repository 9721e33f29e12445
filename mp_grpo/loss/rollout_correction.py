"""Rollout correction: importance weights and rejection from the rollout engine's policy to the trainer's.

With ``d_t = clamp(trainer_t − rollout_t, ±policy.log_ratio_clamp)`` on valid tokens (trainer = the old
log-probs, or stopgrad of the current ones in bypass mode), the log-ratio at a level is

* ``token``:     ``d_t``;
* ``sequence``:  ``clamp(Σ_{t∈seq} d_t, ±log_ratio_clamp)`` — the log of the product of token ratios;
* ``geometric``: ``Σ_{t∈seq} d_t / n_seq`` — the log of their geometric mean (within the clamp already).

The weight (TIS) is ``exp`` of the log-ratio at ``weight_level`` truncated to ``[weight_min, weight_max]``,
detached, optionally divided by its global mean (``normalize_weights``, decided once per step by the
:class:`~mp_grpo.GlobalBatch`). Rejection (MIS / IcePop / geometric sequence masking) keeps a token when
the ratio at ``reject_level`` lies in ``[reject_min, reject_max]``.

The level log-ratio, the weight, its normalization and the rejection are the formulas of
:mod:`mp_grpo.kernels.token_math` (one definition for this path and the fused kernels), run on torch tensors.
"""

from __future__ import annotations

import torch

from mp_grpo.config.loss import RatioLevel, RolloutCorrectionConfig
from mp_grpo.kernels import token_math
from mp_grpo.loss.clamps import bound_or_inf, symmetric_clamp
from mp_grpo.loss.dialect import CODES, torch_formula

_floor_count = torch_formula(token_math.floor_count)
_level_log_ratio = torch_formula(token_math.level_log_ratio)
_truncated_weight = torch_formula(token_math.truncated_weight)
_normalized_weight = torch_formula(token_math.normalized_weight)
_rejection_keep = torch_formula(token_math.rejection_keep)

LEVEL_CODES = {RatioLevel.TOKEN: CODES.LEVEL_TOKEN, RatioLevel.SEQUENCE: CODES.LEVEL_SEQUENCE,
               RatioLevel.GEOMETRIC: CODES.LEVEL_GEOMETRIC}
"""A :class:`RatioLevel` as the formulas' ``LEVEL`` code."""


def token_log_ratio(
    trainer: torch.Tensor, rollout: torch.Tensor, valid: torch.Tensor, clamp: float | None
) -> torch.Tensor:
    """``d`` = clamp(trainer − rollout) on valid tokens, exactly 0 elsewhere (inputs may be inf/NaN there)."""
    diff = torch.where(valid, trainer - rollout, torch.zeros((), dtype=trainer.dtype, device=trainer.device))
    return symmetric_clamp(diff.detach(), clamp)


def level_log_ratio(
    level: RatioLevel,
    d: torch.Tensor,
    seq_sum_d: torch.Tensor,
    seq_count: torch.Tensor,
    clamp: float | None,
) -> torch.Tensor:
    """Log-ratio at ``level`` for every token; ``seq_sum_d`` / ``seq_count`` are the per-sequence Σd and valid
    counts broadcast to the tokens (whole sequences, all CP ranks)."""
    count_floor = _floor_count(seq_count) if level == RatioLevel.GEOMETRIC else seq_count
    return _level_log_ratio(d, seq_sum_d, count_floor, bound_or_inf(clamp), LEVEL_CODES[level])


def truncated_weight(log_ratio: torch.Tensor, cfg: RolloutCorrectionConfig) -> torch.Tensor:
    """``exp(log_ratio)`` truncated to ``[weight_min, weight_max]`` (either may be None), detached."""
    return weights(log_ratio, cfg)[1]


def weights(log_ratio: torch.Tensor, cfg: RolloutCorrectionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exp(log_ratio), truncated to [weight_min, weight_max])``, both detached."""
    return _truncated_weight(log_ratio.detach(), bound_or_inf(cfg.weight_min, -1.0), bound_or_inf(cfg.weight_max))


def normalized_weight(weight: torch.Tensor, weight_mean: torch.Tensor) -> torch.Tensor:
    """``weight / mean`` — unless the mean is below :data:`WEIGHT_MEAN_FLOOR` (then ``weight`` unchanged)."""
    return _normalized_weight(weight, weight_mean.to(weight.dtype))


def kept(log_ratio: torch.Tensor, cfg: RolloutCorrectionConfig) -> torch.Tensor:
    """Bool: the ratio at ``reject_level`` lies in ``[reject_min, reject_max]`` (a None bound never rejects)."""
    return _rejection_keep(log_ratio, bound_or_inf(cfg.reject_min, -1.0), bound_or_inf(cfg.reject_max))
