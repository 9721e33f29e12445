"""Failures the property tests (tests/loss/test_properties.py) found, each pinned as a regular test on its shrunk
example and named for what it checks; both backends where both implement the config."""

from __future__ import annotations

import pytest
import torch

from mp_grpo.config import load_config
from mp_grpo.loss import GRPOLoss, LossBackend

BACKENDS = [LossBackend.TORCH, LossBackend.TRITON]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_top_entropy_selection_compares_the_entropies_as_given(backend: LossBackend) -> None:
    """float32 log-probs with float64 entropies: the loss computes in float32, but the step's quantile is one of
    the given float64 values — the token exactly at the threshold is kept (it was dropped where float32 rounded
    its entropy down: 0.7 → 0.69999999)."""
    cfg = load_config(None, ["entropy.top_quantile=0.5"])
    entropy = torch.tensor([[0.5, 0.7, 0.9]], dtype=torch.float64)  # median 0.7, below it in float32
    lp = torch.tensor([[-1.0, -0.5, -0.2]], dtype=torch.float32, requires_grad=True)
    loss, metrics = GRPOLoss(cfg, backend=backend)(lp, None, torch.tensor([1.0]), torch.ones(1, 3, dtype=torch.bool),
                                                   entropy=entropy)
    loss.backward()
    # on-policy ppo_clip: each kept token contributes −A·r/N = −1/3, with gradient −1/3
    torch.testing.assert_close(loss, torch.tensor(-2.0 / 3.0))
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -1.0 / 3.0, -1.0 / 3.0]]))
    assert metrics["rejected_frac/entropy"].tolist() == [1.0, 3.0]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
@pytest.mark.parametrize("estimator", ["k3", "k2"])
@pytest.mark.parametrize("bias_correction", [False, True])
def test_kl_output_clamp_gives_zero_gradient_where_the_estimate_overflows(
    backend: LossBackend, estimator: str, bias_correction: bool
) -> None:
    """kl.input_clamp=null, output_clamp on: a token whose estimate overflows float32 (k3 of x = ref − log π = 95,
    k2 of x = 3e19) has the KL value output_clamp and a zero KL gradient — not 0 · inf = NaN (the torch path's
    autograd through the product gave NaN with a finite loss; the kernels' hand derivative gave 0)."""
    cfg = load_config(None, ["kl.coef=0.1", "kl.input_clamp=null", "kl.output_clamp=10", f"kl.estimator={estimator}",
                             f"kl.bias_correction={str(bias_correction).lower()}"])
    lp = torch.tensor([[-100.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-5.0 if estimator == "k3" else 3e19, -1.5]])
    old = lp.detach() + 0.01
    loss, metrics = GRPOLoss(cfg, backend=backend)(lp, old, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool),
                                                   ref_logprobs=ref)
    loss.backward()
    assert torch.isfinite(lp.grad).all(), lp.grad
    # token 0: the policy term only (its KL is clamped: no KL gradient): −A·r/N with r = e^−0.01
    ratio = torch.exp(torch.tensor(-0.01))
    torch.testing.assert_close(lp.grad[0, 0], -ratio / 2)
    assert metrics["kl"][0] >= 10.0 - 1e-6  # token 0's KL is the bound
