"""DPPO's divergence trust region (mp_grpo/loss/trust_region.py, token_math.binary_divergence / trust_region_keep):
its divergences in float32 against the float64 reference where probabilities are near 1 (with a mutant of the
log-space formula that must fail), the keep's semantics, no NaN / inf in the loss or its gradient at probabilities of
0 and 1 and log-ratios at ±the clamps (both backends), the top-K input's checks and errors, and ``on_logits`` (the
fused path from logits) with a top-K trust region and M2PO."""

from __future__ import annotations

import sys

import pytest
import torch

from mp_grpo.config import load_config
from mp_grpo.kernels import token_math
from mp_grpo.loss import GlobalBatch, GRPOLoss, LossBackend, TopKLogprobs
from mp_grpo.loss.dialect import CODES, torch_formula
from mp_grpo.loss.trust_region import topk_divergence
from mp_grpo.ops.checks import CheckInputs, check_errors, deferred_checks
from tests.loss.helpers import make_batch
from tests.reference import binary_divergence_reference, topk_divergence_reference

BACKENDS = [LossBackend.TORCH, LossBackend.TRITON]
TORCH_TOKEN_MATH = "mp_grpo.loss.dialect.torch.mp_grpo.kernels.token_math"
"""The module the torch versions of token_math's formulas run in (mp_grpo.loss.dialect._torch_module)."""


# ------------------------------------------------------------------------------------------------ precision
def _near_one_error(mode: int, name: str) -> float:
    """Largest relative error of the float32 binary divergence against the float64 reference, at probabilities within
    1e-3 … 1e-7 of 1 (log-probs −1e-3 … −1e-7, where 1 − p cancels in float32)."""
    grid = torch.tensor([-1e-3, -3e-4, -1e-4, -3e-5, -1e-5, -3e-6, -1e-6, -3e-7, -1e-7], dtype=torch.float32)
    lp, mu = grid.repeat_interleave(grid.numel()), grid.repeat(grid.numel())
    keep = lp != mu
    lp, mu = lp[keep], mu[keep]
    got = torch_formula(token_math.binary_divergence)(lp, mu, mode).double()
    want = binary_divergence_reference(name, lp.double(), mu.double())
    return float(((got - want).abs() / want).max())


@pytest.mark.parametrize("mode,name", [(CODES.TR_BINARY_TV, "binary_tv"), (CODES.TR_BINARY_KL, "binary_kl")])
def test_binary_divergences_are_exact_near_probability_one(mode: int, name: str, monkeypatch) -> None:
    """Taken from the log-probs (expm1, log1mexp), float32 keeps its relative precision where π and μ are within 1e-7 of
    1. The mutant — e^x − 1 and log(1 − e^x) written plainly, what exponentiating the log-probs first gives — loses it:
    the test fails on it."""
    assert _near_one_error(mode, name) < 1e-5
    module = sys.modules[TORCH_TOKEN_MATH]
    monkeypatch.setattr(module, "expm1", lambda x: torch.exp(x) - 1.0)
    monkeypatch.setattr(module, "log1mexp", lambda x: torch.log(1.0 - torch.exp(x)))
    assert _near_one_error(mode, name) > 1e-2


def test_keep_follows_the_advantage_only_when_directional() -> None:
    keep = torch_formula(token_math.trust_region_keep)
    lp = torch.log(torch.tensor([0.6, 0.6, 0.2, 0.2, 0.6, 0.2, 0.5], dtype=torch.float64))
    mu = torch.log(torch.tensor([0.3, 0.3, 0.5, 0.5, 0.3, 0.5, 0.5], dtype=torch.float64))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    tv = (lp.exp() - mu.exp()).abs()  # 0.3 each, 0 at the tie
    directional = keep(tv, lp, mu, adv, 0.25, 0.25, True)
    # up with A > 0 dropped; up with A ≤ 0 kept; down with A > 0 kept; down with A ≤ 0 dropped (TRL, verl, prime-rl)
    assert directional.tolist() == [False, True, True, False, True, False, True]
    assert keep(tv, lp, mu, adv, 0.25, 0.25, False).tolist() == [False, False, False, False, False, False, True]
    assert keep(tv, lp, mu, adv, 0.25, float("inf"), False).tolist() == [True, True, False, False, True, False, True]
    assert keep(tv, lp, mu, adv, 0.3 + 1e-12, 0.3 + 1e-12, False).all()  # a bound is inclusive: > drops


