"""Aggregation divisors (mp_grpo/loss/aggregation.py)."""

from __future__ import annotations

import pytest
import torch

from mp_grpo.config.loss import Aggregation
from mp_grpo.loss.aggregation import token_divisor

N, S = torch.tensor(40.0), torch.tensor(6.0)
LENGTHS = torch.tensor([5.0, 5.0, 0.0, 2.0])


@pytest.mark.parametrize(
    ("mode", "norm", "expected"),
    [
        (Aggregation.TOKEN_MEAN, None, [40.0] * 4),
        (Aggregation.SEQ_MEAN_TOKEN_MEAN, None, [30.0, 30.0, 6.0, 12.0]),  # n_seq · S, n floored at 1
        (Aggregation.SEQ_MEAN_TOKEN_SUM, None, [6.0] * 4),
        (Aggregation.SEQ_MEAN_TOKEN_SUM_NORM, 512.0, [3072.0] * 4),
    ],
)
def test_divisors(mode: Aggregation, norm: float | None, expected: list[float]) -> None:
    d = token_divisor(mode, norm, N, S, LENGTHS)
    assert d.expand(4).tolist() == expected


def test_empty_step_divides_by_the_floor() -> None:
    assert token_divisor(Aggregation.TOKEN_MEAN, None, torch.tensor(0.0), torch.tensor(0.0), LENGTHS).item() == 1.0
