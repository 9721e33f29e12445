"""Per-token policy-gradient surrogates (the loss to minimize; advantages A, clamped log-ratio ℓ = log π_θ/π_old).

* ``ppo_clip``: r = e^ℓ, r2 = clip(r, 1−eps_low, 1+eps_high), r1 = min(r, delta) (delta set) or r;
  term = −min(r1·A, r2·A); with ``dual_clip_c`` = c, where A < 0: min(term, −A·c). (PPO, GRPO, DAPO,
  INTELLECT-2, dual-clip PPO.)
* ``gspo``: the same with r = exp(mean of ℓ over the sequence's valid tokens), one ratio per sequence
  broadcast to its tokens, gradient through every token's log-prob (GSPO, arXiv 2507.18071).
* ``cispo``: −stopgrad(clip(r, 1−eps_low, 1+eps_high))·A·log π_θ (MiniMax-M1, arXiv 2506.13585).
* ``sapo``: −(4/τ)·sigmoid(τ·(r−1))·A with τ = sapo_tau_pos where A > 0, else sapo_tau_neg (arXiv 2511.20347).
* ``gmpo``: per token ℓ clipped one-sidedly in log space — to ≤ eps_high where A > 0, to ≥ −eps_low where
  A < 0 — then g = exp(mean over the sequence of the clipped ℓ), term = −A·g on each of its tokens
  (GMPO, arXiv 2507.20673; TRL's experimental GMPOTrainer).
* ``reinforce``: −A·log π_θ.
* ``vespo``: −stopgrad(φ(w))·A·log π_θ with VESPO's gamma weight of the sequence ratio w (:mod:`.vespo`).
* ``clip_cov``: the ``ppo_clip`` term (without ``delta`` / dual clip); the combine stage zeroes it on the tokens
  :func:`mp_grpo.loss.covariance.covariance_selection` selects (verl multiplies by ``corr`` = 0 there).
* ``kl_cov``: −A·r (no clip), + ``ppo_kl_coef``·|ℓ| on the selected tokens (arXiv 2505.22617; verl).

``policy.gspo_gradient=token`` (GSPO-token, verl): the gspo ratio is exp(stopgrad(m) + ℓ_t − stopgrad(ℓ_t)) —
the value of the sequence ratio, the gradient of token t's own log-prob only.

Per-sequence sums come in already reduced over the sequence (and the context-parallel group);
:func:`sequence_value` turns them into what the objective reads (the mean m, or VESPO's log w).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mp_grpo.config.loss import GSPOGradient, Objective, PolicyConfig
from mp_grpo.loss.clamps import COUNT_FLOOR
from mp_grpo.loss.vespo import gamma_weight, sequence_log_weight


@dataclass(frozen=True)
class PolicyTerm:
    """The surrogate per token and what the metrics report about it."""

    term: torch.Tensor
    """Per-token loss, differentiable; finite everywhere (masking happens later)."""
    ratio: torch.Tensor
    """The objective's ratio per token (the sequence ratio for gspo / gmpo), detached."""
    clipped_low: torch.Tensor | None
    """Bool: the lower clip is active (None for objectives without a clip)."""
    clipped_high: torch.Tensor | None
    """Bool: the upper clip is active."""
    dual_clipped: torch.Tensor | None
    """Bool: the dual clip is active (None without ``dual_clip_c``)."""
    coefficient: torch.Tensor | None = None
    """VESPO's φ(w) per token (None for the other objectives)."""


def needs_sequence_sum(cfg: PolicyConfig) -> bool:
    """Whether the objective needs a per-sequence sum (gspo, gmpo: a mean; vespo: log w)."""
    return cfg.objective in (Objective.GSPO, Objective.GMPO, Objective.VESPO)


def sequence_value(cfg: PolicyConfig, seq_sum: torch.Tensor, seq_count: torch.Tensor) -> torch.Tensor:
    """What the objective reads per sequence (broadcast to its tokens): the mean m = Σ / n (gspo, gmpo; with its
    gradient) or VESPO's log w (detached)."""
    if cfg.objective == Objective.VESPO:
        return sequence_log_weight(seq_sum)
    return seq_sum / seq_count.clamp(min=COUNT_FLOOR)


