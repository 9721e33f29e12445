"""Experiment (b): a per-micro-batch normalizer vs mp_grpo's global one, over splits of the same step.

The Liger-Kernel #1082 report, difference #2: Liger's DAPO/CISPO loss divides each micro-batch's token
sum by *that micro-batch's* valid-token count, and TRL then divides by the gradient-accumulation steps;
TRL's own loss divides by the valid tokens of the whole generation batch. With micro-batches of unequal
token counts the first gives every micro-batch the same total weight whatever its size, so the step's
gradient depends on how the step happens to be split.

:func:`per_micro_batch_normalized` is that bug, reproduced **only here, as the baseline being
demonstrated**: :class:`~mp_grpo.GRPOLoss` called with ``batch=None`` treats its micro-batch as the whole
step (normalizes by the micro-batch's own count) and the result is divided by the number of micro-batches.
mp_grpo's way is :func:`global_normalized`: one :class:`~mp_grpo.GlobalBatch` for the step.

Schedule of :func:`run`
    1. One step's rollouts (no mismatch) with completion lengths uniform in [min_length, max_length];
       one trainer forward for all sequences; on-policy (old = log π_θ detached).
    2. For every split K: the sequences in K contiguous micro-batches, each cut to its own longest
       completion (its own padded width, as a packer would produce — unequal token counts).
    3. For each normalizer: the sum of the K micro-batch losses (what gradient accumulation sums) and its
       gradient over all policy parameters.
    4. The relative L2 change of that gradient from the K = 1 gradient.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

import torch

from mp_grpo.config import load_config, preset_path
from mp_grpo.config.loss import LossConfig
from mp_grpo.loss import GlobalBatch, GRPOLoss
from mp_grpo.train.mismatch_lab.is_correction import without_correction
from mp_grpo.train.mismatch_lab.policy import PolicyShape, RolloutEngine, TinyPolicy, make_rollouts, trainer_logprobs


class SequenceOrder(str, Enum):
    """How the step's sequences are ordered before being cut into contiguous micro-batches."""

    SAMPLED = "sampled"
    """As sampled (prompt by prompt): micro-batch token counts differ by chance."""
    BY_LENGTH = "by_length"
    """Sorted by completion length, as length-bucketing samplers and sequence packers group them: short and
    long micro-batches."""


@dataclass(frozen=True)
class NormalizerSetup:
    """What experiment (b) runs."""

    shape: PolicyShape = PolicyShape(min_length=1, max_length=16)
    """Policy and rollout sizes (wide length range: unequal micro-batches)."""
    splits: tuple[int, ...] = (1, 2, 4, 8)
    """Numbers of micro-batches the step is split into; 1 is the reference."""
    orders: tuple[SequenceOrder, ...] = (SequenceOrder.SAMPLED, SequenceOrder.BY_LENGTH)
    """Sequence orders to try."""
    preset: str = "trl_dapo"
    """Loss preset (token_mean: DAPO's normalizer), its rollout correction off (no mismatch here)."""
    seed: int = 0
    """Seed of the policy initialization and of the sampling."""


@dataclass
class MicroBatch:
    """Token-shaped slices ``[b, L]`` of one micro-batch (L its own longest completion)."""

    logprobs: torch.Tensor
    old: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor


def split(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, k: int,
          order: SequenceOrder) -> list[MicroBatch]:
    """K contiguous micro-batches of the rows in ``order``, each cut to its own longest completion."""
    rows_in_order = torch.arange(mask.shape[0])
    if order == SequenceOrder.BY_LENGTH:
        rows_in_order = torch.argsort(mask.sum(1), stable=True)
    out = []
    for rows in rows_in_order.tensor_split(k):
        width = int(mask[rows].sum(1).max())
        lp = logprobs[rows, :width]
        out.append(MicroBatch(lp, lp.detach(), advantages[rows], mask[rows, :width]))
    return out


def global_normalized(cfg: LossConfig, micro_batches: list[MicroBatch]) -> torch.Tensor:
    """mp_grpo: the sum of the micro-batches' shares of the step, all normalized by one GlobalBatch."""
    loss_fn = GRPOLoss(cfg)
    batch = GlobalBatch.from_masks([mb.loss_mask for mb in micro_batches])
    return sum(loss_fn(mb.logprobs, mb.old, mb.advantages, mb.loss_mask, batch=batch)[0] for mb in micro_batches)


def per_micro_batch_normalized(cfg: LossConfig, micro_batches: list[MicroBatch]) -> torch.Tensor:
    """BUGGY BASELINE (Liger-Kernel #1082, difference #2), for demonstration only: each micro-batch normalized
    by its own valid-token count, then divided by the gradient-accumulation steps K."""
    loss_fn = GRPOLoss(cfg)
    k = len(micro_batches)
    return sum(loss_fn(mb.logprobs, mb.old, mb.advantages, mb.loss_mask, batch=None)[0] / k for mb in micro_batches)


NORMALIZERS = {"global (mp_grpo GlobalBatch)": global_normalized,
               "per-micro-batch (bug baseline)": per_micro_batch_normalized}
"""The two normalizers compared, by the label the tables use."""


def flat_grad(loss: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """∂loss/∂params flattened into one float64 vector (the graph is kept)."""
    grads = torch.autograd.grad(loss, params, retain_graph=True)
    return torch.cat([g.reshape(-1) for g in grads]).double()


def run(setup: NormalizerSetup = NormalizerSetup()) -> dict:
    """Every split and normalizer; JSON-ready."""
    cfg = without_correction(load_config(preset_path(setup.preset)))
    # --- 1. rollouts and one trainer forward ---
    generator = torch.Generator().manual_seed(setup.seed)
    policy = TinyPolicy(setup.shape, generator)
    rollouts = make_rollouts(policy, RolloutEngine(policy, 0.0), generator)
    logprobs = trainer_logprobs(policy, rollouts)
    params = list(policy.parameters())
    rows, reference = [], {}
    for order in setup.orders:
        for k in setup.splits:
            # --- 2. the split ---
            mbs = split(logprobs, rollouts.advantages, rollouts.loss_mask, k, order)
            tokens = [int(mb.loss_mask.sum()) for mb in mbs]
            for name, normalizer in NORMALIZERS.items():
                # --- 3. summed loss and its gradient ---
                loss = normalizer(cfg, mbs)
                grad = flat_grad(loss, params)
                reference.setdefault(name, grad)  # K = 1 is the same step in every order
                # --- 4. change from the one-micro-batch gradient ---
                change = float((grad - reference[name]).norm() / reference[name].norm())
                rows.append({"order": order.value, "normalizer": name, "micro_batches": k,
                             "tokens_per_micro_batch": tokens, "loss": float(loss.detach()),
                             "grad_norm": float(grad.norm()), "relative_grad_change": change})
    return {"experiment": "normalizer", "preset": setup.preset, "setup": dataclasses.asdict(setup),
            "total_tokens": int(rollouts.loss_mask.sum()), "rows": rows}
