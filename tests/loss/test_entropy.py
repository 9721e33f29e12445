"""Top-entropy selection (mp_grpo/loss/entropy.py): the exact linear quantile and the mask."""

from __future__ import annotations

import pytest
import torch

from mp_grpo.loss.entropy import entropy_threshold, high_entropy, linear_quantile


@pytest.mark.parametrize("n", [1, 2, 7, 100])
@pytest.mark.parametrize("q", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_linear_quantile_matches_torch(n: int, q: float) -> None:
    values = torch.rand(n, generator=torch.Generator().manual_seed(n), dtype=torch.float32)
    torch.testing.assert_close(linear_quantile(values, q), torch.quantile(values.double(), q))


def test_threshold_and_mask() -> None:
    ent = torch.tensor([0.1, 0.5, 0.9, 0.3], dtype=torch.float64)
    assert entropy_threshold(ent, 1.0).item() == float("-inf")
    assert entropy_threshold(ent[:0], 0.5).item() == float("-inf")  # no valid token anywhere
    thr = entropy_threshold(ent, 0.5)  # keep the top half: threshold at the median 0.4
    assert thr.item() == pytest.approx(0.4)
    assert high_entropy(ent, thr).tolist() == [False, True, True, False]
    assert high_entropy(ent, entropy_threshold(ent, 0.0)).tolist() == [False, False, True, False]  # the max only
