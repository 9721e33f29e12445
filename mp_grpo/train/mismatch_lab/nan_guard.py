"""Experiment (c): unclamped ``exp`` of log-ratios with garbage at masked positions vs mp_grpo.

The seed (a Liger-Kernel fork PR, "clamp log-ratio and k3 KL for numerical stability"): the policy ratio
exp(log π_θ − log π_old) and the k3 KL exp(ref − log π_θ) are computed unbounded, and the reduction is
``(per_token_loss * mask).sum()``. Where a masked position holds garbage, exp overflows fp32 to inf and
``inf * 0 = nan`` spreads over the whole batch — even when every advantage is 0.

:func:`unguarded_loss` is that pattern, reproduced **only here, as the baseline being demonstrated**
(PPO clip, k3 KL with coefficient β, token mean). mp_grpo's :class:`~mp_grpo.GRPOLoss` with the same
settings selects with ``torch.where`` before any arithmetic and clamps every log-ratio (``docs/loss.md``).

Schedule of :func:`run`
    1. One step's rollouts of the tiny policy (no mismatch); its log-probs are the leaf of the gradient;
       clean old and ref log-probs = log π_θ + small noise (so the ratio and the KL are not trivially 1, 0).
    2. For every case, the garbage is written into copies of the inputs at masked positions (or at one
       valid position for the low-probability case).
    3. Loss and gradient w.r.t. the log-probs of both implementations: value, NaN / inf count of the
       gradient, and the largest |gradient| at masked positions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mp_grpo.config import load_config
from mp_grpo.config.loss import LossConfig
from mp_grpo.loss import GRPOLoss
from mp_grpo.train.mismatch_lab.policy import PolicyShape, RolloutEngine, TinyPolicy, make_rollouts

CLEAN_NOISE_STD = 0.05
"""Standard deviation of the noise that makes the clean old / ref log-probs differ from log π_θ."""


@dataclass(frozen=True)
class NaNGuardSetup:
    """What experiment (c) runs."""

    shape: PolicyShape = PolicyShape()
    """Policy and rollout sizes."""
    kl_coef: float = 0.04
    """β of the k3 KL term (TRL's former default)."""
    seed: int = 0
    """Seed of the policy, the sampling and the clean noise."""


@dataclass
class Inputs:
    """The loss inputs of one case (token-shaped ``[B, T]`` except ``advantages`` ``[B]``)."""

    logprobs: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor


def unguarded_loss(cfg: LossConfig, x: Inputs) -> torch.Tensor:
    """UNGUARDED BASELINE (the seed's pattern), for demonstration only: unbounded exp, ``per_token * mask``."""
    eps_low, eps_high = cfg.policy.eps_low, cfg.policy.eps_high
    coef_1 = torch.exp(x.logprobs - x.old)
    coef_2 = coef_1.clamp(1 - eps_low, 1 + eps_high)
    adv = x.advantages[:, None]
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    log_q_over_p = x.ref - x.logprobs
    per_token = per_token + cfg.kl.coef * (torch.exp(log_q_over_p) - log_q_over_p - 1)
    mask = x.mask.float()
    return (per_token * mask).sum() / mask.sum()


def guarded_loss(cfg: LossConfig, x: Inputs) -> torch.Tensor:
    """mp_grpo's GRPOLoss with the same objective, clip range and KL."""
    return GRPOLoss(cfg)(x.logprobs, x.old, x.advantages, x.mask, ref_logprobs=x.ref)[0]


def _masked(x: Inputs, field: str, value: float) -> Inputs:
    """A copy of ``x`` with ``field`` set to ``value`` at every masked position."""
    tensor = getattr(x, field).detach()
    return dataclasses.replace(x, **{field: torch.where(x.mask, tensor, torch.full_like(tensor, value))})


def _low_probability_token(x: Inputs) -> Inputs:
    """A copy of ``x`` whose old log-prob at the first valid token of a negative-advantage sequence is 100
    below the current one: a ratio of e^100, beyond fp32 (a token the old policy gave ~0 probability)."""
    row = int(torch.nonzero(x.advantages < 0)[0, 0])
    old = x.old.clone()
    old[row, 0] = x.logprobs.detach()[row, 0] - 100.0
    return dataclasses.replace(x, old=old)


CASES: dict[str, Callable[[Inputs], Inputs]] = {
    "clean inputs (control)": lambda x: x,
    "old log-probs = -1e4 at padding (fill value)": lambda x: _masked(x, "old", -1e4),
    "old log-probs = -inf at padding": lambda x: _masked(x, "old", -math.inf),
    "policy log-probs = -1e4 at padding (masked logits), KL on": lambda x: _masked(x, "logprobs", -1e4),
    "NaN at padding (uninitialized buffer)": lambda x: _masked(x, "old", math.nan),
    "old = -1e4 at padding, every advantage 0": lambda x: dataclasses.replace(
        _masked(x, "old", -1e4), advantages=torch.zeros_like(x.advantages)),
    "valid token with log-ratio +100 (low-probability token)": _low_probability_token,
}
"""Each case's name and how it corrupts the clean inputs."""


def _evaluate(loss_fn: Callable[[LossConfig, Inputs], torch.Tensor], cfg: LossConfig, x: Inputs) -> dict:
    """Loss value and gradient health of one implementation on one case."""
    logprobs = x.logprobs.detach().requires_grad_(True)
    loss = loss_fn(cfg, dataclasses.replace(x, logprobs=logprobs))
    (grad,) = torch.autograd.grad(loss, logprobs)
    masked_grad = torch.where(x.mask, torch.zeros_like(grad), grad).abs()
    return {"loss": float(loss.detach()), "grad_nonfinite": int((~torch.isfinite(grad)).sum()),
            "grad_elements": grad.numel(), "masked_grad_max": float(masked_grad.nan_to_num(math.inf).max())}


def run(setup: NaNGuardSetup = NaNGuardSetup()) -> dict:
    """Every case with both implementations; JSON-ready."""
    cfg = load_config(None, [f"kl.coef={setup.kl_coef}"])
    # --- 1. rollouts, clean inputs ---
    generator = torch.Generator().manual_seed(setup.seed)
    policy = TinyPolicy(setup.shape, generator)
    rollouts = make_rollouts(policy, RolloutEngine(policy, 0.0), generator)
    with torch.no_grad():
        logits = policy(rollouts.prompts, rollouts.tokens)
        logprobs = torch.log_softmax(logits, -1).gather(-1, rollouts.tokens[..., None])[..., 0]
    noise = lambda: CLEAN_NOISE_STD * torch.randn(logprobs.shape, generator=generator)  # noqa: E731
    clean = Inputs(logprobs, logprobs + noise(), logprobs + noise(), rollouts.advantages, rollouts.loss_mask)
    rows = []
    for name, corrupt in CASES.items():
        # --- 2. the case's inputs ---
        x = corrupt(clean)
        # --- 3. both implementations ---
        rows.append({"case": name, "unguarded": _evaluate(unguarded_loss, cfg, x),
                     "mp_grpo": _evaluate(guarded_loss, cfg, x)})
    return {"experiment": "nan_guard", "setup": dataclasses.asdict(setup), "rows": rows}
