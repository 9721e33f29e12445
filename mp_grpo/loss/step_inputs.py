"""This rank's micro-batches as the step's account reads them: checked, then reduced to local sums.

:meth:`GlobalBatch.from_rollouts <mp_grpo.loss.global_batch.GlobalBatch.from_rollouts>` takes per-micro-batch
lists (loss masks, layouts, old / rollout / reference log-probs, advantages, entropies). The helpers here check
each list against the masks (its length, each tensor's type and shape, naming the argument and index) and turn
them into what the step's one all-reduce adds up: the valid positions with a non-finite input, the log-ratios
d = old − rollout where both are finite, and the IS-weight and k3 sums of the step-level statistics. Nothing here
makes a collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import torch

from mp_grpo.config.loss import RatioLevel, RolloutCorrectionConfig
from mp_grpo.loss.mismatch import k3
from mp_grpo.loss.rollout_correction import level_log_ratio, token_log_ratio, truncated_weight
from mp_grpo.loss.sequence import PaddedSequences, SequenceLayout


def as_list(name: str, value: object) -> list:
    """``value`` as a list of per-micro-batch entries; TypeError naming ``name`` unless it is a list or tuple."""
    if isinstance(value, (list, tuple)):
        return list(value)
    _not_a_list(name, value)


def _not_a_list(name: str, value: object) -> NoReturn:
    raise TypeError(f"{name} must be a list (or tuple) of per-micro-batch tensors, got {type(value).__name__}")


def resolve_layouts(layouts: Sequence[SequenceLayout | None] | None, n: int) -> list[SequenceLayout]:
    """One :class:`SequenceLayout` per micro-batch (None: padded ``[B, T]``), all sharing one CP group."""
    if layouts is None:
        return [PaddedSequences()] * n
    if not isinstance(layouts, (list, tuple)) or len(layouts) != n:
        raise ValueError(f"layouts must be a list of one SequenceLayout (or None) per micro-batch ({n}), got {layouts!r}")
    resolved = [PaddedSequences() if lay is None else lay for lay in layouts]
    for i, lay in enumerate(resolved):
        if not isinstance(lay, SequenceLayout):
            raise TypeError(f"layouts[{i}] must be a SequenceLayout or None, got {type(lay).__name__}")
        if lay.cp_group is not resolved[0].cp_group:
            raise ValueError(f"layouts[{i}] has another cp_group than layouts[0]: all micro-batches share one CP group")
    return resolved


def per_micro_batch(
    name: str, tensors: Sequence[torch.Tensor] | None, shapes: list[tuple[int, ...]], why: str
) -> list[torch.Tensor]:
    """``tensors`` checked: given (``why`` needs it), one floating-point tensor per micro-batch of its mask's shape."""
    if tensors is None:
        raise ValueError(f"{name} must be given (one tensor per micro-batch): {why} needs it")
    tensors = as_list(name, tensors)
    if len(tensors) != len(shapes):
        raise ValueError(f"{name} has {len(tensors)} tensors but masks has {len(shapes)} micro-batches")
    for i, (t, shape) in enumerate(zip(tensors, shapes)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name}[{i}] must be a floating-point tensor")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}[{i}] has shape {tuple(t.shape)}, masks[{i}] has {shape}")
    return tensors


def nonfinite_positions(
    valid: list[torch.Tensor], layouts: list[SequenceLayout], shapes: list[tuple[int, ...]], **inputs
) -> torch.Tensor:
    """0-dim float64: valid positions of this rank's micro-batches where any given input is NaN or ±inf (per-sequence
    advantages broadcast to their tokens). ``inputs``: name → per-micro-batch list, or None (not given)."""
    count = torch.zeros((), dtype=torch.float64, device=valid[0].device)
    given = {name: value for name, value in inputs.items() if value is not None}
    for name, value in given.items():
        if not isinstance(value, (list, tuple)) or len(value) != len(shapes):
            raise ValueError(f"{name} must be a list of one tensor per micro-batch ({len(shapes)}), got {value!r}")
    for i, (v, layout, shape) in enumerate(zip(valid, layouts, shapes)):
        bad = torch.zeros(shape, dtype=torch.bool, device=v.device)
        for name, value in given.items():
            bad = bad | ~torch.isfinite(_token_shaped(name, i, value[i], layout, shape))
        count = count + (v & bad).sum(dtype=torch.float64)
    return count


