"""M2PO ("Second-Moment Trust Policy Optimization", Zheng et al., arXiv 2510.01161): bound the second moment of the
rollout log-ratio over the whole step by dropping its largest outliers.

With d_t = clamp(log π_old(y_t) − log μ(y_t), ±``policy.log_ratio_clamp``) in float64 at every valid token whose old
and rollout log-probs are finite (the d of the rollout correction and of :class:`~mp_grpo.GlobalBatch`'s other
step-level sums), and the candidates C = every such token (``m2po.scope=all``, AReaL) or those with A > 0, d > 0 or
A < 0, d < 0 (``clip_quadrants``, ms-swift):

1. :class:`~mp_grpo.GlobalBatch` gathers d² of the candidates of every micro-batch of every rank of its group
   (:func:`m2po_values`, then ``all_gather_varlen``: 8 bytes a candidate) and takes the step's threshold
   (:func:`m2po_threshold`): sorted ascending, the longest prefix whose mean is ≤ ``m2po.bound`` is kept; the
   threshold τ is the smallest value not in it (+inf when every value is kept).
2. Each micro-batch's loss drops a candidate's policy term where d² ≥ τ
   (:func:`mp_grpo.kernels.token_math.m2po_keep`; both backends take d from the old and rollout log-probs as given,
   in float64, so the comparison sees the very numbers the batch sorted).

A candidate equal to τ is dropped with it: ties are dropped or kept together, whatever their order (the peers'
sort breaks them by position; dropping more of the largest values keeps the remaining mean ≤ the bound, since a
mean never rises when its largest value leaves). The decision depends on the step's multiset of d² only: the same
for any split over ranks and micro-batches, padded, packed or context-parallel. Dropped tokens keep their KL and
entropy terms and stay in every denominator. Metric: ``rejected_frac/m2po``.

Peers: AReaL (``areal/trainer/ppo/actor.py`` ``_apply_m2po_masking``, 4aef98d) takes δ = log μ − log π_prox over
the valid tokens of one loss call (a micro-batch of one rank), masks the largest while the mean of the rest is
≥ the bound (kept: mean < bound), keeps the smallest one when no suffix qualifies, and removes the masked tokens from
its mean's denominator; ms-swift (#9965, ``swift/rl_core/m2po.py``) takes ℓ = log π_θ − log μ of the clip quadrants,
gathered over the data-parallel group per loss call, keeps the ascending prefix with mean ≤ bound (every candidate
masked when none qualifies) and keeps masked tokens in the denominator. ``docs/loss.md`` lists the differences.
"""

from __future__ import annotations

import torch

from mp_grpo.config.loss import M2POConfig, M2POScope
from mp_grpo.kernels import token_math
from mp_grpo.loss.dialect import torch_formula
from mp_grpo.loss.rollout_correction import token_log_ratio

_m2po_keep = torch_formula(token_math.m2po_keep)


def m2po_log_ratio(old: torch.Tensor, rollout: torch.Tensor, valid: torch.Tensor, clamp: float | None) -> torch.Tensor:
    """d = clamp(old − rollout) in float64 from the log-probs as given (0 where not ``valid``): the GlobalBatch's d
    (``step_inputs.finite_log_ratios``) bit for bit."""
    return token_log_ratio(old.detach().double(), rollout.detach().double(), valid, clamp)


def candidates(cfg: M2POConfig, d: torch.Tensor, advantages: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Bool: the valid tokens M2PO may drop (``m2po.scope``); ``advantages`` token-shaped."""
    if cfg.scope == M2POScope.ALL:
        return valid
    return valid & (((advantages > 0) & (d > 0)) | ((advantages < 0) & (d < 0)))


def m2po_values(cfg: M2POConfig, d: torch.Tensor, advantages: torch.Tensor | None, summed: torch.Tensor) -> torch.Tensor:
    """1-D float64: d² of the candidates among the ``summed`` positions of one micro-batch (step 1's local values)."""
    if cfg.scope != M2POScope.ALL and advantages is None:
        raise ValueError("advantages must be given to GlobalBatch.from_rollouts: m2po.scope=clip_quadrants picks the "
                         "candidates by the advantage's sign")
    picked = candidates(cfg, d, advantages, summed) if advantages is not None else summed
    return (d * d)[picked]


def m2po_threshold(values: torch.Tensor, bound: float) -> torch.Tensor:
    """τ (0-dim float64) from every candidate's d² of the step (step 1 of the module docstring); +inf for none.
    No host synchronization."""
    n = values.numel()
    if n == 0:
        return torch.full((), float("inf"), dtype=torch.float64, device=values.device)
    ordered = torch.sort(values.to(torch.float64)).values
    prefix_mean = ordered.cumsum(0) / torch.arange(1, n + 1, dtype=torch.float64, device=values.device)
    kept = (prefix_mean <= bound).to(torch.int64).cumprod(0).sum()  # the leading run: the longest prefix
    first_dropped = ordered[kept.clamp(max=n - 1)]
    return torch.where(kept < n, first_dropped, torch.full((), float("inf"), dtype=torch.float64, device=values.device))


def m2po_keep(cfg: M2POConfig, d: torch.Tensor, threshold: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Bool per token: M2PO keeps the policy term (:func:`mp_grpo.kernels.token_math.m2po_keep`, the kernels')."""
    return _m2po_keep(d, threshold, advantages, cfg.scope == M2POScope.CLIP_QUADRANTS)
