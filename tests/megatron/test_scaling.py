"""MegatronScaling (mp_grpo/megatron/scaling.py): the factors of the derivation in its docstring.

That these factors are right — that Megatron's schedule, DDP and finalize_model_grads turn them back into
the one-process gradient — is what tests/megatron/test_loss_func.py checks end to end.
"""

from __future__ import annotations

import pytest
import torch

from mp_grpo.megatron.scaling import MegatronScaling


def test_two_tuple_loss_is_share_times_microbatches_times_dp() -> None:
    share = torch.tensor(0.25, requires_grad=True)
    loss = MegatronScaling(calculate_per_token_loss=False, num_microbatches=3, dp_size=4).megatron_loss(
        share, torch.tensor(1000.0, dtype=torch.float64))
    assert float(loss) == pytest.approx(0.25 * 12)
    loss.backward()
    assert float(share.grad) == pytest.approx(12.0)


def test_per_token_loss_is_share_times_global_tokens() -> None:
    share = torch.tensor(0.5, requires_grad=True)
    loss = MegatronScaling(calculate_per_token_loss=True, num_microbatches=3, dp_size=4).megatron_loss(
        share, torch.tensor(37.0, dtype=torch.float64))
    assert loss.dtype == torch.float32 and float(loss) == pytest.approx(18.5)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="num_microbatches"):
        MegatronScaling(calculate_per_token_loss=False, num_microbatches=0, dp_size=1)
    with pytest.raises(ValueError, match="dp_size"):
        MegatronScaling(calculate_per_token_loss=False, num_microbatches=1, dp_size=0)
