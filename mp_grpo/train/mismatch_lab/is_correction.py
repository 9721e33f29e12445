"""Experiment (a): the same batch's gradient with the rollout IS correction applied vs omitted.

The Liger-Kernel #1082 report (TRL 0.27.2, ``use_liger_kernel=True``): TRL's own loss multiplies every
sequence's per-token loss by the sequence-level IS ratio π_old/π_vLLM (``sequence_mask`` mode: ratios
above 3 set to 0), Liger's fused loss silently omits it; with the ratio's mean at 0.003–0.01 the grad norm
came out ~100× too large (31.09 vs 0.29).

Schedule of :func:`run` (for each mismatch level ``noise_std`` of the grid)
    1. A fresh tiny policy (same seed for every level) and a :class:`~.policy.RolloutEngine` at that level
       sample one step's rollouts; the engine's log-probs are the rollout log-probs.
    2. One trainer forward (fp32, ``vocab_parallel_logprobs``); on-policy first step: old = log π_θ detached.
    3. The mismatch, measured on the valid tokens with mp_grpo's own formulas: d = old − rollout; per
       sequence the ratio exp(clamp(Σ d)) ("raw"), and the weight the config applies — ratio where kept by
       the rejection, 0 where rejected ("applied"); their means over sequences; vllm-kl = mean k3(d).
    4. ``GRPOLoss(config)`` and ``GRPOLoss(config without rollout correction)`` on the same log-probs; the
       loss and the L2 norm of the gradient over all policy parameters of each.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mp_grpo.config import load_config, preset_path
from mp_grpo.config.loss import LossConfig, RatioLevel
from mp_grpo.loss import GRPOLoss, reduce_metrics
from mp_grpo.loss.clamps import symmetric_clamp
from mp_grpo.loss.rollout_correction import kept, truncated_weight
from mp_grpo.train.mismatch_lab.policy import PolicyShape, RolloutEngine, TinyPolicy, make_rollouts, trainer_logprobs


@dataclass(frozen=True)
class ISCorrectionSetup:
    """What experiment (a) runs."""

    shape: PolicyShape = PolicyShape()
    """Policy and rollout sizes."""
    noise_levels: tuple[float, ...] = (0.0, 0.5, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0)
    """The engine's logit-noise standard deviations (the mismatch knob)."""
    preset: str = "trl_dapo"
    """The loss preset whose rollout correction is applied (TRL's default: sequence-level ratio, sequences
    with a ratio above 3 rejected)."""
    seed: int = 0
    """Seed of the policy initialization and of the engine's sampling."""


def without_correction(cfg: LossConfig) -> LossConfig:
    """``cfg`` with both rollout-correction levels off (TRL's ``vllm_importance_sampling_correction=False``)."""
    return dataclasses.replace(cfg, rollout_correction=dataclasses.replace(
        cfg.rollout_correction, weight_level=None, weight_min=None, weight_max=None,
        reject_level=None, reject_min=None, reject_max=None, normalize_weights=False))


def sequence_is_weights(cfg: LossConfig, old: torch.Tensor, rollout: torch.Tensor,
                        mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence ``[B]``: the raw sequence IS ratio exp(clamp(Σ d)) and the weight ``cfg`` applies to the
    sequence (its weight-level ratio, truncated, × 0 where its reject-level ratio is rejected).

    Only for configs whose weight and reject levels are sequence-level (the value is one per sequence).
    """
    rc = cfg.rollout_correction
    for level in (rc.weight_level, rc.reject_level):
        if level not in (None, RatioLevel.SEQUENCE, RatioLevel.GEOMETRIC):
            raise ValueError(f"rollout_correction levels must be sequence-level here, got {level}")
    clamp = cfg.policy.log_ratio_clamp
    d = symmetric_clamp(torch.where(mask, old - rollout, torch.zeros_like(old)), clamp)
    seq_sum = d.sum(1)
    seq_log = {RatioLevel.SEQUENCE: symmetric_clamp(seq_sum, clamp),
               RatioLevel.GEOMETRIC: seq_sum / mask.sum(1).clamp(min=1)}
    raw = seq_log[RatioLevel.SEQUENCE].exp()
    weight = torch.ones_like(raw) if rc.weight_level is None else truncated_weight(seq_log[rc.weight_level], rc)
    if rc.reject_level is not None:
        weight = torch.where(kept(seq_log[rc.reject_level], rc), weight, torch.zeros_like(weight))
    return raw, weight


def grad_norm(loss: torch.Tensor, params: list[torch.Tensor]) -> float:
    """L2 norm of ∂loss/∂params over all parameters (the graph is kept for another loss)."""
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)))


def measure_level(setup: ISCorrectionSetup, cfg: LossConfig, noise_std: float) -> dict[str, float]:
    """One row of the table: the mismatch statistics, loss and grad norm with and without the correction."""
    # --- 1. policy, engine, rollouts ---
    generator = torch.Generator().manual_seed(setup.seed)
    policy = TinyPolicy(setup.shape, generator)
    rollouts = make_rollouts(policy, RolloutEngine(policy, noise_std), generator)
    # --- 2. trainer forward; on-policy first step ---
    logprobs = trainer_logprobs(policy, rollouts)
    old = logprobs.detach()
    # --- 3. the mismatch ---
    raw, applied = sequence_is_weights(cfg, old, rollouts.rollout_logprobs, rollouts.loss_mask)
    # --- 4. loss and grad norm with and without the correction ---
    params = list(policy.parameters())
    row: dict[str, float] = {"noise_std": noise_std}
    for name, c in (("with", cfg), ("without", without_correction(cfg))):
        loss, metrics = GRPOLoss(c)(logprobs, old, rollouts.advantages, rollouts.loss_mask,
                                    rollout_logprobs=rollouts.rollout_logprobs)
        row[f"loss_{name}"] = float(loss.detach())
        row[f"grad_norm_{name}"] = grad_norm(loss, params)
        if name == "with":
            row["vllm_kl_k3"] = reduce_metrics([metrics])["mismatch/k3"]
    row.update(
        is_raw_mean=float(raw.double().mean()), is_raw_median=float(raw.double().median()),
        is_applied_mean=float(applied.double().mean()),
        rejected_sequences=float((applied == 0).double().mean()),
        grad_norm_ratio=row["grad_norm_without"] / row["grad_norm_with"],
    )
    return row


def run(setup: ISCorrectionSetup = ISCorrectionSetup()) -> dict:
    """Every level of ``setup.noise_levels``; JSON-ready."""
    cfg = load_config(preset_path(setup.preset))
    rows = [measure_level(setup, cfg, s) for s in setup.noise_levels]
    return {"experiment": "is_correction", "preset": setup.preset, "setup": dataclasses.asdict(setup), "rows": rows}
