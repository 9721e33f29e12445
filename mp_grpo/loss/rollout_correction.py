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
"""

from __future__ import annotations

import torch

from mp_grpo.config.loss import RatioLevel, RolloutCorrectionConfig
from mp_grpo.loss.clamps import COUNT_FLOOR, WEIGHT_MEAN_FLOOR, symmetric_clamp


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
    if level == RatioLevel.TOKEN:
        return d
    if level == RatioLevel.SEQUENCE:
        return symmetric_clamp(seq_sum_d, clamp)
    return seq_sum_d / seq_count.clamp(min=COUNT_FLOOR)


def truncated_weight(log_ratio: torch.Tensor, cfg: RolloutCorrectionConfig) -> torch.Tensor:
    """``exp(log_ratio)`` truncated to ``[weight_min, weight_max]`` (either may be None), detached."""
    ratio = log_ratio.detach().exp()
    if cfg.weight_min is None and cfg.weight_max is None:
        return ratio
    return ratio.clamp(min=cfg.weight_min, max=cfg.weight_max)


def normalized_weight(weight: torch.Tensor, weight_mean: torch.Tensor) -> torch.Tensor:
    """``weight / mean`` — unless the mean is below :data:`WEIGHT_MEAN_FLOOR` (then ``weight`` unchanged)."""
    mean = weight_mean.to(weight.dtype)
    return weight / torch.where(mean > WEIGHT_MEAN_FLOOR, mean, torch.ones_like(mean))


def kept(log_ratio: torch.Tensor, cfg: RolloutCorrectionConfig) -> torch.Tensor:
    """Bool: the ratio at ``reject_level`` lies in ``[reject_min, reject_max]`` (a None bound never rejects)."""
    ratio = log_ratio.exp()
    keep = torch.ones_like(ratio, dtype=torch.bool)
    if cfg.reject_min is not None:
        keep = keep & (ratio >= cfg.reject_min)
    if cfg.reject_max is not None:
        keep = keep & (ratio <= cfg.reject_max)
    return keep
