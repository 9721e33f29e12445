"""The token selection of verl's covariance objectives ``clip_cov`` and ``kl_cov`` (Cui et al., "The Entropy
Mechanism of Reinforcement Learning for Reasoning Language Models", arXiv 2505.22617; verl
``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_clip_cov`` / ``compute_policy_loss_kl_cov``).

Both pick tokens by the token-wise covariance between the advantage and the current log-prob,
cov_t = (A_t − Ā)·(log π_θ(y_t) − mean log π_θ), the means taken over the valid tokens of the call; the
objectives' terms are in :mod:`.objectives` (clip_cov: the PPO clip, zeroed on the selected tokens in the
combine stage; kl_cov: −A·r + ``ppo_kl_coef``·|ℓ| on the selected tokens, −A·r elsewhere).

Schedule of :func:`covariance_selection`
    1. :func:`covariance`: cov_t per valid token, in float64, detached; −inf on masked tokens.
    2. The count n_sel = max(⌊ratio · n⌋, 1) for the call's n valid tokens (``clip_cov_ratio`` /
       ``kl_cov_ratio``), a device tensor.
    3. clip_cov (:func:`_clip_cov_selected`): the candidates are the valid tokens the PPO clip leaves
       unclipped (−A·clip(r) > −A·r is false) with ``clip_cov_lb`` < cov_t < ``clip_cov_ub``; a uniform random
       subset of min(n_sel, #candidates) of them is selected. kl_cov (:func:`_kl_cov_selected`): the n_sel
       valid tokens with the largest cov_t.
    Both selections rank with one stable sort of the call's tokens and compare the rank with n_sel on the
    device: no host synchronization (verl reads n to the host and gathers the candidates' indices).

Randomness (clip_cov): each token position gets a key u ~ U[0, 1) in float64,
``torch.rand(token_shape, generator=generator, dtype=torch.float64, device=...)``, and the candidates with
the n_sel smallest keys are selected — the same distribution as verl's prefix of ``torch.randperm`` over
the candidates. Given the same ``generator`` state, tokens and layout, the selection is the same on every
run; ``generator=None`` draws from the device's default generator (as verl does). The keys are drawn for
every position of the call's token tensor, so padding or packing moves them.

The exception to the step's account (deliberate, verl's semantics): the means, n and the selection are
those of the *call* — verl runs them per micro-batch (``dp_actor`` calls the policy loss per micro-batch;
each DP rank sees its own). Every other normaliser comes from the :class:`~mp_grpo.GlobalBatch`, so a
different micro-batch split changes only which tokens are selected. Under context parallelism a call holds
only part of each sequence; the selection would need the covariances of the whole micro-batch across the
CP group (a gather and a global rank), so :class:`~mp_grpo.GRPOLoss` refuses these objectives with a CP
group of size > 1.

Differences from verl's code: the means are exact (verl divides by n + 1e-8) and cov is taken in float64
(verl: the log-prob dtype); both matter only for a token exactly at a bound or a tie. kl_cov breaks ties in
cov by the lower flat index (verl: ``torch.topk``'s unspecified order).
"""

from __future__ import annotations

import torch

from mp_grpo.config.loss import Objective, PolicyConfig
from mp_grpo.loss.clamps import COUNT_FLOOR
from mp_grpo.loss.objectives import clip_ratio

COVARIANCE_OBJECTIVES = (Objective.CLIP_COV, Objective.KL_COV)
"""The objectives that select tokens by covariance (their selection is per call; see the module docstring)."""


def covariance(logprobs: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Step 1: (A − Ā)·(log π − mean log π) per valid token over the call's valid tokens; float64, detached,
    −inf on masked tokens. ``logprobs`` / ``advantages`` must be finite on valid tokens (masked ones are
    never read)."""
    zero = torch.zeros((), dtype=torch.float64, device=logprobs.device)
    lp = torch.where(valid, logprobs.detach().to(torch.float64), zero)
    adv = torch.where(valid, advantages.detach().to(torch.float64), zero)
    n = valid.sum().to(torch.float64).clamp(min=COUNT_FLOOR)
    cov = (adv - adv.sum() / n) * (lp - lp.sum() / n)
    return torch.where(valid, cov, torch.full_like(cov, -torch.inf))


def covariance_selection(
    cfg: PolicyConfig,
    logprobs: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor | None:
    """Bool per token: the tokens clip_cov zeroes / kl_cov penalizes in this call (None for other objectives).

    ``log_ratio`` is the (clamped) ℓ = log π_θ − log π_old the objective uses; ``generator`` feeds clip_cov's
    random keys (see the module docstring)."""
    if cfg.objective not in COVARIANCE_OBJECTIVES:
        return None
    # --- 1. ---
    cov = covariance(logprobs, advantages, valid)
    # --- 2. ---
    ratio = cfg.clip_cov_ratio if cfg.objective == Objective.CLIP_COV else cfg.kl_cov_ratio
    n_sel = torch.floor(valid.sum().to(torch.float64) * ratio).clamp(min=1.0)
    # --- 3. ---
    if cfg.objective == Objective.CLIP_COV:
        return _clip_cov_selected(cfg, cov, log_ratio, advantages, valid, n_sel, generator)
    return _kl_cov_selected(cov, valid, n_sel)


def _clip_cov_selected(
    cfg: PolicyConfig, cov: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor,
    n_sel: torch.Tensor, generator: torch.Generator | None,
) -> torch.Tensor:
    ratio = log_ratio.detach().exp()
    adv = advantages.detach()
    clipped = -adv * clip_ratio(ratio, cfg) > -adv * ratio  # verl's clip_by_origin: the PPO clip binds
    candidate = valid & ~clipped & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    keys = torch.rand(cov.shape, generator=generator, dtype=torch.float64, device=cov.device)
    keys = torch.where(candidate, keys, torch.full_like(keys, torch.inf))  # candidates rank first
    return candidate & (_rank(keys) < n_sel)


def _kl_cov_selected(cov: torch.Tensor, valid: torch.Tensor, n_sel: torch.Tensor) -> torch.Tensor:
    keys = torch.where(valid, -cov, torch.full_like(cov, torch.inf))  # largest cov first, masked last
    return valid & (_rank(keys) < n_sel)


def _rank(keys: torch.Tensor) -> torch.Tensor:
    """Each entry's position in the ascending stable order of ``keys`` (flattened; ties: lower flat index first)."""
    order = torch.argsort(keys.reshape(-1), stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return rank.reshape(keys.shape)
