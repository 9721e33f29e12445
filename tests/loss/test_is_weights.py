"""GRPOLoss(is_weights=...): a precomputed per-token IS weight (verl's rollout_is_weights) in place of the computed
rollout-correction weight — float64 parity with the computed weight at token and sequence level for every
objective that takes it, against verl's loss reference, and its errors."""

from __future__ import annotations

import pytest
import torch

from mp_grpo.config import load_config
from mp_grpo.loss import GlobalBatch, GRPOLoss, LossBackend
from tests.loss.helpers import make_batch
from tests.reference import verl_actor_loss_reference
from tests.tolerances import assert_close

LENGTHS = [5, 0, 3, 6, 2]
T = 6
OBJECTIVES = {
    "ppo_clip_dual": ["policy.dual_clip_c=3.0", "policy.eps_high=0.28"],
    "gspo": ["policy.objective=gspo", "policy.eps_low=0.01", "policy.eps_high=0.02"],
    "gspo_token": ["policy.objective=gspo", "policy.gspo_gradient=token", "policy.eps_low=0.01",
                   "policy.eps_high=0.02"],
    "cispo": ["policy.objective=cispo", "policy.eps_low=null", "policy.eps_high=0.1"],
    "sapo": ["policy.objective=sapo"],
    "gmpo": ["policy.objective=gmpo", "policy.eps_low=0.1", "policy.eps_high=0.1"],
    "reinforce_opsm": ["policy.objective=reinforce", "opsm.delta=0.01"],
    "kl_cov": ["policy.objective=kl_cov", "policy.kl_cov_ratio=0.3"],
}


