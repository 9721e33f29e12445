"""One definition of the per-token maths (mp_grpo/kernels/token_math.py, mp_grpo/loss/dialect.py): the Triton
source run on torch tensors gives the float64 reference's values, and its hand-written derivative (what the
fused kernels chain) equals autograd's derivative of its value (what the torch path uses)."""

from __future__ import annotations

import pytest
import torch

from mp_grpo.config.loss import KLConfig, KLEstimator
from mp_grpo.kernels.token_math import kl_estimator
from mp_grpo.loss.dialect import CODES, torch_formula
from tests.reference import _kl_reference

CASES = [(KLEstimator.K1, False), (KLEstimator.K2, False), (KLEstimator.K3, False), (KLEstimator.K3, True)]
CODE = {KLEstimator.K1: CODES.KL_K1, KLEstimator.K2: CODES.KL_K2, KLEstimator.K3: CODES.KL_K3}


@pytest.mark.parametrize(("estimator", "straight_through"), CASES)
def test_kl_estimator_value_and_derivative(estimator: KLEstimator, straight_through: bool) -> None:
    gen = torch.Generator().manual_seed(len(estimator.value) * 2 + straight_through)
    x = (torch.randn(257, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    value, derivative = torch_formula(kl_estimator)(x, CODE[estimator], straight_through)
    (autograd,) = torch.autograd.grad(value.sum(), x)
    # The float64 reference of tests/reference.py at lp = 0, ref = x (no clamps, no ratio): KL of x, and its
    # gradient w.r.t. x is minus its gradient w.r.t. lp.
    lp = torch.zeros_like(x, requires_grad=True)
    cfg = KLConfig(coef=1.0, estimator=estimator, straight_through=straight_through, input_clamp=None,
                   output_clamp=None)
    want = _kl_reference(cfg, lp, x.detach(), torch.zeros_like(x))
    (want_grad_lp,) = torch.autograd.grad(want.sum(), lp)
    torch.testing.assert_close(value.detach(), want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(derivative.detach(), -want_grad_lp, rtol=1e-12, atol=1e-12)  # what the kernels chain
    torch.testing.assert_close(autograd, -want_grad_lp, rtol=1e-12, atol=1e-12)  # what the torch path gets


def test_the_torch_path_is_the_kernels_source() -> None:
    """Not a copy: the torch function runs the Triton function's own code object."""
    assert torch_formula(kl_estimator).__code__ is kl_estimator.fn.__code__
