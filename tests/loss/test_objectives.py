"""Policy surrogates (mp_grpo/loss/objectives.py) against their formulas written out, with gradients."""

from __future__ import annotations

import pytest
import torch

from mp_grpo.config import PolicyConfig
from mp_grpo.config.loss import Objective
from mp_grpo.loss.objectives import needs_sequence_sum, policy_term, sequence_input

N = 64


def _inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(N, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    old = lp.detach() + torch.randn(N, generator=gen, dtype=torch.float64) * 0.4
    adv = torch.randn(N, generator=gen, dtype=torch.float64)
    return lp, (lp - old), adv, torch.randn(N, generator=gen, dtype=torch.float64)


def _grad(out: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad((out * g).sum(), x)[0]


def test_ppo_clip_with_delta_and_dual_clip() -> None:
    cfg = PolicyConfig(eps_low=0.2, eps_high=0.28, delta=1.25, dual_clip_c=1.1)
    lp, lr, adv, g = _inputs(0)
    pt = policy_term(cfg, lp, lr, adv, None)
    r = lr.exp()
    r1, r2 = torch.minimum(r, torch.tensor(1.25, dtype=torch.float64)), r.clamp(0.8, 1.28)
    expected = -torch.min(r1 * adv, r2 * adv)
    expected = torch.where(adv < 0, torch.min(expected, -adv * 1.1), expected)
    torch.testing.assert_close(pt.term, expected)
    torch.testing.assert_close(_grad(pt.term, lp, g), _grad(expected, lp, g))
    assert pt.clipped_low.tolist() == ((r < 0.8) & (adv < 0)).tolist()
    assert pt.clipped_high.tolist() == ((r > 1.28) & (adv > 0)).tolist()
    assert pt.dual_clipped.any() and pt.clipped_low.any() and pt.clipped_high.any()


def test_gspo_uses_the_sequence_ratio() -> None:
    cfg = PolicyConfig(objective=Objective.GSPO, eps_low=0.01, eps_high=0.02)
    lp, lr, adv, g = _inputs(1)
    assert needs_sequence_sum(cfg) and sequence_input(cfg, lr, adv) is lr
    seq_mean = lr.mean().expand(N)  # one sequence
    pt = policy_term(cfg, lp, lr, adv, seq_mean)
    s = lr.mean().exp()
    expected = -torch.min(s * adv, s.clamp(0.99, 1.02) * adv)
    torch.testing.assert_close(pt.term, expected)
    torch.testing.assert_close(_grad(pt.term, lp, g), _grad(expected, lp, g))


def test_cispo_stops_the_gradient_of_the_weight() -> None:
    cfg = PolicyConfig(objective=Objective.CISPO, eps_low=None, eps_high=0.3)
    lp, lr, adv, g = _inputs(2)
    pt = policy_term(cfg, lp, lr, adv, None)
    w = lr.exp().clamp(max=1.3).detach()
    torch.testing.assert_close(pt.term, -w * adv * lp)
    torch.testing.assert_close(_grad(pt.term, lp, g), -w * adv * g)


def test_sapo_gate() -> None:
    cfg = PolicyConfig(objective=Objective.SAPO, sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    lp, lr, adv, g = _inputs(3)
    pt = policy_term(cfg, lp, lr, adv, None)
    tau = torch.where(adv > 0, 1.0, 1.05).double()
    r = lr.exp()
    expected = -(4 / tau) * torch.sigmoid(tau * (r - 1)) * adv
    torch.testing.assert_close(pt.term, expected)
    torch.testing.assert_close(_grad(pt.term, lp, g), _grad(expected, lp, g))
    assert pt.clipped_low is None and pt.dual_clipped is None


def test_gmpo_clips_one_sided_in_log_space() -> None:
    cfg = PolicyConfig(objective=Objective.GMPO, eps_low=0.1, eps_high=0.15)
    lp, lr, adv, g = _inputs(4)
    clipped = sequence_input(cfg, lr, adv)
    expected_clip = torch.where(adv > 0, torch.minimum(lr, torch.tensor(0.15, dtype=torch.float64)),
                                torch.maximum(lr, torch.tensor(-0.1, dtype=torch.float64)))
    torch.testing.assert_close(clipped, expected_clip)
    pt = policy_term(cfg, lp, lr, adv, clipped.mean().expand(N))
    expected = -adv * expected_clip.mean().exp()
    torch.testing.assert_close(pt.term, expected)
    torch.testing.assert_close(_grad(pt.term, lp, g), _grad(expected, lp, g))
    assert pt.clipped_high.tolist() == ((lr > 0.15) & (adv > 0)).tolist()


def test_reinforce() -> None:
    cfg = PolicyConfig(objective=Objective.REINFORCE)
    lp, lr, adv, g = _inputs(5)
    pt = policy_term(cfg, lp, lr, adv, None)
    torch.testing.assert_close(pt.term, -adv * lp)
    torch.testing.assert_close(_grad(pt.term, lp, g), -adv * g)
    torch.testing.assert_close(pt.ratio, lr.exp())


@pytest.mark.parametrize("objective", [Objective.PPO_CLIP, Objective.CISPO])
def test_unbounded_clip(objective: Objective) -> None:
    cfg = PolicyConfig(objective=objective, eps_low=None, eps_high=None)
    lp, lr, adv, _ = _inputs(6)
    pt = policy_term(cfg, lp, lr, adv, None)
    assert not pt.clipped_low.any() and not pt.clipped_high.any()
