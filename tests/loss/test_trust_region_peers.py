"""The trust-region and M2PO presets against each peer's own loss code, re-written in float64 in tests/reference.py
("Peer references: DPPO's divergence trust regions and M2PO"): one micro-batch = the whole step, one process.

* ``trl_dppo`` — TRL's ``DPPOTrainer`` (binary TV / KL, top-K TV / KL from dense ``[B, T, K]`` top-K log-probs, given
  here as the CSR :class:`mp_grpo.loss.TopKLogprobs`), on realistic log-probs and on probabilities at 0 and 1;
* verl's ``dppo_tv`` / ``dppo_kl`` (the ``trl_dppo`` preset with verl's thresholds: the same objective);
* ``prime_rl_dppo`` — prime-rl's ``default_loss_fn`` (its kl_tau term: ``kl.coef=0.002`` with
  ``ref_logprobs=rollout_logprobs``), and #2434's symmetric variant;
* ``nemo_rl_dppo_binary_tv`` — the paper's Eq. 11–12 as open-instruct's #1745 / #1790 write its mask (NeMo-RL #4069's
  code is not public in any stored snapshot);
* ``areal_m2po`` — AReaL's M2PO mask and decoupled loss (its denominator is the count after M2PO: × N / N_kept), and
  ms-swift's ``m2po`` (``m2po.scope=clip_quadrants``).
"""

from __future__ import annotations

import math

import pytest
import torch

from mp_grpo.config import load_config
from mp_grpo.loss import GRPOLoss, LossBackend, TopKLogprobs
from tests.loss.helpers import make_batch
from tests.reference import (
    areal_m2po_loss_reference,
    ms_swift_m2po_loss_reference,
    open_instruct_dppo_mask_reference,
    prime_rl_default_loss_reference,
    trl_dppo_loss_reference,
    verl_dppo_loss_reference,
)
from tests.tolerances import assert_close

LENGTHS = [6, 3, 0, 7, 1, 5]
T = 8
K = 4


def _batch(seed: int, *, extremes: bool = False, spread: float = 0.4, one: float = 0.0) -> dict[str, torch.Tensor]:
    """Per-token advantages (exact zeros among them), rollout log-probs ``spread`` around the trainer's; ``extremes``:
    probabilities of e^one (1 by default) and near 0 on both sides, and equal log-probs."""
    b = make_batch(seed, LENGTHS, T, per_token_advantages=True, garbage=False)
    gen = torch.Generator().manual_seed(seed + 100)
    mask = b["loss_mask"]
    b["rollout_logprobs"] = (b["logprobs"] + torch.randn(mask.shape, generator=gen, dtype=torch.float64) * spread
                             ).clamp(max=0.0)
    b["advantages"] = torch.where(torch.rand(mask.shape, generator=gen) < 0.15, 0.0, b["advantages"])
    if extremes:
        pick = torch.randint(0, 6, mask.shape, generator=gen)
        lp, mu = b["logprobs"].clone(), b["rollout_logprobs"].clone()
        lp = torch.where(pick == 0, one, lp)  # π = 1
        mu = torch.where(pick == 1, one, mu)  # μ = 1
        lp = torch.where(pick == 2, -30.0, lp)  # π ≈ 0
        mu = torch.where(pick == 3, -30.0, mu)  # μ ≈ 0
        mu = torch.where(pick == 4, lp, mu)  # a tie
        b["logprobs"], b["rollout_logprobs"] = lp, mu
    return b


def _ours(cfg, b, *, rollout=True, old=False, ref=None, topk=None, backend=LossBackend.TORCH):
    lp = b["logprobs"].clone().requires_grad_()
    loss, metrics = GRPOLoss(cfg, backend=backend)(
        lp, b["old_logprobs"] if old else None, b["advantages"], b["loss_mask"],
        rollout_logprobs=b["rollout_logprobs"] if rollout else None, ref_logprobs=ref, topk_logprobs=topk)
    loss.backward()
    return loss.detach(), lp.grad, metrics