def _run(cfg, batch, **kwargs):
    lp = batch["logprobs"].clone().requires_grad_()
    share, metrics = GRPOLoss(cfg)(lp, batch["old_logprobs"], batch["advantages"], batch["loss_mask"],
                                   batch=GlobalBatch.from_masks([batch["loss_mask"]]), **kwargs)
    upstream = torch.randn((), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (upstream * share).backward()
    return share.detach(), lp.grad, metrics


def _d(batch) -> torch.Tensor:
    """old − rollout on valid tokens (clamped at ±20 like the computed path), 0 elsewhere."""
    mask = batch["loss_mask"]
    d = torch.where(mask, batch["old_logprobs"] - batch["rollout_logprobs"], torch.zeros((), dtype=torch.float64))
    return d.clamp(-20.0, 20.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("objective", list(OBJECTIVES))
def test_given_weights_equal_the_computed_rollout_correction(objective: str, level: str) -> None:
    """is_weights = the truncated ratio the config would compute gives that config's values and gradients."""
    batch = make_batch(31, LENGTHS, T)
    d = _d(batch)
    if level == "sequence":  # exp(Σ d) per sequence, broadcast to its tokens (verl's sequence-level weights)
        d = d.sum(-1, keepdim=True).clamp(-20.0, 20.0).expand_as(d)
    weights = torch.where(batch["loss_mask"], d.exp().clamp(max=1.5), torch.full((), float("nan"), dtype=torch.float64))
    computed = load_config(None, OBJECTIVES[objective] + [f"rollout_correction.weight_level={level}",
                                                          "rollout_correction.weight_max=1.5"])
    given = load_config(None, OBJECTIVES[objective])
    want_share, want_grad, want_metrics = _run(computed, batch, rollout_logprobs=batch["rollout_logprobs"])
    # The rollout log-probs go to both (OPSM measures against them when given); NaN where masked: never read.
    share, grad, metrics = _run(given, batch, is_weights=weights, rollout_logprobs=batch["rollout_logprobs"])
    assert_close(share, want_share, torch.float64, "share")
    assert_close(grad, want_grad, torch.float64, "d/dlogprobs")
    for name in ("policy_loss", "ratio/mean"):
        assert_close(metrics[name], want_metrics[name], torch.float64, name)
    assert_close(metrics["is_weight/given/mean"], want_metrics["is_weight/truncated/mean"], torch.float64, "weights")


def test_given_weights_match_verl_vanilla() -> None:
    """verl multiplies its policy term by rollout_is_weights (compute_policy_loss_vanilla): the verl_ppo preset
    with the same weights equals verl's loss (float64 reference of verl's code)."""
    batch = make_batch(32, LENGTHS, T, garbage=False)
    mask = batch["loss_mask"]
    weights = torch.where(mask, _d(batch).exp().clamp(max=2.0), torch.zeros((), dtype=torch.float64))
    share, grad, _ = _run(load_config("verl_ppo"), batch, is_weights=weights)
    lp = batch["logprobs"].clone().requires_grad_()
    want = verl_actor_loss_reference(lp, batch["old_logprobs"], batch["advantages"].unsqueeze(1).expand_as(lp), mask,
                                     rollout_is_weights=weights)
    (torch.randn((), generator=torch.Generator().manual_seed(5), dtype=torch.float64) * want).backward()
    assert_close(share, want.detach(), torch.float64, "loss")
    assert_close(grad, lp.grad, torch.float64, "d/dlogprobs")


def test_zero_weights_and_rejection() -> None:
    """A zero weight removes a token's policy term (IcePop-style); the config's rejection still applies."""
    batch = make_batch(33, LENGTHS, T)
    mask = batch["loss_mask"]
    ones = torch.ones_like(batch["logprobs"])
    zero_row = ones.clone()
    zero_row[0] = 0.0
    cfg = load_config(None, [])
    share, _, _ = _run(cfg, batch, is_weights=zero_row)
    without_row = batch["loss_mask"].clone()
    without_row[0] = False
    want, _, _ = _run(cfg, {**batch, "loss_mask": without_row}, is_weights=ones)
    # Same numerator; the divisor (valid tokens) still counts row 0's tokens in the first call.
    assert_close(share * mask.sum(), want * without_row.sum(), torch.float64, "zeroed row")
    reject = load_config(None, ["rollout_correction.reject_level=token", "rollout_correction.reject_max=1.0"])
    rejected, _, metrics = _run(reject, batch, is_weights=ones, rollout_logprobs=batch["rollout_logprobs"])
    assert "rejected_frac/rollout" in metrics and metrics["rejected_frac/rollout"][0] > 0
    assert not torch.equal(rejected, _run(cfg, batch, is_weights=ones)[0])


def test_is_weights_errors() -> None:
    batch = make_batch(34, LENGTHS, T)
    args = (batch["logprobs"], batch["old_logprobs"], batch["advantages"], batch["loss_mask"])
    w = torch.ones_like(batch["logprobs"])
    with pytest.raises(ValueError, match="give one weight or the other"):
        GRPOLoss(load_config(None, ["rollout_correction.weight_level=token"]))(
            *args, rollout_logprobs=batch["rollout_logprobs"], is_weights=w)
    with pytest.raises(ValueError, match="vespo puts the IS weight inside"):
        GRPOLoss(load_config(None, ["policy.objective=vespo"]))(*args, is_weights=w)
    with pytest.raises(ValueError, match=r"is_weights has shape \(5, 5\)"):
        GRPOLoss(load_config(None, []))(*args, is_weights=w[:, :5])
    with pytest.raises(TypeError, match="is_weights must be a floating-point tensor"):
        GRPOLoss(load_config(None, []))(*args, is_weights=torch.ones(5, 6, dtype=torch.int64))
    with pytest.raises(ValueError, match="backend TRITON does not implement a precomputed IS weight"):
        GRPOLoss(load_config(None, []), backend=LossBackend.TRITON)(*args, is_weights=w)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weight_is_dropped_counted_and_raised(bad: float) -> None:
    """A NaN / ±inf caller weight at a trained position: that position dropped as if masked (the others' values
    and gradients those of the run with it masked), counted in ``nonfinite_inputs``, raised naming is_weights."""
    batch = make_batch(32, LENGTHS, T)
    cfg = load_config(None, OBJECTIVES["ppo_clip_dual"])
    weights = torch.rand(batch["loss_mask"].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.5
    row, col = 0, 2  # a trained position (LENGTHS[0] = 5)
    assert batch["loss_mask"][row, col]
    poisoned = weights.clone()
    poisoned[row, col] = bad
    step = GlobalBatch.from_masks([batch["loss_mask"]])
    lp = batch["logprobs"].clone().requires_grad_()
    share, metrics = GRPOLoss(cfg)(lp, batch["old_logprobs"], batch["advantages"], batch["loss_mask"], batch=step,
                                   is_weights=poisoned, check_inputs=False)
    share.backward()
    assert torch.isfinite(share) and torch.isfinite(lp.grad).all()
    assert lp.grad[row, col] == 0
    assert metrics["nonfinite_inputs"][0] == 1
    # the same step with that position masked (and the batch's counts unchanged) gives the same share and gradient
    masked = batch["loss_mask"].clone()
    masked[row, col] = False
    lp2 = batch["logprobs"].clone().requires_grad_()
    share2, _ = GRPOLoss(cfg)(lp2, batch["old_logprobs"], batch["advantages"], masked, is_weights=weights,
                              batch=GlobalBatch.from_counts(valid_tokens=step.valid_tokens, device="cpu",
                                                            valid_sequences=step.valid_sequences,
                                                            all_sequences=step.all_sequences, micro_batches=1))
    share2.backward()
    assert_close(share, share2.detach(), torch.float64)
    assert_close(lp.grad, lp2.grad, torch.float64)
    with pytest.raises(ValueError, match="is_weights is NaN or ±inf at 1 trained position"):
        GRPOLoss(cfg)(batch["logprobs"], batch["old_logprobs"], batch["advantages"], batch["loss_mask"], batch=step,
                      is_weights=poisoned)
