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

The formulas of ppo_clip / gspo, cispo, sapo, gmpo and reinforce are those of
:mod:`mp_grpo.kernels.token_math`, run on torch tensors (:mod:`mp_grpo.loss.dialect`): one definition for
this path and the fused kernels. vespo, clip_cov's selection, kl_cov and GSPO-token exist only here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mp_grpo.config.loss import GSPOGradient, Objective, PolicyConfig
from mp_grpo.kernels import token_math
from mp_grpo.loss.clamps import bound_or_inf
from mp_grpo.loss.dialect import torch_formula
from mp_grpo.loss.vespo import gamma_weight, sequence_log_weight

_floor_count = torch_formula(token_math.floor_count)
_clip_range = torch_formula(token_math.clip_range)
_clipped_surrogate = torch_formula(token_math.clipped_surrogate)
_cispo = torch_formula(token_math.cispo)
_sapo = torch_formula(token_math.sapo)
_gmpo_log_clip = torch_formula(token_math.gmpo_log_clip)
_gmpo = torch_formula(token_math.gmpo)
_reinforce = torch_formula(token_math.reinforce)


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
    return seq_sum / _floor_count(seq_count)


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
        low_bound, high_bound = _ratio_bounds(cfg)
        term, _, low, high = _cispo(logprobs, ratio, advantages, low_bound, high_bound)
        return PolicyTerm(term, ratio.detach(), low, high, None)
    if objective == Objective.SAPO:
        ratio = log_ratio.exp()
        tau_pos, tau_neg = (torch.tensor(tau, dtype=ratio.dtype, device=ratio.device)
                            for tau in (cfg.sapo_tau_pos, cfg.sapo_tau_neg))
        term, _ = _sapo(ratio, advantages, tau_pos, tau_neg)
        return PolicyTerm(term, ratio.detach(), None, None, None)
    if objective == Objective.GMPO:
        _, low, high = _gmpo_clipped(cfg, log_ratio, advantages)
        term, _, ratio = _gmpo(seq_value, advantages)
        return PolicyTerm(term, ratio.detach(), low, high, None)
    term, _ = _reinforce(logprobs, advantages)
    return PolicyTerm(term, log_ratio.detach().exp(), None, None, None)


def _ratio_bounds(cfg: PolicyConfig) -> tuple[float, float]:
    """(1 − eps_low, 1 + eps_high), an absent bound ∓inf."""
    return (-math.inf if cfg.eps_low is None else 1.0 - cfg.eps_low,
            math.inf if cfg.eps_high is None else 1.0 + cfg.eps_high)


def clip_ratio(ratio: torch.Tensor, cfg: PolicyConfig) -> torch.Tensor:
    """clip(r, 1 − eps_low, 1 + eps_high), a null bound left open."""
    return _clip_range(ratio, *_ratio_bounds(cfg))


def _ppo_clip(cfg: PolicyConfig, ratio: torch.Tensor, advantages: torch.Tensor) -> PolicyTerm:
    low_bound, high_bound = _ratio_bounds(cfg)
    dual_clip = cfg.dual_clip_c is not None
    term, _, low, high, dual = _clipped_surrogate(
        ratio, advantages, low_bound, high_bound, bound_or_inf(cfg.delta), cfg.dual_clip_c if dual_clip else 0.0,
        dual_clip,
    )
    return PolicyTerm(term, ratio.detach(), low, high, dual if dual_clip else None)


def _gmpo_clipped(
    cfg: PolicyConfig, log_ratio: torch.Tensor, advantages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ℓ clipped one-sidedly in log space, lower clip active, upper clip active)."""
    low_bound = -math.inf if cfg.eps_low is None else -cfg.eps_low
    clipped, _, low, high = _gmpo_log_clip(log_ratio, advantages, low_bound, bound_or_inf(cfg.eps_high))
    return clipped, low, high