def _reference(fn, b, *args, **kwargs):
    lp = b["logprobs"].clone().requires_grad_()
    out = fn(lp, *args, **kwargs)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return loss.detach(), torch.zeros_like(lp) if lp.grad is None else lp.grad, out


def _dense_topk(b, seed: int):
    """Dense top-K log-probs ``[B, T, K]`` (the engine's over distinct ids, the trainer's at the same ids, each summing
    to at most 1) and the same as the CSR input over the flattened positions."""
    gen = torch.Generator().manual_seed(seed)
    B = len(LENGTHS)
    weights = torch.rand(B, T, K + 1, generator=gen, dtype=torch.float64) ** 2
    roll = (weights / weights.sum(-1, keepdim=True))[..., :K].log()
    noise = torch.rand(B, T, K + 1, generator=gen, dtype=torch.float64) ** 2 * 0.6 + weights
    cur = (noise / noise.sum(-1, keepdim=True))[..., :K].log()
    indptr = torch.arange(0, B * T * K + 1, K, dtype=torch.int64)
    return cur, roll, TopKLogprobs(indptr, roll.reshape(-1), cur.reshape(-1))


# ------------------------------------------------------------------------------------------------ TRL, verl
TRL_CASES = {  # divergence_type → (overrides, TRL epsilon, epsilon_high)
    "binary_tv": ([], 0.15, 0.15),
    "binary_tv_asymmetric": (["trust_region.delta_low=0.1", "trust_region.delta_high=0.25"], 0.1, 0.25),
    "binary_kl": (["trust_region.mode=binary_kl", "trust_region.delta_low=0.05", "trust_region.delta_high=0.05"],
                  0.05, 0.05),
    "topk_tv": (["trust_region.mode=topk_tv"], 0.15, 0.15),
    "topk_kl": (["trust_region.mode=topk_kl", "trust_region.delta_low=0.05", "trust_region.delta_high=0.03"],
                0.05, 0.03),
}


@pytest.mark.parametrize("extremes", [False, True], ids=["realistic", "probabilities_0_1"])
@pytest.mark.parametrize("case", list(TRL_CASES))
def test_trl_dppo_preset_matches_trl(case: str, extremes: bool) -> None:
    overrides, eps_low, eps_high = TRL_CASES[case]
    # TRL clamps π and μ at 1 − 1e-7 inside its binary KL's log(1 − p) (stated in trl_dppo.yaml): probabilities of
    # 1 − 1e-6 there, the rest of the extremes as for the others
    b = _batch(sum(map(ord, case)), extremes=extremes, one=-1e-6 if case == "binary_kl" else 0.0)
    cfg = load_config("trl_dppo", overrides + ["policy.log_ratio_clamp=null"])
    mode = cfg.trust_region.mode.value
    topk = dense = None
    if mode.startswith("topk"):
        cur, roll, topk = _dense_topk(b, 7)
        dense = dict(current_topk_logps=cur, sampling_topk_logps=roll)
    loss, grad, metrics = _ours(cfg, b, topk=topk)
    want, w_grad, _ = _reference(trl_dppo_loss_reference, b, b["rollout_logprobs"], b["advantages"], b["loss_mask"],
                                 divergence_type=mode, epsilon=eps_low, epsilon_high=eps_high, **(dense or {}))
    assert_close(loss, want, torch.float64, f"{case} loss")
    assert_close(grad, w_grad, torch.float64, f"{case} d/dlogprobs")
    dropped, count = metrics["rejected_frac/trust_region"].tolist()
    assert 0 < dropped < count, f"{case}: the inputs must drop some tokens and keep others ({dropped} of {count})"


def test_trl_dppo_preset_fused_backend() -> None:
    b = _batch(3)
    cfg = load_config("trl_dppo")
    loss, grad, _ = _ours(cfg, b, backend=LossBackend.TRITON)
    want, w_grad, _ = _reference(trl_dppo_loss_reference, b, b["rollout_logprobs"], b["advantages"], b["loss_mask"])
    assert_close(loss, want, torch.float64, "triton loss")
    assert_close(grad, w_grad, torch.float64, "triton d/dlogprobs")


