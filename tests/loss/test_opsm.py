"""Off-policy sequence masking (mp_grpo/loss/opsm.py)."""

from __future__ import annotations

import torch

from mp_grpo.loss.opsm import opsm_divergence, opsm_keep


def test_divergence_is_masked_and_detached() -> None:
    behaviour = torch.tensor([-1.0, float("nan"), -0.2], dtype=torch.float64)
    lp = torch.tensor([-1.5, -1.0, -0.1], dtype=torch.float64, requires_grad=True)
    div = opsm_divergence(behaviour, lp, torch.tensor([True, False, True]))
    torch.testing.assert_close(div, torch.tensor([0.5, 0.0, -0.1], dtype=torch.float64))
    assert not div.requires_grad


def test_keep_rule() -> None:
    # Tokens of sequences with mean divergences 0.6 (> delta) and 0.2 (≤ delta), advantages of both signs.
    adv = torch.tensor([-1.0, 1.0, -1.0, 0.0], dtype=torch.float64)
    seq_sum = torch.tensor([1.2, 1.2, 0.4, 1.2], dtype=torch.float64)
    count = torch.tensor([2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    assert opsm_keep(adv, seq_sum, count, 0.5).tolist() == [False, True, True, True]