def sequence_input(cfg: PolicyConfig, log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor | None:
    """The per-token quantity whose sum over each sequence gspo / gmpo need (None: none needed; vespo's input,
    which also reads the rollout correction, is :func:`mp_grpo.loss.vespo.vespo_token_input`).

    gspo: ℓ itself; gmpo: ℓ clipped one-sidedly by the sign of A. Zero on masked tokens when ℓ is.
    """
    if cfg.objective == Objective.GSPO:
        return log_ratio
    if cfg.objective == Objective.GMPO:
        return _gmpo_clipped(cfg, log_ratio, advantages)[0]
    return None


def policy_term(
    cfg: PolicyConfig,
    logprobs: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    seq_value: torch.Tensor | None,
    cov_selected: torch.Tensor | None = None,
) -> PolicyTerm:
    """The surrogate of ``cfg.objective``; ``seq_value`` is :func:`sequence_value` broadcast to the tokens
    (gspo / gmpo / vespo only); ``cov_selected`` the covariance selection (kl_cov only)."""
    objective = cfg.objective
    if objective in (Objective.PPO_CLIP, Objective.CLIP_COV):
        return _ppo_clip(cfg, log_ratio.exp(), advantages)
    if objective == Objective.KL_COV:
        ratio = log_ratio.exp()
        penalty = cfg.ppo_kl_coef * log_ratio.abs()
        penalty = torch.where(cov_selected, penalty, torch.zeros_like(penalty))  # type: ignore[arg-type]
        term = -advantages * ratio + penalty
        return PolicyTerm(term, ratio.detach(), None, None, None)
    if objective == Objective.GSPO:
        log_s = seq_value
        if cfg.gspo_gradient == GSPOGradient.TOKEN:
            log_s = seq_value.detach() + (log_ratio - log_ratio.detach())  # type: ignore[union-attr]
        return _ppo_clip(cfg, log_s.exp(), advantages)  # type: ignore[union-attr]
    if objective == Objective.VESPO:
        phi = gamma_weight(cfg, seq_value, advantages)  # type: ignore[arg-type]
        return PolicyTerm(-phi * advantages * logprobs, seq_value.exp(), None, None, None, phi)  # type: ignore[union-attr]
    if objective == Objective.CISPO:
        ratio = log_ratio.exp()
        weight = clip_ratio(ratio, cfg).detach()
        low, high = _clip_flags(ratio, cfg)
        return PolicyTerm(-weight * advantages * logprobs, ratio.detach(), low, high, None)
    if objective == Objective.SAPO:
        ratio = log_ratio.exp()
        tau = torch.where(advantages > 0, torch.full_like(ratio, cfg.sapo_tau_pos), torch.full_like(ratio, cfg.sapo_tau_neg))
        term = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * advantages
        return PolicyTerm(term, ratio.detach(), None, None, None)
    if objective == Objective.GMPO:
        _, low, high = _gmpo_clipped(cfg, log_ratio, advantages)
        ratio = seq_value.exp()  # type: ignore[union-attr]
        return PolicyTerm(-advantages * ratio, ratio.detach(), low, high, None)
    return PolicyTerm(-advantages * logprobs, log_ratio.detach().exp(), None, None, None)


def clip_ratio(ratio: torch.Tensor, cfg: PolicyConfig) -> torch.Tensor:
    """clip(r, 1 − eps_low, 1 + eps_high), a null bound left open."""
    low = None if cfg.eps_low is None else 1.0 - cfg.eps_low
    high = None if cfg.eps_high is None else 1.0 + cfg.eps_high
    if low is None and high is None:
        return ratio
    return ratio.clamp(min=low, max=high)


def _clip_flags(ratio: torch.Tensor, cfg: PolicyConfig) -> tuple[torch.Tensor, torch.Tensor]:
    low = ratio < 1.0 - cfg.eps_low if cfg.eps_low is not None else torch.zeros_like(ratio, dtype=torch.bool)
    high = ratio > 1.0 + cfg.eps_high if cfg.eps_high is not None else torch.zeros_like(ratio, dtype=torch.bool)
    return low, high


def _ppo_clip(cfg: PolicyConfig, ratio: torch.Tensor, advantages: torch.Tensor) -> PolicyTerm:
    r2 = clip_ratio(ratio, cfg)
    r1 = ratio if cfg.delta is None else ratio.clamp(max=cfg.delta)
    u1, u2 = r1 * advantages, r2 * advantages
    term = -torch.where(u1 <= u2, u1, u2)  # −min(r1·A, r2·A); ties take the unclipped branch
    dual = None
    if cfg.dual_clip_c is not None:
        cap = -advantages * cfg.dual_clip_c
        dual = (advantages < 0) & (term > cap)
        term = torch.where(dual, cap, term)
    low, high = _clip_flags(ratio, cfg)
    return PolicyTerm(term, ratio.detach(), low & (advantages < 0), high & (advantages > 0), dual)


def _gmpo_clipped(
    cfg: PolicyConfig, log_ratio: torch.Tensor, advantages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ℓ clipped one-sidedly in log space, lower clip active, upper clip active)."""
    no = torch.zeros_like(log_ratio, dtype=torch.bool)
    high = (advantages > 0) & (log_ratio > cfg.eps_high) if cfg.eps_high is not None else no
    low = (advantages < 0) & (log_ratio < -cfg.eps_low) if cfg.eps_low is not None else no
    clipped = log_ratio
    if cfg.eps_high is not None:
        clipped = torch.where(high, torch.full_like(log_ratio, cfg.eps_high), clipped)
    if cfg.eps_low is not None:
        clipped = torch.where(low, torch.full_like(log_ratio, -cfg.eps_low), clipped)
    return clipped, low, high
