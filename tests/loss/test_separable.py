"""token_separable: a config it calls separable gives every token a gradient that ignores the other tokens'
log-probs and entropy (what the fused output layer with the loss in forward relies on)."""

from __future__ import annotations

import pytest
import torch

from mp_grpo.config import load_config
from mp_grpo.loss import GlobalBatch, GRPOLoss, LossBackend
from mp_grpo.loss.separable import token_separable
from tests.loss.helpers import AGGREGATIONS, FEATURE_CONFIGS, config, make_batch


def _grads(cfg, data, batch, lp, ent):
    lp = lp.clone().requires_grad_()
    ent = ent.clone().requires_grad_()
    share, _ = GRPOLoss(cfg, backend=LossBackend.TORCH)(
        lp, data["old_logprobs"], data["advantages"], data["loss_mask"], rollout_logprobs=data["rollout_logprobs"],
        ref_logprobs=data["ref_logprobs"], entropy=ent, batch=batch,
    )
    return torch.autograd.grad(share, [lp, ent], allow_unused=True)


def _token_gradient_moves(cfg) -> bool:
    """Whether token (0, 2)'s gradient changes when every other token's log-prob and entropy move."""
    bypass = cfg.rollout_correction.bypass
    data = make_batch(3, [6, 4, 5], 6, garbage=False)
    if bypass:
        data["old_logprobs"] = None
    batch = GlobalBatch.from_rollouts(
        cfg, [data["loss_mask"]], old_logprobs=None if bypass else [data["old_logprobs"]],
        rollout_logprobs=[data["rollout_logprobs"]], entropies=[data["entropy"]],
    )
    gen = torch.Generator().manual_seed(5)
    lp, ent = data["logprobs"], data["entropy"]
    # Token (0, 2) keeps its values; every other token's log-prob and entropy move.
    keep = torch.zeros_like(data["loss_mask"])
    keep[0, 2] = True
    lp2 = torch.where(keep, lp, lp + torch.randn(lp.shape, generator=gen, dtype=lp.dtype) * 0.5)
    ent2 = torch.where(keep, ent, ent + torch.rand(ent.shape, generator=gen, dtype=ent.dtype))
    first, second = _grads(cfg, data, batch, lp, ent), _grads(cfg, data, batch, lp2, ent2)
    same = all(
        (a is None and b is None) or torch.allclose(a[0, 2], b[0, 2], rtol=1e-12, atol=1e-14)
        for a, b in zip(first, second)
    )
    return not same


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
@pytest.mark.parametrize("feature", sorted(FEATURE_CONFIGS))
def test_separable_configs_give_per_token_gradients(feature, aggregation):
    cfg = config(feature, aggregation)
    if token_separable(cfg):
        assert not _token_gradient_moves(cfg), f"{feature}/{aggregation} is called token-separable, but it is not"


@pytest.mark.parametrize("objective", ["gspo", "gmpo"])
def test_sequence_mean_objectives_are_not_separable(objective):
    cfg = load_config(None, [f"policy.objective={objective}", "policy.eps_low=0.9", "policy.eps_high=0.9"])
    assert not token_separable(cfg)
    assert _token_gradient_moves(cfg), "the check above can fail: a sequence-mean objective reads the other tokens"


# The options added for peer parity: each one's claim (separable or not) is checked both ways.
PARITY_OPTIONS = {
    "vespo": ["policy.objective=vespo"],
    "kl_bias_sequence": ["kl.coef=0.05", "kl.bias_correction=true", "kl.bias_correction_level=sequence"],
    "kl_bias_geometric": ["kl.coef=0.05", "kl.bias_correction=true", "kl.bias_correction_level=geometric"],
    "regularizer_mode": ["kl.coef=0.05", "aggregation.mode=seq_mean_token_mean", "aggregation.regularizer_mode=token_mean"],
    "bonus_on_selected": ["entropy.bonus_coef=0.01", "entropy.top_quantile=0.5", "entropy.bonus_on_selected=true"],
}


@pytest.mark.parametrize("name", sorted(PARITY_OPTIONS))
def test_parity_options_separability_is_right(name):
    cfg = load_config(None, PARITY_OPTIONS[name])
    assert token_separable(cfg) == (not _token_gradient_moves(cfg)), name
