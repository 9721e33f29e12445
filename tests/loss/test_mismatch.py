"""Training–inference mismatch estimates (mp_grpo/loss/mismatch.py)."""

from __future__ import annotations

import torch

from mp_grpo.loss.mismatch import chi2_sequence, chi2_token, k1, k3


def test_estimates() -> None:
    d = torch.tensor([0.0, 0.3, -0.7], dtype=torch.float64)
    torch.testing.assert_close(k1(d), -d)
    torch.testing.assert_close(k3(d), d.exp() - d - 1)
    torch.testing.assert_close(chi2_token(d), (2 * d).exp() - 1)
    assert k3(d)[0] == 0 and (k3(d) >= 0).all()
    seq = torch.tensor([0.5, 30.0], dtype=torch.float64)
    torch.testing.assert_close(chi2_sequence(seq, 20.0), torch.tensor([1.0, 40.0], dtype=torch.float64).exp() - 1)
