"""VESPO's sequence weight (arXiv 2602.10693; TRL / Liger ``get_gamma_weights``, ``loss_type="vespo"``).

Schedule
    1. Token stage (:func:`vespo_token_input`): per valid token clamp(ℓ_t, ±``VESPO_LOG_RATIO_BOUND``) plus, when the
       rollout correction is at token level, clamp(log ρ_t, ``VESPO_LOG_W_MIN``, ``VESPO_LOG_W_MAX``) with
       ρ_t the truncated token IS weight (1 without ``weight_level``), and ρ_t = 0 (→ the floor) where the
       token-level rejection drops the token. The rollout correction enters here instead of multiplying the
       term (TRL folds ``importance_sampling_ratio`` into φ).
    2. Per-sequence sum of that input (whole sequence, all CP ranks): log w = clamp(Σ, VESPO_LOG_W_MIN,
       VESPO_LOG_W_MAX) — a product of ratios, not a geometric mean.
    3. :func:`gamma_weight`: φ(w) = exp(λ + k·log w − λ·w) (so φ(1) = 1), with (k, λ) = (k_pos, λ_pos) where
       A ≥ 0 and (k_neg, λ_neg) where A < 0, λ floored at ``VESPO_LAMBDA_FLOOR``; detached. Where exp
       overflows (only for k·log w + λ beyond ~88 in fp32) φ is 0, as TRL's ``nan_to_num``.
The term is −φ·A·log π_θ (:mod:`.objectives`).
"""

from __future__ import annotations

import torch

from mp_grpo.config.loss import PolicyConfig, RatioLevel, RolloutCorrectionConfig
from mp_grpo.loss.clamps import VESPO_LAMBDA_FLOOR, VESPO_LOG_RATIO_BOUND, VESPO_LOG_W_MAX, VESPO_LOG_W_MIN, symmetric_clamp
from mp_grpo.loss.rollout_correction import kept, truncated_weight


def vespo_token_input(
    log_ratio: torch.Tensor, d: torch.Tensor | None, valid: torch.Tensor, rc: RolloutCorrectionConfig
) -> torch.Tensor:
    """Step 1: the per-token summand of log w, detached, exactly 0 on masked tokens."""
    x = symmetric_clamp(log_ratio.detach(), VESPO_LOG_RATIO_BOUND)
    token = RatioLevel.TOKEN
    if d is not None and (rc.weight_level == token or rc.reject_level == token):
        log_rho = truncated_weight(d, rc).log() if rc.weight_level == token else torch.zeros_like(d)
        if rc.reject_level == token:
            log_rho = torch.where(kept(d, rc), log_rho, torch.full_like(log_rho, VESPO_LOG_W_MIN))
        x = x + log_rho.clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
    return torch.where(valid, x, torch.zeros_like(x))


def sequence_log_weight(seq_sum: torch.Tensor) -> torch.Tensor:
    """Step 2: log w from the per-sequence sum of :func:`vespo_token_input`."""
    return seq_sum.detach().clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)


def gamma_weight(cfg: PolicyConfig, log_w: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Step 3: φ(w), detached, per token (``log_w`` broadcast to the tokens)."""
    nonneg = advantages >= 0
    k = torch.where(nonneg, torch.full_like(log_w, cfg.vespo_k_pos), torch.full_like(log_w, cfg.vespo_k_neg))
    lam = torch.where(nonneg, torch.full_like(log_w, cfg.vespo_lambda_pos), torch.full_like(log_w, cfg.vespo_lambda_neg))
    lam = lam.clamp(min=VESPO_LAMBDA_FLOOR)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp())
    return torch.where(torch.isfinite(phi), phi, torch.zeros_like(phi)).detach()
