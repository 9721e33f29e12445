"""Rollout correction (mp_grpo/loss/rollout_correction.py): ratio levels, truncation, normalization, rejection."""

from __future__ import annotations

import math

import torch

from mp_grpo.config import RolloutCorrectionConfig
from mp_grpo.config.loss import RatioLevel
from mp_grpo.loss.clamps import WEIGHT_MEAN_FLOOR
from mp_grpo.loss.rollout_correction import kept, level_log_ratio, normalized_weight, token_log_ratio, truncated_weight


def test_token_log_ratio_masks_and_clamps() -> None:
    trainer = torch.tensor([0.0, -1.0, float("nan"), 50.0], dtype=torch.float64)
    rollout = torch.tensor([-0.5, float("inf"), 0.0, 0.0], dtype=torch.float64)
    valid = torch.tensor([True, False, False, True])
    d = token_log_ratio(trainer, rollout, valid, 20.0)
    assert d.tolist() == [0.5, 0.0, 0.0, 20.0]
    assert not d.requires_grad


def test_levels() -> None:
    d = torch.tensor([0.1, 0.2, -0.4], dtype=torch.float64)
    seq_sum = d.sum().expand(3)
    count = torch.full((3,), 3.0, dtype=torch.float64)
    assert torch.equal(level_log_ratio(RatioLevel.TOKEN, d, seq_sum, count, 20.0), d)
    torch.testing.assert_close(level_log_ratio(RatioLevel.SEQUENCE, d, seq_sum, count, 20.0), seq_sum)
    torch.testing.assert_close(level_log_ratio(RatioLevel.GEOMETRIC, d, seq_sum, count, 20.0), seq_sum / 3)
    big = torch.full((3,), 45.0, dtype=torch.float64)
    assert level_log_ratio(RatioLevel.SEQUENCE, d, big, count, 20.0).tolist() == [20.0] * 3  # clamped after Σ
    assert level_log_ratio(RatioLevel.SEQUENCE, d, big, count, None).tolist() == [45.0] * 3


def test_truncation_and_rejection() -> None:
    lr = torch.tensor([math.log(0.5), 0.0, math.log(3.0)], dtype=torch.float64, requires_grad=True)
    cfg = RolloutCorrectionConfig(weight_level=RatioLevel.TOKEN, weight_min=0.8, weight_max=2.0,
                                  reject_level=RatioLevel.TOKEN, reject_min=0.6, reject_max=2.5)
    w = truncated_weight(lr, cfg)
    torch.testing.assert_close(w, torch.tensor([0.8, 1.0, 2.0], dtype=torch.float64))
    assert not w.requires_grad
    assert kept(lr, cfg).tolist() == [False, True, False]
    torch.testing.assert_close(truncated_weight(lr, RolloutCorrectionConfig(weight_level=RatioLevel.TOKEN)),
                               lr.detach().exp())
    only_max = RolloutCorrectionConfig(reject_level=RatioLevel.TOKEN, reject_max=1.5)
    assert kept(lr, only_max).tolist() == [True, True, False]


def test_normalization_and_its_floor() -> None:
    w = torch.tensor([0.5, 1.5], dtype=torch.float64)
    torch.testing.assert_close(normalized_weight(w, torch.tensor(0.5, dtype=torch.float64)), w / 0.5)
    tiny = torch.tensor(WEIGHT_MEAN_FLOOR / 2, dtype=torch.float64)
    assert torch.equal(normalized_weight(w, tiny), w)
