"""Metric entries and reduce_metrics (mp_grpo/loss/metrics.py); the multi-rank reduction runs in
test_layout_invariance.py."""

from __future__ import annotations

import math

import pytest
import torch

from mp_grpo.loss import reduce_metrics
from mp_grpo.loss.metrics import max_entry, mean_entry, min_entry, stats_entries, total_entry


def test_entries_never_read_masked_values() -> None:
    v = torch.tensor([1.0, float("nan"), 3.0, float("inf")])
    m = torch.tensor([True, False, True, False])
    assert mean_entry(v, m).tolist() == [4.0, 2.0]
    assert min_entry(v, m).item() == 1.0 and max_entry(v, m).item() == 3.0
    empty = torch.zeros(4, dtype=torch.bool)
    assert min_entry(v, empty).item() == math.inf and max_entry(v, empty).item() == -math.inf
    assert total_entry(torch.tensor(2.0), torch.tensor(4.0)).tolist() == [2.0, 0.25]


def test_reduce_over_micro_batches() -> None:
    a = {**stats_entries("x", torch.tensor([1.0, 2.0]), torch.tensor([True, True])),
         "loss": total_entry(torch.tensor(0.5), torch.tensor(2.0))}
    b = {**stats_entries("x", torch.tensor([6.0, 9.0]), torch.tensor([True, False])),
         "loss": total_entry(torch.tensor(0.25), torch.tensor(2.0))}
    out = reduce_metrics([a, b])
    assert out == {"x/mean": 3.0, "x/min": 1.0, "x/max": 6.0, "loss": 0.75}
    nothing = reduce_metrics([{"y": mean_entry(torch.ones(2), torch.zeros(2, dtype=torch.bool))}])
    assert math.isnan(nothing["y"])


def test_reduce_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one"):
        reduce_metrics([])
    with pytest.raises(ValueError, match=r"metrics\[1\]"):
        reduce_metrics([{"a": torch.zeros(2)}, {"b": torch.zeros(2)}])
    with pytest.raises(ValueError, match="'a'"):
        reduce_metrics([{"a": torch.zeros(3)}])
