"""KL penalty (mp_grpo/loss/kl.py): estimators, clamps, straight-through, bias correction, score function."""

from __future__ import annotations

import pytest
import torch

from mp_grpo.config import KLConfig
from mp_grpo.config.loss import KLEstimator
from mp_grpo.loss.kl import kl_penalty


def _inputs():
    gen = torch.Generator().manual_seed(0)
    lp = (-torch.rand(32, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    ref = lp.detach() + torch.randn(32, generator=gen, dtype=torch.float64)
    old = lp.detach() + torch.randn(32, generator=gen, dtype=torch.float64) * 0.1
    return lp, ref, old, torch.randn(32, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("estimator", list(KLEstimator))
def test_estimators(estimator: KLEstimator) -> None:
    lp, ref, old, g = _inputs()
    out = kl_penalty(lp, ref, lp - old, KLConfig(estimator=estimator, input_clamp=None, output_clamp=None))
    x = ref - lp
    expected = {"k1": -x, "k2": x * x / 2, "k3": x.exp() - x - 1}[estimator.value]
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(torch.autograd.grad((out * g).sum(), lp)[0],
                               torch.autograd.grad((expected * g).sum(), lp)[0])


def test_clamps_bound_value_and_stop_gradient() -> None:
    lp = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([100.0, -100.0, 0.5], dtype=torch.float64)
    out = kl_penalty(lp, ref, lp.detach(), KLConfig(input_clamp=20.0, output_clamp=10.0))
    assert out[:2].tolist() == [10.0, 10.0]  # e^20 − 21 and e^-20 + 19, both clamped to 10
    (grad,) = torch.autograd.grad(out.sum(), lp)
    assert grad[:2].tolist() == [0.0, 0.0] and grad[2] != 0


def test_straight_through_has_k3_value_and_k2_gradient() -> None:
    lp, ref, old, g = _inputs()
    st = kl_penalty(lp, ref, lp - old, KLConfig(straight_through=True, input_clamp=None, output_clamp=None))
    k3 = kl_penalty(lp, ref, lp - old, KLConfig(input_clamp=None, output_clamp=None))
    k2 = kl_penalty(lp, ref, lp - old, KLConfig(estimator=KLEstimator.K2, input_clamp=None, output_clamp=None))
    torch.testing.assert_close(st, k3)
    torch.testing.assert_close(torch.autograd.grad((st * g).sum(), lp)[0], torch.autograd.grad((k2 * g).sum(), lp)[0])


def test_bias_correction_and_score_function() -> None:
    lp, ref, old, g = _inputs()
    plain = KLConfig(input_clamp=None, output_clamp=None)
    x = ref - lp
    k3 = x.exp() - x - 1
    biased = kl_penalty(lp, ref, lp - old, KLConfig(bias_correction=True, input_clamp=None, output_clamp=None))
    expected = k3 * (lp - old).exp()
    torch.testing.assert_close(biased, expected)
    torch.testing.assert_close(torch.autograd.grad((biased * g).sum(), lp)[0],
                               torch.autograd.grad((expected * g).sum(), lp)[0])
    score = kl_penalty(lp, ref, lp - old, KLConfig(score_function=True, input_clamp=None, output_clamp=None))
    torch.testing.assert_close(score, kl_penalty(lp, ref, lp - old, plain))  # value unchanged
    # gradient: ∇k3 + k3 · ∇log π
    x = ref - lp
    k3 = x.exp() - x - 1
    expected_grad = torch.autograd.grad((k3 * g).sum(), lp, retain_graph=True)[0] + (k3 * g).detach()
    torch.testing.assert_close(torch.autograd.grad((score * g).sum(), lp)[0], expected_grad)
