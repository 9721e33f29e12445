"""Fixed bounds (mp_grpo/loss/clamps.py)."""

from __future__ import annotations

import torch

from mp_grpo.loss.clamps import symmetric_clamp


def test_symmetric_clamp() -> None:
    x = torch.tensor([-30.0, 0.5, 30.0])
    assert symmetric_clamp(x, 20.0).tolist() == [-20.0, 0.5, 20.0]
    assert symmetric_clamp(x, None) is x