# ------------------------------------------------------------------------------------------------ NaN / inf safety
EXTREME_CONFIGS = {
    "binary_tv": ["trust_region.mode=binary_tv", "trust_region.delta_low=0.1", "trust_region.delta_high=0.1"],
    "binary_kl_symmetric": ["trust_region.mode=binary_kl", "trust_region.delta_low=0.05",
                            "trust_region.delta_high=0.05", "trust_region.direction=symmetric"],
    "topk_kl_m2po": ["trust_region.mode=topk_kl", "trust_region.delta_high=0.05", "m2po.bound=0.01",
                     "m2po.scope=clip_quadrants"],
    "unclamped_binary_kl_m2po": ["trust_region.mode=binary_kl", "trust_region.delta_low=0.05",
                                 "policy.log_ratio_clamp=null", "m2po.bound=0.0"],
}


def _extreme_inputs(dtype: torch.dtype):
    """Log-probs 0 (probability 1), −1e-30, −1e4 (probability 0) and in between; rollout log-probs 0, equal, and at
    ±20 (the log-ratio clamp) ± a hair from the trainer's; NaN / ±inf at masked positions; a top-K input with a whole
    mass in one id, −inf entries and junk where masked."""
    lp = torch.tensor([[0.0, 0.0, -1e-30, -1e4, -0.5, -25.0, -0.1, -3.0],
                       [-1e4, -20.0, -1.0, 0.0, -2.0, -0.3, float("nan"), float("inf")]], dtype=torch.float64)
    mu = torch.tensor([[0.0, -0.7, 0.0, -1.0, -0.5, -5.0, -20.1, -3.0 - 1e-9],
                       [-1e4 + 20.0, 0.0, -21.0, -20.0, -2.0 + 1e-12, -0.3, -float("inf"), 0.0]], dtype=torch.float64)
    mask = torch.ones_like(lp, dtype=torch.bool)
    mask[1, 6:] = False
    adv = torch.tensor([[1.0, -1.0, 2.0, -2.0, 0.0, 1.0, -1.0, 3.0], [-1.0, 1.0, 0.5, -0.5, 1.0, -1.0, 1.0, 1.0]],
                       dtype=torch.float64)
    counts = torch.tensor([1, 2, 2, 3, 1, 2, 2, 1, 3, 1, 2, 1, 1, 2, 2, 0])
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    nnz = int(indptr[-1])
    rollout = torch.linspace(-6.0, -0.1, nnz, dtype=torch.float64)
    rollout[0] = 0.0  # μ(k) = 1: the rest at its floor
    trainer = rollout.flip(0).clone()
    trainer[3] = -float("inf")  # π(k) = 0 < μ(k): KL +inf
    trainer[-2:] = float("nan")  # junk at a masked position (14; position 15 has no entry)
    topk = TopKLogprobs(indptr, rollout.to(dtype), trainer.to(dtype))
    return {"logprobs": lp.to(dtype), "rollout_logprobs": mu.to(dtype), "loss_mask": mask, "advantages": adv}, topk


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
@pytest.mark.parametrize("name", list(EXTREME_CONFIGS))
def test_no_nan_or_inf_at_the_extremes(name: str, backend: LossBackend, dtype: torch.dtype) -> None:
    cfg = load_config(None, EXTREME_CONFIGS[name])
    data, topk = _extreme_inputs(dtype)
    lp = data["logprobs"].clone().requires_grad_()
    old = data["logprobs"].detach() + 0.25  # a policy ratio e^-0.25 everywhere: the term depends on the masks
    loss, metrics = GRPOLoss(cfg, backend=backend)(
        lp, old, data["advantages"], data["loss_mask"], rollout_logprobs=data["rollout_logprobs"],
        topk_logprobs=topk if cfg.needs_topk_logprobs else None)
    loss.backward()
    assert torch.isfinite(loss) and bool(torch.isfinite(lp.grad).all()), (loss, lp.grad)
    assert bool((lp.grad[~data["loss_mask"]] == 0).all())
    for key, value in metrics.items():
        if key.startswith("rejected_frac"):
            assert torch.isfinite(value).all() and 0 < value[0] <= value[1], (key, value)