@pytest.mark.parametrize("loss_mode", ["dppo_tv", "dppo_kl"])
def test_verl_dppo_matches_verl(loss_mode: str) -> None:
    """verl's μ is its old_log_prob (the rollout's in its bypass mode): given as rollout_logprobs."""
    b = _batch(11)
    low, high = (0.2, 0.28) if loss_mode == "dppo_tv" else (0.05, 0.08)
    mode = "binary_tv" if loss_mode == "dppo_tv" else "binary_kl"
    cfg = load_config("trl_dppo", [f"trust_region.mode={mode}", f"trust_region.delta_low={low}",
                                   f"trust_region.delta_high={high}"])
    loss, grad, metrics = _ours(cfg, b)
    assert metrics["rejected_frac/trust_region"][0] > 0
    want, w_grad, _ = _reference(lambda lp, *a, **k: verl_dppo_loss_reference(b["rollout_logprobs"], lp, *a, **k), b,
                                 b["advantages"], b["loss_mask"], loss_mode=loss_mode, clip_ratio_low=low,
                                 clip_ratio_high=high)
    assert_close(loss, want, torch.float64, f"{loss_mode} loss")
    assert_close(grad, w_grad, torch.float64, f"{loss_mode} d/dlogprobs")


# ------------------------------------------------------------------------------------------------ prime-rl
@pytest.mark.parametrize("symmetric", [False, True], ids=["default", "pr2434_symmetric"])
def test_prime_rl_preset_matches_prime_rl(symmetric: bool) -> None:
    b = _batch(5)
    overrides = ["policy.log_ratio_clamp=null"] + (["trust_region.direction=symmetric"] if symmetric else ["kl.coef=0.002"])
    cfg = load_config("prime_rl_dppo", overrides)
    loss, grad, _ = _ours(cfg, b, ref=None if symmetric else b["rollout_logprobs"])
    want, w_grad, _ = _reference(prime_rl_default_loss_reference, b, b["rollout_logprobs"], b["advantages"],
                                 b["loss_mask"], symmetric=symmetric)
    assert_close(loss, want, torch.float64, "loss")
    assert_close(grad, w_grad, torch.float64, "d/dlogprobs")


def test_prime_rl_directional_and_symmetric_differ() -> None:
    """The two variants drop different tokens on these inputs (the comparison above means something)."""
    b = _batch(5)
    default = _ours(load_config("prime_rl_dppo"), b)[2]["rejected_frac/trust_region"]
    symmetric = _ours(load_config("prime_rl_dppo", ["trust_region.direction=symmetric"]), b)[2]["rejected_frac/trust_region"]
    assert symmetric[0] > default[0] > 0


# ------------------------------------------------------------------------------------------------ the paper's Eq. 12
@pytest.mark.parametrize("divergence,variant", [("tv", "1745"), ("kl", "1745"), ("tv", "1790"), ("kl", "1790")])
def test_nemo_rl_preset_is_the_papers_mask(divergence: str, variant: str) -> None:
    """The paper's objective Σ M_t r_t A_t / tokens (open-instruct's ``dppo`` loss) with open-instruct's mask; the
    preset's δ on both sides. A = 0 tokens: open-instruct masks none, mp_grpo's directional rule (TRL, verl) may — their
    term is 0 either way."""
    b = _batch(21 + len(variant) + len(divergence))
    delta = 0.15 if divergence == "tv" else 0.04
    overrides = ["policy.log_ratio_clamp=null", f"trust_region.delta_low={delta}", f"trust_region.delta_high={delta}"]
    if divergence == "kl":
        overrides.append("trust_region.mode=binary_kl")
    loss, grad, metrics = _ours(load_config("nemo_rl_dppo_binary_tv", overrides), b)
    assert metrics["rejected_frac/trust_region"][0] > 0

    def open_instruct(lp, mu, adv, mask):
        m = open_instruct_dppo_mask_reference(lp.detach(), mu, adv, mask, divergence, delta, variant=variant)
        ratio = torch.exp(lp - mu)
        return (-adv * ratio * m * mask).sum() / mask.sum()

    want, w_grad, _ = _reference(open_instruct, b, b["rollout_logprobs"], b["advantages"], b["loss_mask"])
    assert_close(loss, want, torch.float64, "loss")
    assert_close(grad, w_grad, torch.float64, "d/dlogprobs")