def token_advantages(advantages: Sequence[torch.Tensor], layouts: list[SequenceLayout],
                     shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Per micro-batch, the advantages token-shaped (per-sequence ones broadcast to their tokens), checked."""
    advantages = as_list("advantages", advantages)
    if len(advantages) != len(shapes):
        raise ValueError(f"advantages has {len(advantages)} tensors but masks has {len(shapes)} micro-batches")
    return [_token_shaped("advantages", i, a, layout, shape)
            for i, (a, layout, shape) in enumerate(zip(advantages, layouts, shapes))]


def _token_shaped(name: str, i: int, x: object, layout: SequenceLayout, shape: tuple[int, ...]) -> torch.Tensor:
    """``name[i]`` checked (a floating-point tensor of the mask's shape; advantages may be per sequence, then
    broadcast to their tokens)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{name}[{i}] must be a floating-point tensor")
    if name == "advantages":
        if layout.is_per_sequence(x.shape, torch.Size(shape), f"advantages[{i}]"):
            x = layout.broadcast(x, torch.Size(shape))
    elif tuple(x.shape) != shape:
        raise ValueError(f"{name}[{i}] has shape {tuple(x.shape)}, masks[{i}] has {shape}")
    return x


def finite_log_ratios(
    old: list[torch.Tensor], rollout: list[torch.Tensor], valid: list[torch.Tensor], clamp: float | None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per micro-batch: the positions the step-level sums read (valid, old and rollout both finite: a NaN or inf is
    never summed) and d = old − rollout there, float64 (``clamp``: the policy's log-ratio clamp).

    float64 whatever the inputs' dtype: the weight mean and the mismatch k3 are then the float64 values of the weights
    the loss applies in its compute dtype (bf16 d itself rounds: −0.453 − 0.385 = −0.838 → −0.836, and the normalized
    weights' mean missed 1; float32 d missed it by 1e-9 in a float64 loss).
    """
    summed = [v & torch.isfinite(o) & torch.isfinite(r) for o, r, v in zip(old, rollout, valid)]
    ds = [token_log_ratio(o.double(), r.double(), f, clamp) for o, r, f in zip(old, rollout, summed)]
    return ds, summed


def is_weight_sums(
    rc: RolloutCorrectionConfig, ds: list[torch.Tensor], summed: list[torch.Tensor], per_seq: list[torch.Tensor],
    owner: float, clamp: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's sum and count of the truncated IS weights (``normalize_weights``), as 0-dim float64.

    Token level: over the summed positions. Sequence level (and geometric): one weight per sequence with a valid
    token, from ``per_seq`` (its whole-sequence ``[count, Σd]`` after the CP all-reduce), counted on the rank that
    ``owner`` (1 or 0) marks as owning the sequences.
    """
    zero = torch.zeros((), dtype=torch.float64, device=ds[0].device)
    if rc.weight_level == RatioLevel.TOKEN:
        w_sum = sum(torch.where(f, truncated_weight(d, rc), zero).sum() for d, f in zip(ds, summed))
        return w_sum, sum(f.sum(dtype=torch.float64) for f in summed)
    w_sum = w_count = zero
    for p in per_seq:
        count, sum_d = p[:, 0], p[:, 1]
        w = truncated_weight(level_log_ratio(rc.weight_level, sum_d, sum_d, count, clamp), rc)
        has = count > 0
        w_sum = w_sum + owner * torch.where(has, w, zero).sum()
        w_count = w_count + owner * has.sum(dtype=torch.float64)
    return w_sum, w_count


def k3_sum(ds: list[torch.Tensor], summed: list[torch.Tensor]) -> torch.Tensor:
    """This rank's Σ k3(old ‖ rollout) over the summed positions (``mismatch.skip_threshold``), 0-dim float64."""
    zero = torch.zeros((), dtype=torch.float64, device=ds[0].device)
    return sum(torch.where(f, k3(d), zero).sum() for d, f in zip(ds, summed))