# ------------------------------------------------------------------------------------------------ top-K input
def _topk_call(topk, cfg_mode: str = "topk_tv", check=CheckInputs.DEFERRED, mask=None):
    cfg = load_config(None, [f"trust_region.mode={cfg_mode}", "trust_region.delta_low=0.1"])
    b = make_batch(3, [3, 2], 4, garbage=False)
    return GRPOLoss(cfg)(b["logprobs"], b["old_logprobs"], b["advantages"], b["loss_mask"] if mask is None else mask,
                         rollout_logprobs=b["rollout_logprobs"], topk_logprobs=topk, check_inputs=check)


def _csr(counts: list[int], seed: int = 0) -> TopKLogprobs:
    gen = torch.Generator().manual_seed(seed)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(counts).cumsum(0)])
    nnz = int(indptr[-1])
    rollout = -torch.rand(nnz, generator=gen, dtype=torch.float64) * 3 - 0.5
    return TopKLogprobs(indptr, rollout, rollout + 0.2 * torch.randn(nnz, generator=gen, dtype=torch.float64))


def test_topk_input_is_checked_naming_the_argument() -> None:
    good = _csr([2] * 8)
    with pytest.raises(ValueError, match="topk_logprobs must be given: trust_region.mode=topk_tv"):
        _topk_call(None)
    with pytest.raises(ValueError, match="topk_logprobs is only used by trust_region.mode topk_tv"):
        _topk_call(good, "binary_tv")
    with pytest.raises(TypeError, match="mp_grpo.loss.TopKLogprobs"):
        _topk_call(tuple(good))
    with pytest.raises(ValueError, match=r"topk_logprobs.indptr must be an int64 tensor \[T \+ 1\] = \[9\]"):
        _topk_call(good._replace(indptr=good.indptr[:-1]))
    with pytest.raises(ValueError, match="topk_logprobs.indptr must be an int64"):
        _topk_call(good._replace(indptr=good.indptr.int()))
    with pytest.raises(ValueError, match="topk_logprobs.trainer must be a 1-D floating-point tensor"):
        _topk_call(good._replace(trainer=good.trainer.view(2, -1)))
    with pytest.raises(ValueError, match="topk_logprobs.rollout has 16 entries but topk_logprobs.trainer has 15"):
        _topk_call(good._replace(trainer=good.trainer[:-1]))


def test_topk_structure_empty_rows_and_nonfinite_entries_are_errors() -> None:
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    bad_start = _csr([2] * 8)
    with pytest.raises(ValueError, match="topk_logprobs.indptr is not a CSR row pointer"):
        _topk_call(bad_start._replace(indptr=bad_start.indptr + 1), mask=mask)
    empty = _csr([2, 0, 2, 2, 2, 2, 2, 2])  # a trained position without an entry
    with pytest.raises(ValueError, match="topk_logprobs has no entry at 1 trained position"):
        _topk_call(empty, mask=mask)
    _topk_call(_csr([2, 2, 2, 0, 2, 2, 0, 0]), mask=mask)  # untrained positions may have none
    nan = _csr([2] * 8)
    nan.trainer[2] = float("nan")  # position 1, trained
    nan.trainer[7] = float("nan")  # position 3, masked: no error
    with pytest.raises(ValueError, match="topk_logprobs has a NaN or \\+inf log-prob at 1 trained position"):
        _topk_call(nan, mask=mask)
    with deferred_checks():  # on the device (here: deferred on the CPU) the loss runs; the ledger raises after
        loss, metrics = _topk_call(nan, mask=mask)
        assert torch.isfinite(loss)
        with pytest.raises(ValueError, match="NaN or \\+inf log-prob at 1 trained position"):
            check_errors()
    divergence = topk_divergence(load_config(None, ["trust_region.mode=topk_kl", "trust_region.delta_low=0.1"])
                                 .trust_region.mode, nan, mask, CheckInputs.OFF)
    assert divergence.view(-1)[1] == float("inf")  # dropped by any threshold