# ------------------------------------------------------------------------------------------------ M2PO
def _m2po_batch(seed: int) -> dict[str, torch.Tensor]:
    b = make_batch(seed, LENGTHS, T, per_token_advantages=True, garbage=False)
    gen = torch.Generator().manual_seed(seed + 1)
    b["rollout_logprobs"] = b["old_logprobs"] + torch.randn(b["loss_mask"].shape, generator=gen,
                                                            dtype=torch.float64) * 0.3
    return b


def test_areal_m2po_preset_matches_areal() -> None:
    """One micro-batch, one rank: the same tokens dropped; AReaL divides by the tokens M2PO keeps, mp_grpo by every
    valid token (stated in areal_m2po.yaml)."""
    b = _m2po_batch(31)
    loss, grad, metrics = _ours(load_config("areal_m2po"), b, old=True)
    mask = b["loss_mask"]
    want, w_grad, (_, kept) = _reference(areal_m2po_loss_reference, b, b["old_logprobs"], b["rollout_logprobs"],
                                         b["advantages"], mask)
    n, n_kept = float(mask.sum()), float(kept.sum())
    dropped = metrics["rejected_frac/m2po"][0].item()
    assert dropped == n - n_kept > 0, (dropped, n, n_kept)
    assert_close(loss * n / n_kept, want, torch.float64, "loss × N / N_kept")
    assert_close(grad * n / n_kept, w_grad, torch.float64, "d/dlogprobs × N / N_kept")


def test_ms_swift_m2po_matches_ms_swift() -> None:
    """ms-swift's ratio π_θ/μ is r · e^d here (old = the current policy on the step's first pass)."""
    b = _m2po_batch(41)
    b["old_logprobs"] = b["logprobs"].clone()  # the first pass of the step
    cfg = load_config("areal_m2po", ["m2po.scope=clip_quadrants", "rollout_correction.reject_level=null",
                                     "rollout_correction.reject_max=null"])
    loss, grad, metrics = _ours(cfg, b, old=True)
    want, w_grad, (_, kept) = _reference(ms_swift_m2po_loss_reference, b, b["rollout_logprobs"], b["advantages"],
                                         b["loss_mask"])
    assert metrics["rejected_frac/m2po"][0].item() == float((b["loss_mask"] & ~kept).sum()) > 0
    assert_close(loss, want, torch.float64, "loss")
    assert_close(grad, w_grad, torch.float64, "d/dlogprobs")


def test_areal_and_ms_swift_rules_differ_only_at_their_edges() -> None:
    """AReaL keeps its smallest token when every d² exceeds the bound; mp_grpo (and ms-swift) none."""
    b = _m2po_batch(51)
    b["rollout_logprobs"] = torch.where(b["loss_mask"], b["old_logprobs"] - 1.0 - torch.rand(b["loss_mask"].shape,
                                        generator=torch.Generator().manual_seed(2), dtype=torch.float64), 0.0)
    _, _, metrics = _ours(load_config("areal_m2po", ["rollout_correction.reject_level=null",
                                                     "rollout_correction.reject_max=null"]), b, old=True)
    dropped, count = metrics["rejected_frac/m2po"].tolist()
    assert dropped == count
    _, _, (_, kept) = _reference(areal_m2po_loss_reference, b, b["old_logprobs"], b["rollout_logprobs"],
                                 b["advantages"], b["loss_mask"])
    assert int(kept.sum()) == 1 and not math.isnan(dropped)
