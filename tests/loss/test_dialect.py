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


# ------------------------------------------------------------------------------------------------------
# Every other formula of token_math: the derivative it returns (what the kernels chain) equals autograd of its
# value on the torch path (what mp_grpo/loss differentiates), on float64 inputs that include values exactly at
# the clip bounds (the bounds are inclusive in both: torch.clamp's gradient mask, the kernels' masks).

import math  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mp_grpo.kernels import token_math as T  # noqa: E402

INF = math.inf


def _with_ties(x: torch.Tensor, *ties: float) -> torch.Tensor:
    """``x`` with its first entries replaced by ``ties`` (values exactly at a bound), requiring grad."""
    x = x.clone()
    x[: len(ties)] = torch.tensor(ties, dtype=x.dtype)
    return x.requires_grad_()


def _random(seed: int, n: int = 301, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def _autograd(value: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """∂value_i/∂x_i (every formula is element-wise), through a random upstream gradient."""
    g = _random(99, value.numel()).abs() + 0.5
    (grad,) = torch.autograd.grad((value * g).sum(), x)
    return grad / g


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.detach(), expected.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bound", [0.7, INF])
def test_clamp_sym_inside_mask_is_its_derivative(bound: float) -> None:
    x = _with_ties(_random(1), bound, -bound, 0.0) if bound != INF else _random(1).requires_grad_()
    value, inside = torch_formula(T.clamp_sym)(x, bound)
    _close(value, x.clamp(-bound, bound))
    _close(_autograd(value, x), inside.to(x.dtype))
    if bound != INF:
        assert inside[:2].all() and (~inside).any()  # the bounds themselves are inside


@pytest.mark.parametrize(("low", "high"), [(0.8, 1.28), (-INF, 1.1), (0.95, INF), (-INF, INF)])
def test_clip_range_is_torch_clamp_with_its_gradient(low: float, high: float) -> None:
    ties = [v for v in (low, high) if v != INF and v != -INF]
    x = _with_ties(_random(2, scale=0.3) + 1.0, *ties)
    value = torch_formula(T.clip_range)(x, low, high)
    x2 = x.detach().clone().requires_grad_()
    expected = x2.clamp(min=low, max=high)  # torch.clamp at ±inf: the identity
    assert torch.equal(value.detach(), expected.detach())
    (want,) = torch.autograd.grad(expected.sum(), x2)
    assert torch.equal(_autograd(value, x), want)  # torch.clamp's gradient, ties included


def test_minimum_maximum_take_python_scalars() -> None:
    from mp_grpo.loss.dialect import TorchLanguage as L

    x = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float32)
    assert L.minimum(x, 1.0).tolist() == [0.5, 1.0, 1.0] and L.minimum(x, 1.0).dtype == torch.float32
    assert L.maximum(1.0, x).tolist() == [1.0, 1.0, 2.0] and L.maximum(x, -INF).tolist() == x.tolist()
    assert L.minimum(2.0, 3.0) == 2.0 and L.maximum(2.0, 3.0) == 3.0


@pytest.mark.parametrize("dual_clip", [False, True])
@pytest.mark.parametrize("delta", [1.25, INF])
def test_clipped_surrogate_derivative(dual_clip: bool, delta: float) -> None:
    low, high, c = 0.8, 1.28, 1.1
    ratio = _with_ties((_random(3, scale=0.3)).exp(), low, high, low, high, *([delta] if delta != INF else []))
    adv = _random(4)
    adv[:4] = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    term, d_term, clip_low, clip_high, dual = torch_formula(T.clipped_surrogate)(ratio, adv, low, high, delta, c,
                                                                                 dual_clip)
    _close(_autograd(term, ratio), d_term)
    assert bool(clip_low.any()) and bool(clip_high.any()) and bool(dual.any()) == dual_clip
    # the value: −min(min(r, δ)·A, clip(r)·A), the dual clip where A < 0
    r = ratio.detach()
    want = -torch.minimum(torch.minimum(r, torch.tensor(delta, dtype=r.dtype)) * adv, r.clamp(low, high) * adv)
    if dual_clip:
        want = torch.where(adv < 0, torch.minimum(want, -adv * c), want)
    _close(term, want)


def test_cispo_sapo_reinforce_derivatives() -> None:
    lp = (-_random(5).abs()).requires_grad_()
    ratio = _with_ties(_random(6, scale=0.3).exp(), 0.8, 1.1)
    adv = _random(7)
    term, d_term, low, high = torch_formula(T.cispo)(lp, ratio, adv, 0.8, 1.1)
    _close(_autograd(term, lp), d_term)  # the weight is detached: no gradient through the ratio
    assert torch.autograd.grad(term.sum(), ratio, allow_unused=True)[0] is None
    assert not bool(low[0]) and not bool(high[1]) and bool(low.any()) and bool(high.any())
    tau_pos, tau_neg = (torch.tensor(t, dtype=torch.float64) for t in (1.0, 1.05))
    term, d_term = torch_formula(T.sapo)(ratio, adv, tau_pos, tau_neg)
    _close(_autograd(term, ratio), d_term)
    term, d_term = torch_formula(T.reinforce)(lp, adv)
    _close(_autograd(term, lp), d_term)
    _close(term, -adv * lp)


def test_gmpo_derivatives() -> None:
    log_ratio = _with_ties(_random(8, scale=0.3), 0.15, -0.1, 0.15, -0.1)
    adv = _random(9)
    adv[:4] = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    clipped, d_clipped, low, high = torch_formula(T.gmpo_log_clip)(log_ratio, adv, -0.1, 0.15)
    _close(_autograd(clipped, log_ratio), d_clipped)
    assert not bool(low[:4].any()) and not bool(high[:4].any()) and bool(low.any()) and bool(high.any())
    seq_mean = _random(10, scale=0.2).requires_grad_()
    term, d_term, ratio = torch_formula(T.gmpo)(seq_mean, adv)
    _close(_autograd(term, seq_mean), d_term)
    _close(ratio, seq_mean.exp())


@pytest.mark.parametrize(("level", "want"), [
    (CODES.LEVEL_TOKEN, lambda d, s, n, c: d),
    (CODES.LEVEL_SEQUENCE, lambda d, s, n, c: s.clamp(-c, c)),
    (CODES.LEVEL_GEOMETRIC, lambda d, s, n, c: s / n),
])
def test_level_log_ratio(level: int, want) -> None:
    d, s = _random(11, scale=0.1), _random(12, scale=3.0)
    s[:2] = torch.tensor([2.0, -2.0], dtype=torch.float64)
    n = torch.arange(1, d.numel() + 1, dtype=torch.float64)
    _close(torch_formula(T.level_log_ratio)(d, s, n, 2.0, level), want(d, s, n, 2.0))


def test_rollout_weight_normalization_and_rejection() -> None:
    log_ratio = _with_ties(_random(13, scale=0.2), math.log(0.9), math.log(1.1))
    raw, truncated = torch_formula(T.truncated_weight)(log_ratio, 0.9, 1.1)
    assert raw.grad_fn is None and truncated.grad_fn is None  # detached
    _close(raw, log_ratio.exp())
    _close(truncated, log_ratio.exp().clamp(0.9, 1.1))
    raw_open, open_ = torch_formula(T.truncated_weight)(log_ratio, -INF, INF)
    assert torch.equal(open_, raw_open)
    mean = torch.tensor(0.5, dtype=torch.float64)
    _close(torch_formula(T.normalized_weight)(truncated, mean), truncated / 0.5)
    tiny = torch.tensor(1e-9, dtype=torch.float64)
    assert torch.equal(torch_formula(T.normalized_weight)(truncated, tiny), truncated)
    ratio = log_ratio.detach().exp()
    keep = torch_formula(T.rejection_keep)(log_ratio.detach(), 0.9, 1.1)
    assert torch.equal(keep, (ratio >= 0.9) & (ratio <= 1.1))
    assert torch.equal(torch_formula(T.rejection_keep)(log_ratio.detach(), -INF, INF), torch.ones_like(keep))


def test_opsm_entropy_keeps_and_divisor() -> None:
    adv, div = _random(14), _random(15, scale=0.2)
    n = torch.full_like(adv, 4.0)
    div[:2] = torch.tensor([0.2, 0.2], dtype=torch.float64)  # mean exactly delta: kept
    adv[:2] = -1.0
    keep = torch_formula(T.opsm_keep)(adv, div, n, 0.05)
    assert torch.equal(keep, ~((adv < 0) & (div / 4.0 > 0.05))) and bool(keep[:2].all()) and not bool(keep.all())
    ent = torch.rand(50, generator=torch.Generator().manual_seed(16), dtype=torch.float32)
    thr = ent[7].double()
    assert torch.equal(torch_formula(T.high_entropy)(ent, thr), ent.double() >= thr)
    tokens, sequences = torch.tensor(0.0, dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64)
    count = torch.tensor([0.0, 1.0, 5.0], dtype=torch.float64)
    divisor = torch_formula(T.token_divisor)
    floor = torch_formula(T.floor_count)
    assert divisor(tokens, sequences, floor(count), 7.0, CODES.AGG_TOKEN_MEAN).item() == 1.0  # floored
    assert divisor(tokens, sequences, floor(count), 7.0, CODES.AGG_SEQ_MEAN_TOKEN_MEAN).tolist() == [3.0, 3.0, 15.0]
    assert divisor(tokens, sequences, floor(count), 7.0, CODES.AGG_SEQ_MEAN_TOKEN_SUM).item() == 3.0
    assert divisor(tokens, sequences, floor(count), 7.0, CODES.AGG_SEQ_MEAN_TOKEN_SUM_NORM).item() == 21.0


def test_chi2_and_mismatch_estimators() -> None:
    d = _with_ties(_random(17, scale=0.3), 0.0, 1e-9)
    value, derivative = torch_formula(T.chi2)(d)
    _close(value, (2 * d.detach()).exp() - 1)
    _close(_autograd(value, d), derivative)
    assert value[0].item() == 0.0 and value[1].item() == pytest.approx(2e-9, rel=1e-12)  # exact near 0


# ------------------------------------------------------------------------------------------------------
# The kernels' side: the same formulas compiled by Triton (the interpreter here) give the torch path's values,
# derivatives and flags, on float64 inputs with values at the bounds.


@triton.jit
def _formulas_kernel(
    ratio_ptr, adv_ptr, lp_ptr, params_ptr, out_ptr, N, BLOCK: tl.constexpr,
):
    # float64 parameters loaded from a vector, as the fused kernels do (a Python float argument would be fp32)
    low, high, delta = tl.load(params_ptr), tl.load(params_ptr + 1), tl.load(params_ptr + 2)
    c, tau_pos, tau_neg = tl.load(params_ptr + 3), tl.load(params_ptr + 4), tl.load(params_ptr + 5)
    gmpo_low, gmpo_high = tl.load(params_ptr + 6), tl.load(params_ptr + 7)
    w_min, w_max = tl.load(params_ptr + 8), tl.load(params_ptr + 9)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    ratio = tl.load(ratio_ptr + offs, mask=m, other=1.0)
    adv = tl.load(adv_ptr + offs, mask=m, other=0.0)
    lp = tl.load(lp_ptr + offs, mask=m, other=0.0)
    term, d_term, clip_low, clip_high, dual = T.clipped_surrogate(ratio, adv, low, high, delta, c, True)
    tl.store(out_ptr + 0 * N + offs, term, mask=m)
    tl.store(out_ptr + 1 * N + offs, d_term, mask=m)
    tl.store(out_ptr + 2 * N + offs, clip_low.to(tl.float64) + 2.0 * clip_high.to(tl.float64) + 4.0 * dual.to(tl.float64), mask=m)
    term, d_term, clip_low, clip_high = T.cispo(lp, ratio, adv, low, high)
    tl.store(out_ptr + 3 * N + offs, term, mask=m)
    tl.store(out_ptr + 4 * N + offs, d_term, mask=m)
    term, d_term = T.sapo(ratio, adv, tau_pos, tau_neg)
    tl.store(out_ptr + 5 * N + offs, term, mask=m)
    tl.store(out_ptr + 6 * N + offs, d_term, mask=m)
    clipped, d_clipped, clip_low, clip_high = T.gmpo_log_clip(lp, adv, gmpo_low, gmpo_high)
    tl.store(out_ptr + 7 * N + offs, clipped, mask=m)
    tl.store(out_ptr + 8 * N + offs, d_clipped, mask=m)
    raw, truncated = T.truncated_weight(lp, w_min, w_max)
    tl.store(out_ptr + 9 * N + offs, truncated, mask=m)
    keep = T.rejection_keep(lp, w_min, w_max)
    tl.store(out_ptr + 10 * N + offs, keep.to(tl.float64), mask=m)
    clamped, inside = T.clamp_sym(lp, gmpo_high)
    tl.store(out_ptr + 11 * N + offs, clamped + 2.0 * inside.to(tl.float64), mask=m)


def test_kernel_and_torch_path_agree() -> None:
    low, high, delta, c, tau_pos, tau_neg, gmpo_low, gmpo_high, w_min, w_max = (
        0.8, 1.28, 1.25, 1.1, 1.0, 1.05, -0.1, 0.15, 0.9, 1.1)
    n = 200
    ratio = _with_ties(_random(20, n, scale=0.3).exp(), low, high, delta, low, high).detach()
    adv = _random(21, n)
    adv[:6] = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    lp = _with_ties(_random(22, n, scale=0.3), gmpo_low, gmpo_high, -gmpo_high, math.log(w_min)).detach()
    out = torch.zeros(12, n, dtype=torch.float64)
    params = torch.tensor([low, high, delta, c, tau_pos, tau_neg, gmpo_low, gmpo_high, w_min, w_max],
                          dtype=torch.float64)
    _formulas_kernel[(1,)](ratio, adv, lp, params, out, n, BLOCK=256)
    F = torch_formula
    term, d_term, clip_low, clip_high, dual = F(T.clipped_surrogate)(ratio, adv, low, high, delta, c, True)
    want = [term, d_term, clip_low.double() + 2.0 * clip_high.double() + 4.0 * dual.double()]
    want += list(F(T.cispo)(lp, ratio, adv, low, high)[:2])
    taus = [torch.tensor(t, dtype=torch.float64) for t in (tau_pos, tau_neg)]
    want += list(F(T.sapo)(ratio, adv, *taus))
    want += list(F(T.gmpo_log_clip)(lp, adv, gmpo_low, gmpo_high)[:2])
    want += [F(T.truncated_weight)(lp, w_min, w_max)[1], F(T.rejection_keep)(lp, w_min, w_max).double()]
    clamped, inside = F(T.clamp_sym)(lp, gmpo_high)
    want += [clamped + 2.0 * inside.double()]
    for i, w in enumerate(want):
        torch.testing.assert_close(out[i], w, rtol=1e-14, atol=1e-15, msg=f"output {i}")


@triton.jit
def _trust_region_kernel(lp_ptr, mu_ptr, adv_ptr, params_ptr, out_ptr, N, BLOCK: tl.constexpr):
    delta_low, delta_high, threshold = tl.load(params_ptr), tl.load(params_ptr + 1), tl.load(params_ptr + 2)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    lp = tl.load(lp_ptr + offs, mask=m, other=0.0)
    mu = tl.load(mu_ptr + offs, mask=m, other=0.0)
    adv = tl.load(adv_ptr + offs, mask=m, other=0.0)
    tv = T.binary_divergence(lp, mu, CODES.TR_BINARY_TV)
    kl = T.binary_divergence(lp, mu, CODES.TR_BINARY_KL)
    tl.store(out_ptr + 0 * N + offs, tv, mask=m)
    tl.store(out_ptr + 1 * N + offs, kl, mask=m)
    tl.store(out_ptr + 2 * N + offs, T.log1mexp(tl.minimum(lp, 0.0)), mask=m)
    tl.store(out_ptr + 3 * N + offs, T.trust_region_keep(tv, lp, mu, adv, delta_low, delta_high, True).to(tl.float64),
             mask=m)
    tl.store(out_ptr + 4 * N + offs, T.trust_region_keep(kl, lp, mu, adv, delta_low, delta_high, False).to(tl.float64),
             mask=m)
    d = lp - mu
    tl.store(out_ptr + 5 * N + offs, T.m2po_keep(d, threshold, adv, True).to(tl.float64), mask=m)
    tl.store(out_ptr + 6 * N + offs, T.m2po_keep(d, threshold, adv, False).to(tl.float64), mask=m)


def test_trust_region_formulas_kernel_and_torch_path_agree() -> None:
    """The trust region's and M2PO's formulas (binary TV / KL, log1mexp, the keeps) on the kernels' side and the torch
    path's, float64, at probabilities of 0 and 1, ties, and −ln 2 (log1mexp's branch point); the divergences against
    the independent float64 reference of tests/reference.py."""
    from tests.reference import binary_divergence_reference

    edges = [0.0, -1e-30, -1e-9, -1e-6, -math.log(2.0), -1.0, -30.0, -1e4]
    lp = torch.tensor([a for a in edges for _ in edges] + _random(30, 60, scale=2.0).abs().neg().tolist(),
                      dtype=torch.float64)
    mu = torch.tensor([b for _ in edges for b in edges] + _random(31, 60, scale=2.0).abs().neg().tolist(),
                      dtype=torch.float64)
    n = lp.numel()
    adv = _random(32, n)
    adv[::7] = 0.0
    delta_low, delta_high = 0.1, 0.2
    threshold = float((lp - mu)[70] ** 2)  # one value exactly at the threshold: dropped
    out = torch.zeros(7, n, dtype=torch.float64)
    params = torch.tensor([delta_low, delta_high, threshold], dtype=torch.float64)
    _trust_region_kernel[(1,)](lp, mu, adv, params, out, n, BLOCK=256)
    F = torch_formula
    tv = F(T.binary_divergence)(lp, mu, CODES.TR_BINARY_TV)
    kl = F(T.binary_divergence)(lp, mu, CODES.TR_BINARY_KL)
    want = [tv, kl, F(T.log1mexp)(lp.clamp(max=0.0)),
            F(T.trust_region_keep)(tv, lp, mu, adv, delta_low, delta_high, True).double(),
            F(T.trust_region_keep)(kl, lp, mu, adv, delta_low, delta_high, False).double(),
            F(T.m2po_keep)(lp - mu, torch.tensor(threshold, dtype=torch.float64), adv, True).double(),
            F(T.m2po_keep)(lp - mu, torch.tensor(threshold, dtype=torch.float64), adv, False).double()]
    for i, w in enumerate(want):
        torch.testing.assert_close(out[i], w, rtol=1e-13, atol=1e-300, equal_nan=False, msg=f"output {i}")
    assert not bool(torch.isnan(out).any())
    for mode, got in (("binary_tv", tv), ("binary_kl", kl)):
        torch.testing.assert_close(got, binary_divergence_reference(mode, lp, mu), rtol=1e-10, atol=1e-300, msg=mode)
    assert want[6][70] == 0.0 and bool(kl[lp == 0.0][mu[lp == 0.0] < 0.0].isinf().all())  # π = 1 > μ: +inf


def test_the_torch_modules_run_token_math() -> None:
    """mp_grpo/loss calls the kernels' formulas, not copies of them."""
    from mp_grpo.loss import aggregation, clamps, entropy, kl, m2po, mismatch, objectives, opsm, rollout_correction
    from mp_grpo.loss import trust_region

    for module, name, formula in [
        (clamps, "_clamp_sym", T.clamp_sym), (objectives, "_clipped_surrogate", T.clipped_surrogate),
        (objectives, "_cispo", T.cispo), (objectives, "_sapo", T.sapo), (objectives, "_gmpo", T.gmpo),
        (objectives, "_gmpo_log_clip", T.gmpo_log_clip), (objectives, "_reinforce", T.reinforce),
        (rollout_correction, "_level_log_ratio", T.level_log_ratio),
        (rollout_correction, "_truncated_weight", T.truncated_weight),
        (rollout_correction, "_normalized_weight", T.normalized_weight),
        (rollout_correction, "_rejection_keep", T.rejection_keep), (opsm, "_opsm_keep", T.opsm_keep),
        (entropy, "_high_entropy", T.high_entropy), (aggregation, "_token_divisor", T.token_divisor),
        (mismatch, "_kl_estimator", T.kl_estimator), (mismatch, "_chi2", T.chi2), (kl, "_weighted_kl", T.weighted_kl),
        (trust_region, "_binary_divergence", T.binary_divergence),
        (trust_region, "_trust_region_keep", T.trust_region_keep), (m2po, "_m2po_keep", T.m2po_keep),
    ]:
        assert getattr(module, name).__code__ is formula.fn.__code__, (module.__name__, name)


@pytest.mark.parametrize("mode", [CODES.KL_RATIO_NONE, CODES.KL_RATIO_BIAS_CORRECTION, CODES.KL_RATIO_SCORE_FUNCTION])
@pytest.mark.parametrize(("estimator", "straight_through"), CASES)
def test_weighted_kl_partial_derivatives(mode: int, estimator: KLEstimator, straight_through: bool) -> None:
    x = _random(30, scale=0.5).requires_grad_()
    log_ratio = _random(31, scale=0.2).requires_grad_()
    score = torch.zeros_like(x, requires_grad=True)  # log π_θ − stopgrad(log π_θ): 0 in value
    value, d_estimator, weight, d_log_ratio, d_score = torch_formula(T.weighted_kl)(
        x, log_ratio, score, CODE[estimator], straight_through, mode)
    d_x = d_estimator * weight
    g = _random(32).abs() + 0.5
    grads = torch.autograd.grad((value * g).sum(), (x, log_ratio, score), allow_unused=True)
    for grad, derivative in zip(grads, (d_x, d_log_ratio, d_score)):
        _close(torch.zeros_like(x) if grad is None else grad / g, derivative)
    base, _ = torch_formula(kl_estimator)(x, CODE[estimator], straight_through)
    _close(value, base * log_ratio.exp() if mode == CODES.KL_RATIO_BIAS_CORRECTION else base)


def test_torch_formulas_globals_are_a_module_of_their_own() -> None:
    """torch.compile guards a function's globals through ``sys.modules[f.__globals__['__name__']]``: that module must
    be the torch formulas' own, whose ``tl`` is the torch dialect (a copy of token_math's dict under token_math's name
    made dynamo guard ``triton.language`` as if it were the dialect class, failing every compile of the torch path)."""
    import sys

    from mp_grpo.kernels import token_math
    from mp_grpo.loss.dialect import TorchLanguage, torch_formula

    f = torch_formula(token_math.sapo)
    module = sys.modules[f.__globals__["__name__"]]
    assert module.__dict__ is f.__globals__ and module is not token_math
    assert module.tl is TorchLanguage and token_math.tl is not TorchLanguage
    assert "__builtins__" in f.__globals__  # dynamo reads the builtins from a function's globals
