"""M2PO's step-level mask (mp_grpo/loss/m2po.py, GlobalBatch.from_rollouts step 5): its threshold against the float64
reference's removal loop (ties, zeros, a bound of 0, nothing to keep), the same threshold for any split of the step
into micro-batches, ``from_counts`` with the threshold, and the errors naming what is missing. The data-parallel
gather runs under torchrun in tests/loss/test_layout_invariance.py (the ``dppo_kl_m2po`` feature)."""

from __future__ import annotations

import math

import pytest
import torch

from mp_grpo.config import ConfigError, load_config
from mp_grpo.loss import GlobalBatch, GRPOLoss, StaleGlobalBatchError
from mp_grpo.loss.m2po import m2po_threshold
from tests.loss.helpers import make_batch
from tests.reference import m2po_dropped_reference


def _dropped(values: torch.Tensor, bound: float) -> torch.Tensor:
    return values >= m2po_threshold(values, bound)


@pytest.mark.parametrize("bound", [0.0, 0.01, 0.04, 0.3, 5.0])
@pytest.mark.parametrize("seed", range(4))
def test_threshold_matches_the_removal_loop(seed: int, bound: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    d = torch.randn(37, generator=gen, dtype=torch.float64) * [0.05, 0.2, 1.0, 3.0][seed]
    d[:6] = torch.tensor([0.3, -0.3, 0.3, 0.0, 0.0, -0.1], dtype=torch.float64)  # ties in d², zeros
    cfg = load_config(None, [f"m2po.bound={bound}"]).m2po
    want = m2po_dropped_reference(cfg, d, torch.ones_like(d))
    got = _dropped(d * d, bound)
    assert torch.equal(got, want)
    kept = (d * d)[~got]
    assert kept.numel() == 0 or float(kept.mean()) <= bound


def test_threshold_edges() -> None:
    assert m2po_threshold(torch.zeros(0, dtype=torch.float64), 0.04).item() == math.inf  # no candidate
    assert m2po_threshold(torch.tensor([0.01, 0.02], dtype=torch.float64), 0.04).item() == math.inf  # all kept
    assert m2po_threshold(torch.tensor([0.5, 0.6], dtype=torch.float64), 0.04).item() == 0.5  # none can stay
    ties = torch.tensor([0.0, 0.09, 0.09, 0.09], dtype=torch.float64)  # the prefix {0, .09} has mean .045 > .04
    assert m2po_threshold(ties, 0.05).item() == 0.09  # ties dropped together: the rest {0} has mean 0 ≤ 0.05
    assert m2po_threshold(torch.zeros(5, dtype=torch.float64), 0.0).item() == math.inf  # mean 0 ≤ 0


def _step(seed: int):
    b = make_batch(seed, [5, 3, 0, 6, 2, 4], 7, per_token_advantages=True)
    gen = torch.Generator().manual_seed(seed)
    b["rollout_logprobs"] = torch.where(b["loss_mask"], b["old_logprobs"] + 0.3 * torch.randn(
        b["loss_mask"].shape, generator=gen, dtype=torch.float64), b["rollout_logprobs"])
    return b


@pytest.mark.parametrize("scope", ["all", "clip_quadrants"])
def test_the_threshold_is_the_steps_for_any_split(scope: str) -> None:
    """One micro-batch, two and three of other widths: the same threshold, and the summed shares and gradients are
    those of one call."""
    cfg = load_config(None, ["m2po.bound=0.02", f"m2po.scope={scope}", "rollout_correction.weight_level=token"])
    b = _step(3)
    splits = [[slice(0, 6)], [slice(0, 2), slice(2, 6)], [slice(0, 1), slice(1, 4), slice(4, 6)]]
    results = []
    for split in splits:
        parts = {k: [b[k][rows] for rows in split] for k in ("loss_mask", "old_logprobs", "rollout_logprobs",
                                                             "advantages", "logprobs")}
        gb = GlobalBatch.from_rollouts(cfg, parts["loss_mask"], old_logprobs=parts["old_logprobs"],
                                       rollout_logprobs=parts["rollout_logprobs"], advantages=parts["advantages"])
        lp = b["logprobs"].clone().requires_grad_()
        total = 0.0
        for rows in split:
            loss, metrics = GRPOLoss(cfg)(lp[rows], b["old_logprobs"][rows], b["advantages"][rows],
                                          b["loss_mask"][rows], rollout_logprobs=b["rollout_logprobs"][rows], batch=gb)
            total = total + loss
        total.backward()
        results.append((gb.m2po_threshold, total.detach(), lp.grad))
    tau = results[0][0]
    assert math.isfinite(tau.item())  # the step drops tokens
    for got in results[1:]:
        assert torch.equal(got[0], tau)
        torch.testing.assert_close(got[1], results[0][1], rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(got[2], results[0][2], rtol=1e-12, atol=1e-15)


def test_from_counts_takes_the_threshold() -> None:
    cfg = load_config(None, ["m2po.bound=0.02"])
    b = _step(4)
    full = GlobalBatch.from_rollouts(cfg, [b["loss_mask"]], old_logprobs=[b["old_logprobs"]],
                                     rollout_logprobs=[b["rollout_logprobs"]])
    counts = GlobalBatch.from_counts(valid_tokens=full.valid_tokens, valid_sequences=full.valid_sequences,
                                     micro_batches=1, config=cfg, device="cpu", m2po_threshold=full.m2po_threshold)
    args = (b["logprobs"], b["old_logprobs"], b["advantages"], b["loss_mask"])
    want = GRPOLoss(cfg)(*args, rollout_logprobs=b["rollout_logprobs"], batch=full)
    got = GRPOLoss(cfg)(*args, rollout_logprobs=b["rollout_logprobs"], batch=counts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1]["rejected_frac/m2po"], want[1]["rejected_frac/m2po"])
    with pytest.raises(ValueError, match="m2po_threshold must be given: config m2po.bound needs a step-level pass"):
        GlobalBatch.from_counts(valid_tokens=full.valid_tokens, config=cfg, device="cpu")
    with pytest.raises(ValueError, match="m2po_threshold ≥ 0"):
        GlobalBatch.from_counts(valid_tokens=full.valid_tokens, config=cfg, device="cpu", m2po_threshold=float("nan"))
    GlobalBatch.from_counts(valid_tokens=3, config=cfg, device="cpu", m2po_threshold=math.inf)  # nothing dropped
    with pytest.raises(StaleGlobalBatchError, match="m2po.bound"):
        GRPOLoss(cfg)(*args, rollout_logprobs=b["rollout_logprobs"], batch=GlobalBatch.from_masks([b["loss_mask"]]))


def test_what_m2po_needs_is_named() -> None:
    cfg = load_config(None, ["m2po.bound=0.02", "m2po.scope=clip_quadrants"])
    b = _step(5)
    with pytest.raises(ValueError, match="old_logprobs must be given .*m2po.bound"):
        GlobalBatch.from_rollouts(cfg, [b["loss_mask"]], rollout_logprobs=[b["rollout_logprobs"]])
    with pytest.raises(ValueError, match="advantages must be given to GlobalBatch.from_rollouts: m2po.scope"):
        GlobalBatch.from_rollouts(cfg, [b["loss_mask"]], old_logprobs=[b["old_logprobs"]],
                                  rollout_logprobs=[b["rollout_logprobs"]])
    with pytest.raises(ValueError, match="rollout_logprobs must be given: the config's rollout_correction / mismatch / "
                                         "trust_region / m2po settings"):
        GRPOLoss(cfg)(b["logprobs"], b["old_logprobs"], b["advantages"], b["loss_mask"])


@pytest.mark.parametrize("overrides,key", [
    (["m2po.bound=-0.1"], "m2po.bound"),
    (["m2po.scope=clip_quadrants"], "m2po.scope"),
    (["m2po.bound=0.04", "rollout_correction.bypass=true"], "m2po.bound"),
    (["trust_region.delta_low=0.1"], "trust_region.delta_low"),
    (["trust_region.direction=symmetric"], "trust_region.direction"),
    (["trust_region.mode=binary_tv"], "trust_region.mode"),
    (["trust_region.mode=topk_kl", "trust_region.delta_high=-0.2"], "trust_region.delta_high"),
    (["trust_region.mode=ratio"], "trust_region.mode"),
])
def test_config_errors_name_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)
