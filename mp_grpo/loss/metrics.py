"""Metrics that reduce exactly over micro-batches and ranks, and :func:`reduce_metrics`.

Each metric dict maps a name to a float64 tensor:

* a **mean** entry is ``[sum, count]`` (Megatron's ``loss_reduced`` convention): summing the pairs over
  micro-batches and ranks and dividing gives the exact mean over the whole step;
* an entry whose name ends in ``/min`` or ``/max`` is a 0-dim tensor reduced with min / max (+inf / −inf
  when the micro-batch has nothing to report).

Step totals (the loss, the valid-token count, the skip flag) use ``[value, 1 / M]`` with M the number of
(rank, micro-batch) pairs of the step, so that Σ value / Σ count = Σ value.

Metrics are per token unless named ``.../seq_*``; per-sequence entries are counted once per sequence (on
context-parallel rank 0). Reduce over the data-parallel group (DP×CP under context parallelism), never
over tensor-parallel ranks, which hold copies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from mp_grpo.collectives import (
    ProcessGroup, all_reduce_max, all_reduce_sum, broadcast_object_from_last, group_size, is_last_rank,
)
from mp_grpo.ops.checks import check_errors

MIN_SUFFIX = "/min"
MAX_SUFFIX = "/max"


def mean_entry(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[Σ values where mask, count of mask]`` as float64 (masked values are never read)."""
    picked = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return torch.stack([picked.sum().to(torch.float64), mask.sum().to(torch.float64)])


def min_entry(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Minimum of ``values`` where ``mask`` (float64 0-dim; +inf when the mask is empty)."""
    inf = torch.full((), float("inf"), dtype=torch.float64, device=values.device)  # a fill, not a host copy
    return torch.where(mask, values.to(torch.float64), inf).amin() if values.numel() else inf


def max_entry(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Maximum of ``values`` where ``mask`` (float64 0-dim; −inf when the mask is empty)."""
    ninf = torch.full((), float("-inf"), dtype=torch.float64, device=values.device)
    return torch.where(mask, values.to(torch.float64), ninf).amax() if values.numel() else ninf


def total_entry(value: torch.Tensor, num_micro_batches: torch.Tensor) -> torch.Tensor:
    """``[value, 1 / M]``: reduces to the sum of ``value`` over the step's M (rank, micro-batch) pairs."""
    return torch.stack([value.detach().to(torch.float64), 1.0 / num_micro_batches.to(torch.float64)])


def stats_entries(name: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``name/mean``, ``name/min`` and ``name/max`` of ``values`` where ``mask``."""
    return {
        f"{name}/mean": mean_entry(values, mask),
        f"{name}{MIN_SUFFIX}": min_entry(values, mask),
        f"{name}{MAX_SUFFIX}": max_entry(values, mask),
    }


def reduce_metrics(
    metrics: Sequence[Mapping[str, torch.Tensor]],
    group: ProcessGroup | None = None,
    *,
    pp_group: ProcessGroup | None = None,
) -> dict[str, float]:
    """Exact step values from the metric dicts of this rank's micro-batches, reduced over ``group``.

    Schedule: 1. sum the ``[sum, count]`` pairs and take the max of the extremes (minima negated) over this
    rank's dicts; 2. one sum and one max all-reduce over ``group``; 3. one host read. Every rank must pass
    dicts with the same names (they do when every rank uses the same LossConfig and the same optional
    inputs). Means with a zero count come back as NaN; extremes with nothing to report as ±inf.

    Pipeline parallelism (``pp_group`` of more than one stage): Megatron calls the loss only on the last
    stage, so the other stages' lists are empty. The last stage reduces over its ``group`` and its result
    is broadcast over ``pp_group`` (4.): every stage returns the same dict, and the documented loop runs
    unchanged on every stage. Without ``pp_group`` an empty list is an error.
    """
    if group_size(pp_group) > 1:
        # --- 4. the last stage's values on every stage ---
        mine = _reduce(metrics, group) if is_last_rank(pp_group) else None
        return broadcast_object_from_last(mine, pp_group)  # type: ignore[return-value]
    return _reduce(metrics, group)


def _reduce(metrics: Sequence[Mapping[str, torch.Tensor]], group: ProcessGroup | None) -> dict[str, float]:
    """Steps 1–3 of :func:`reduce_metrics`."""
    if not metrics:
        raise ValueError(
            "metrics must hold the metric dict of at least one micro-batch (on a pipeline stage other than the "
            "last, which has none, pass pp_group= so the last stage's values are broadcast)"
        )
    names = sorted(metrics[0])
    for i, m in enumerate(metrics):
        if sorted(m) != names:
            raise ValueError(f"metrics[{i}] has names {sorted(m)}, metrics[0] has {names}: every dict needs the same")
    mins = [n for n in names if n.endswith(MIN_SUFFIX)]
    maxs = [n for n in names if n.endswith(MAX_SUFFIX)]
    means = [n for n in names if n not in mins and n not in maxs]
    for n in means:
        if metrics[0][n].shape != (2,):
            raise ValueError(f"metric {n!r} must be a [sum, count] pair, got shape {tuple(metrics[0][n].shape)}")
    device = metrics[0][names[0]].device
    # --- 1. local reduction over this rank's micro-batches ---
    pairs = torch.stack([torch.stack([m[n].to(torch.float64) for n in means]) for m in metrics]).sum(0) \
        if means else torch.zeros((0, 2), dtype=torch.float64, device=device)
    extremes = torch.stack([
        torch.stack([-m[n].to(torch.float64).reshape(()) for n in mins] + [m[n].to(torch.float64).reshape(()) for n in maxs])
        for m in metrics
    ]).amax(0) if mins or maxs else torch.zeros(0, dtype=torch.float64, device=device)
    # --- 2. one sum and one max over the group ---
    pairs = all_reduce_sum(pairs, group)
    extremes = all_reduce_max(extremes, group)
    # --- 3. one host read (where input errors recorded on the device during the step are raised too) ---
    check_errors()
    pair_values, extreme_values = pairs.tolist(), extremes.tolist()
    out: dict[str, float] = {}
    for n, (total, count) in zip(means, pair_values):
        out[n] = total / count if count != 0 else math.nan
    for i, n in enumerate(mins):
        out[n] = -extreme_values[i]
    for i, n in enumerate(maxs):
        out[n] = extreme_values[len(mins) + i]
    return out