def test_topk_divergence_matches_the_reference() -> None:
    """Ragged CSR rows (1 … 5 entries), a whole mass in the top-K (the rest at its floor), −inf entries (probability 0)."""
    gen = torch.Generator().manual_seed(5)
    counts = torch.randint(1, 6, (40,), generator=gen)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    nnz = int(indptr[-1])
    rollout = -torch.rand(nnz, generator=gen, dtype=torch.float64) * 4 - 0.2
    trainer = rollout + 0.5 * torch.randn(nnz, generator=gen, dtype=torch.float64)
    rollout[indptr[3]], rollout[indptr[3] + 1:indptr[4]] = 0.0, -float("inf")  # μ = one id: rest 0 → floor
    trainer[indptr[5]] = -float("inf")
    dense = torch.full((40, 5), -float("inf"), dtype=torch.float64)
    dense_t = dense.clone()
    for i in range(40):
        dense[i, :counts[i]] = rollout[indptr[i]:indptr[i + 1]]
        dense_t[i, :counts[i]] = trainer[indptr[i]:indptr[i + 1]]
    valid = torch.ones(40, dtype=torch.bool)
    for mode in ("topk_tv", "topk_kl"):
        cfg = load_config(None, [f"trust_region.mode={mode}", "trust_region.delta_low=0.1"])
        got = topk_divergence(cfg.trust_region.mode, TopKLogprobs(indptr, rollout, trainer), valid, CheckInputs.SYNC)
        want = topk_divergence_reference(mode, counts, dense, dense_t)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15, msg=mode)
    assert bool(torch.isinf(got[5]))  # KL with π(k) = 0 < μ(k)


# ------------------------------------------------------------------------------------------------ from logits
def test_on_logits_fused_with_topk_trust_region_and_m2po() -> None:
    """``GRPOLoss.on_logits`` on the fused path (the loss kernels merging the log-prob statistics) gives what the
    log-prob op followed by the loss gives, with a top-K trust region and M2PO (its d from the old and rollout
    log-probs, the threshold from the GlobalBatch)."""
    from mp_grpo import vocab_parallel_logprobs

    gen = torch.Generator().manual_seed(9)
    B, W, V = 2, 5, 11
    logits = torch.randn(B, W, V, generator=gen) * 2
    target = torch.randint(0, V, (B, W), generator=gen)
    mask = torch.rand(B, W, generator=gen) < 0.8
    lp = torch.log_softmax(logits.double(), -1).gather(-1, target.unsqueeze(-1)).squeeze(-1).float()
    old = lp + 0.2 * torch.randn(B, W, generator=gen)
    rollout = old + 0.4 * torch.randn(B, W, generator=gen)
    adv = torch.randn(B, generator=gen)
    topk = _csr([3] * (B * W), seed=4)
    topk = TopKLogprobs(topk.indptr, topk.rollout.float(), topk.trainer.float())
    cfg = load_config(None, ["trust_region.mode=topk_tv", "trust_region.delta_low=0.05", "trust_region.delta_high=0.05",
                             "m2po.bound=0.05"])
    batch = GlobalBatch.from_rollouts(cfg, [mask], old_logprobs=[old], rollout_logprobs=[rollout])
    x = logits.clone().requires_grad_()
    loss, metrics = GRPOLoss(cfg, backend=LossBackend.TRITON).on_logits(
        x, target, old, adv, mask, rollout_logprobs=rollout, batch=batch, topk_logprobs=topk)
    loss.backward()
    y = logits.clone().requires_grad_()
    logprobs = vocab_parallel_logprobs(y, target)
    want, want_metrics = GRPOLoss(cfg, backend=LossBackend.TORCH)(
        logprobs, old, adv, mask, rollout_logprobs=rollout, batch=batch, topk_logprobs=topk)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-7)
    for name in ("rejected_frac/trust_region", "rejected_frac/m2po"):
        assert torch.equal(metrics[name], want_metrics[name]) and metrics[name][0] > 0, name
