"""verl's clip_cov and kl_cov (mp_grpo/loss/covariance.py, ``policy.objective=clip_cov | kl_cov``) against
``verl_actor_loss_reference`` in tests/reference.py, re-written in float64 from volcengine/verl b178a3c
(b178a3cd56f58b2d502255daba591e92833930a7) verl/trainer/ppo/core_algos.py ``compute_policy_loss_clip_cov`` /
``compute_policy_loss_kl_cov`` / ``agg_loss``: values and gradients on random inputs, inputs beyond the ±20
clamp, masked positions, config errors, determinism of clip_cov's random selection, the routing away from the
fused kernels, the refusal of context parallelism, and the layout: the selection is per call (per micro-batch,
verl's semantics), so one micro-batch equals the reference and a split into micro-batches equals the reference
taken per micro-batch — not the whole batch's.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from mp_grpo.config import ConfigError, load_config, preset_path
from mp_grpo.loss import GlobalBatch, GRPOLoss, LossBackend, PackedSequences, PaddedSequences, fused_unsupported
from mp_grpo.loss.covariance import covariance_selection
from mp_grpo.loss.separable import token_separable
from tests.loss.helpers import make_batch
from tests.reference import verl_actor_loss_reference
from tests.tolerances import assert_close

LENGTHS = [5, 3, 0, 6, 1, 4, 7]
T = 8
VERL_SEQ_MEAN_RTOL = 1e-7
"""verl's seq-mean-token-mean divides each row by (n + 1e-8): relative 1e-8 / n off the exact mean."""

# name → (mp_grpo overrides, verl arguments). Ratios large enough to select several of the ~26 valid tokens;
# the covariance window is where random inputs put many tokens (|cov| ~ 1), so clip_cov draws among them.
CASES = {
    "clip_cov": (["policy.objective=clip_cov", "policy.clip_cov_ratio=0.2", "policy.clip_cov_lb=0.05",
                  "policy.clip_cov_ub=5.0", "policy.eps_high=0.28"],
                 dict(loss_mode="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=0.05, clip_cov_ub=5.0,
                      clip_ratio_high=0.28)),
    "clip_cov_window_kl_entropy": (
        ["policy.objective=clip_cov", "policy.clip_cov_ratio=0.5", "policy.clip_cov_lb=-0.3", "policy.clip_cov_ub=0.4",
         "kl.coef=0.05", "entropy.bonus_coef=0.01"],
        dict(loss_mode="clip_cov", clip_cov_ratio=0.5, clip_cov_lb=-0.3, clip_cov_ub=0.4, kl_loss_coef=0.05,
             entropy_coeff=0.01)),
    "clip_cov_defaults": (["policy.objective=clip_cov"], dict(loss_mode="clip_cov")),
    "kl_cov": (["policy.objective=kl_cov", "policy.kl_cov_ratio=0.2", "policy.ppo_kl_coef=1.0"],
               dict(loss_mode="kl_cov", kl_cov_ratio=0.2, ppo_kl_coef=1.0)),
    "kl_cov_defaults_kl": (["policy.objective=kl_cov", "kl.coef=0.05"], dict(loss_mode="kl_cov", kl_loss_coef=0.05)),
}
AGGREGATIONS = {
    "token_mean": (["aggregation.mode=token_mean"], "token-mean"),
    "seq_mean_token_mean": (["aggregation.mode=seq_mean_token_mean", "aggregation.count_empty_sequences=true"],
                            "seq-mean-token-mean"),
    "seq_mean_token_sum": (["aggregation.mode=seq_mean_token_sum", "aggregation.count_empty_sequences=true"],
                           "seq-mean-token-sum"),
}


def _batch(seed: int, *, far: bool = False, garbage: bool = False, lengths=LENGTHS) -> dict[str, torch.Tensor]:
    batch = make_batch(seed, lengths, T, garbage=garbage)
    if far:  # |log π − log π_old| and |ref − log π| up to ~60: beyond the ±20 clamps
        mask = batch["loss_mask"]
        gen = torch.Generator().manual_seed(seed + 1)
        for name, scale in (("old_logprobs", 20.0), ("ref_logprobs", 25.0)):
            shift = torch.randn(mask.shape, generator=gen, dtype=torch.float64) * scale
            batch[name] = torch.where(mask, batch[name] + shift, batch[name])
    return batch


def _keys(seed: int, shape) -> torch.Tensor:
    """The keys GRPOLoss draws for clip_cov from ``torch.Generator().manual_seed(seed)`` (covariance.py)."""
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _ours(cfg, batch, *, seed: int = 0, layout=None, gb=None):
    lp = batch["logprobs"].clone().requires_grad_()
    ent = batch["entropy"].clone().requires_grad_()
    gen = torch.Generator().manual_seed(seed) if cfg.policy.objective.value == "clip_cov" else None
    loss, metrics = GRPOLoss(cfg)(lp, batch["old_logprobs"], batch["advantages"], batch["loss_mask"],
                                  ref_logprobs=batch["ref_logprobs"], entropy=ent, generator=gen, layout=layout,
                                  batch=gb)
    (loss * 0.7).backward()
    return loss.detach(), lp.grad, torch.zeros_like(ent) if ent.grad is None else ent.grad, metrics


def _verl(kwargs, batch, *, seed: int = 0, agg: str = "token-mean"):
    lp = batch["logprobs"].clone().requires_grad_()
    ent = batch["entropy"].clone().requires_grad_()
    adv = batch["advantages"].unsqueeze(1).expand_as(lp)
    loss = verl_actor_loss_reference(lp, batch["old_logprobs"], adv, batch["loss_mask"],
                                     ref_log_prob=batch["ref_logprobs"], entropy=ent, loss_agg_mode=agg,
                                     selection_keys=_keys(seed, lp.shape), **kwargs)
    (loss * 0.7).backward()
    return loss.detach(), lp.grad, torch.zeros_like(ent) if ent.grad is None else ent.grad


def _assert_matches(ours, want, agg: str, what: str) -> None:
    for got, exp, name in zip(ours[:3], want, ("loss", "d/dlogprobs", "d/dentropy")):
        if agg == "token-mean":
            assert_close(got, exp, torch.float64, f"{what} {name}")
        else:
            torch.testing.assert_close(got, exp, rtol=VERL_SEQ_MEAN_RTOL, atol=1e-12, msg=f"{what} {name}")


# ------------------------------------------------------------------------------ values and gradients vs verl
@pytest.mark.parametrize("far", [False, True], ids=["realistic", "beyond_clamps"])
@pytest.mark.parametrize("aggregation", list(AGGREGATIONS))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_verl(case: str, aggregation: str, far: bool) -> None:
    overrides, kwargs = CASES[case]
    agg_overrides, verl_agg = AGGREGATIONS[aggregation]
    exact = ["policy.log_ratio_clamp=null", "kl.input_clamp=null"] if far else []  # verl clamps neither here
    seed = zlib.crc32(f"{case}/{aggregation}/{far}".encode())
    batch = _batch(seed, far=far)
    if "defaults" in case:  # verl's window (1, 5) needs |A − Ā|·|log π − mean| > 1
        batch["advantages"] = batch["advantages"] * 4
    if "kl.coef=0.05" in overrides and far:
        exact = ["policy.log_ratio_clamp=null"]  # verl's low_var_kl clamps its input at ±20, as mp_grpo's default
    cfg = load_config(None, overrides + agg_overrides + exact)
    ours = _ours(cfg, batch, seed=seed)
    want = _verl(kwargs, batch, seed=seed, agg=verl_agg)
    assert torch.isfinite(want[0])
    _assert_matches(ours, want, verl_agg, f"{case}/{aggregation}")
    assert ours[3]["cov/selected_frac"][0] >= 1, "the case must select at least one token"


@pytest.mark.parametrize("case", ["clip_cov", "kl_cov"])
def test_log_ratio_clamp_binds_beyond_it(case: str) -> None:
    """The override stated in the presets matters: with the ±20 clamp on, the far inputs differ from verl."""
    overrides, kwargs = CASES[case]
    batch = _batch(3, far=True)
    ours = _ours(load_config(None, overrides), batch, seed=3)
    want = _verl(kwargs, batch, seed=3)
    assert not torch.allclose(ours[1], want[1], rtol=1e-6)


@pytest.mark.parametrize("far", [False, True], ids=["realistic", "beyond_clamps"])
@pytest.mark.parametrize("preset", ["verl_clip_cov", "verl_kl_cov"])
def test_presets_match_verl_defaults(preset: str, far: bool) -> None:
    """The presets against verl's defaults (clip_ratio 0.2, clip_cov / kl_cov ratios 2e-4 → one token of a
    micro-batch, clip_cov window (1, 5), ppo_kl_coef 0.1), with large advantages so that clip_cov's window holds
    tokens: as shipped on realistic inputs; beyond the ±20 clamp with the override their files state."""
    batch = _batch(17, far=far)
    batch["advantages"] = batch["advantages"] * 4
    cfg = load_config(preset_path(preset), ["policy.log_ratio_clamp=null"] if far else [])
    ours = _ours(cfg, batch, seed=5)
    want = _verl(dict(loss_mode=cfg.policy.objective.value), batch, seed=5)
    _assert_matches(ours, want, "token-mean", preset)
    assert ours[3]["cov/selected_frac"][0] == 1


def test_masked_positions_never_leak() -> None:
    """inf / NaN in the padding (advantages per token too): the same loss and gradients as finite padding,
    and zero gradient there."""
    for case in ("clip_cov_window_kl_entropy", "kl_cov"):
        cfg = load_config(None, CASES[case][0])
        clean = make_batch(21, LENGTHS, T, per_token_advantages=True, garbage=False)
        dirty = make_batch(21, LENGTHS, T, per_token_advantages=True, garbage=True)
        a, b = _ours(cfg, clean, seed=2), _ours(cfg, dirty, seed=2)
        mask = clean["loss_mask"]
        assert_close(b[0], a[0], torch.float64, case)
        assert_close(b[1], a[1], torch.float64, case)
        assert (b[1][~mask] == 0).all() and (b[2][~mask] == 0).all()


# ------------------------------------------------------------------------------ the selection itself
def test_selection_counts_and_candidates() -> None:
    """clip_cov selects min(max(⌊ratio·n⌋, 1), #candidates) candidates; kl_cov the max(⌊ratio·n⌋, 1) with the
    largest cov."""
    batch = _batch(8)
    mask, adv = batch["loss_mask"], batch["advantages"].unsqueeze(1).expand(len(LENGTHS), T)
    lp, lr = batch["logprobs"], batch["logprobs"] - batch["old_logprobs"]
    n = int(mask.sum())
    cfg = load_config(None, CASES["clip_cov"][0]).policy
    sel = covariance_selection(cfg, lp, lr, adv, mask, torch.Generator().manual_seed(0))
    mean_a, mean_lp = adv[mask].mean(), lp[mask].mean()
    cov = (adv - mean_a) * (lp - mean_lp)
    ratio = lr.exp()
    clipped = -adv * ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) > -adv * ratio
    cand = mask & ~clipped & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    assert int(cand.sum()) > int(n * cfg.clip_cov_ratio) >= 1, "the test needs more candidates than selections"
    assert int(sel.sum()) == int(n * cfg.clip_cov_ratio) and not (sel & ~cand).any()
    kl = load_config(None, CASES["kl_cov"][0]).policy
    sel = covariance_selection(kl, lp, lr, adv, mask)
    k = int(n * kl.kl_cov_ratio)
    top = torch.topk(cov[mask], k).values
    assert int(sel.sum()) == k and torch.equal(cov[sel].sort().values, top.sort().values)
    assert covariance_selection(kl, lp, lr, adv, torch.zeros_like(mask)).sum() == 0  # no valid token: none


def test_clip_cov_is_deterministic_given_the_generator() -> None:
    cfg = load_config(None, CASES["clip_cov"][0])
    batch = _batch(9)
    first, again = _ours(cfg, batch, seed=1), _ours(cfg, batch, seed=1)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    selections = set()
    for seed in range(6):
        lr = batch["logprobs"] - batch["old_logprobs"]
        adv = batch["advantages"].unsqueeze(1).expand(len(LENGTHS), T)
        sel = covariance_selection(cfg.policy, batch["logprobs"], lr, adv, batch["loss_mask"],
                                   torch.Generator().manual_seed(seed))
        selections.add(tuple(sel.nonzero().flatten().tolist()))
    assert len(selections) > 1, "the selection must depend on the generator (it is random among candidates)"
    torch.manual_seed(4)  # generator=None: the default generator, reproducible through torch.manual_seed
    lp = batch["logprobs"]
    a, _ = GRPOLoss(cfg)(lp, batch["old_logprobs"], batch["advantages"], batch["loss_mask"])
    torch.manual_seed(4)
    b, _ = GRPOLoss(cfg)(lp, batch["old_logprobs"], batch["advantages"], batch["loss_mask"])
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------ config and input errors
@pytest.mark.parametrize("override, key", [
    ("policy.clip_cov_ratio=0", "policy.clip_cov_ratio"),
    ("policy.clip_cov_ratio=1.5", "policy.clip_cov_ratio"),
    ("policy.clip_cov_ub=1.0", "policy.clip_cov_ub"),  # not above clip_cov_lb = 1.0
    ("policy.clip_cov_lb=.inf", "policy.clip_cov_lb"),
    ("policy.kl_cov_ratio=0", "policy.kl_cov_ratio"),
    ("policy.kl_cov_ratio=2", "policy.kl_cov_ratio"),
    ("policy.ppo_kl_coef=-0.1", "policy.ppo_kl_coef"),
    ("policy.dual_clip_c=3.0", "policy.dual_clip_c"),  # verl's clip_cov has no dual clip
])
def test_config_errors_name_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, ["policy.objective=clip_cov", override])


def test_defaults_are_verls() -> None:
    """verl b178a3c verl/workers/config/actor.py PolicyLossConfig: 2e-4, 1.0, 5.0, 2e-4, 0.1."""
    p = load_config(None).policy
    got = (p.clip_cov_ratio, p.clip_cov_lb, p.clip_cov_ub, p.kl_cov_ratio, p.ppo_kl_coef)
    assert got == (2e-4, 1.0, 5.0, 2e-4, 0.1)


def test_generator_errors() -> None:
    batch = _batch(1)
    args = (batch["logprobs"], batch["old_logprobs"], batch["advantages"], batch["loss_mask"])
    with pytest.raises(ValueError, match="generator is only used by policy.objective=clip_cov"):
        GRPOLoss(load_config(None, ["policy.objective=kl_cov"]))(*args, generator=torch.Generator())
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        GRPOLoss(load_config(None, ["policy.objective=clip_cov"]))(*args, generator=3)


@pytest.mark.parametrize("objective", ["clip_cov", "kl_cov"])
def test_context_parallel_is_refused(objective: str, monkeypatch) -> None:
    import mp_grpo.loss.input_checks as input_checks

    monkeypatch.setattr(input_checks, "group_size", lambda group: 1 if group is None else 2)
    batch = _batch(1)
    with pytest.raises(ValueError, match="context parallel"):
        GRPOLoss(load_config(None, [f"policy.objective={objective}"]))(
            batch["logprobs"], batch["old_logprobs"], batch["advantages"], batch["loss_mask"],
            layout=PaddedSequences(cp_group=object()))


# ------------------------------------------------------------------------------ backends and separability
@pytest.mark.parametrize("objective", ["clip_cov", "kl_cov"])
def test_fused_backend_routing(objective: str) -> None:
    cfg = load_config(None, [f"policy.objective={objective}"])
    assert f"policy.objective={objective}" in fused_unsupported(cfg)
    assert GRPOLoss(cfg).backend == LossBackend.TORCH  # AUTO takes the torch path
    with pytest.raises(ValueError, match=f"backend TRITON does not implement policy.objective={objective}"):
        GRPOLoss(cfg, backend=LossBackend.TRITON)
    assert not token_separable(cfg)


def test_not_separable_a_token_gradient_reads_the_others() -> None:
    """kl_cov with one selected token: moving another token's log-prob moves the selection, and with it the
    gradient of the token that was selected (what token_separable's False promises)."""
    cfg = load_config(None, ["policy.objective=kl_cov", "policy.kl_cov_ratio=0.01", "policy.ppo_kl_coef=1.0"])
    batch = _batch(12)
    mask = batch["loss_mask"]
    adv = batch["advantages"].unsqueeze(1).expand(len(LENGTHS), T)
    lr = batch["logprobs"] - batch["old_logprobs"]
    sel = covariance_selection(cfg.policy, batch["logprobs"], lr, adv, mask)
    (b0, t0), = sel.nonzero().tolist()
    # Give another valid token with A of the same sign a larger covariance: push its log-prob far out.
    sign = torch.sign(adv[b0, t0] - adv[mask].mean())
    others = mask & (torch.sign(adv - adv[mask].mean()) == sign)
    others[b0, t0] = False
    b1, t1 = others.nonzero()[0].tolist()
    moved = dict(batch)
    moved["logprobs"] = batch["logprobs"].clone()
    moved["logprobs"][b1, t1] = batch["logprobs"][b1, t1] + sign * 30.0
    g_before, g_after = _ours(cfg, batch)[1], _ours(cfg, moved)[1]
    assert not torch.allclose(g_before[b0, t0], g_after[b0, t0], rtol=1e-9)


# ------------------------------------------------------------------------------ layout
def test_micro_batch_split_is_per_micro_batch_verl() -> None:
    """The selection is per call (verl's semantics): split into micro-batches under one GlobalBatch, the step
    equals verl taken on each micro-batch with the step's token count (token-mean: reference_mb · n_mb / N),
    not verl on the whole batch (the split selects ⌊0.2·n_mb⌋ per micro-batch: 2 + 3 ≠ 5 tokens)."""
    overrides, kwargs = CASES["kl_cov"]
    cfg = load_config(None, overrides)
    batch = _batch(13)
    parts = [{k: v[:3] if k != "advantages" else v[:3] for k, v in batch.items()},
             {k: v[3:] if k != "advantages" else v[3:] for k, v in batch.items()}]
    gb = GlobalBatch.from_masks([p["loss_mask"] for p in parts])
    n_total = batch["loss_mask"].sum()
    split = sum(_ours(cfg, p, gb=gb)[0] for p in parts)
    per_mb = sum(_verl(kwargs, p)[0] * p["loss_mask"].sum() / n_total for p in parts)
    whole = _verl(kwargs, batch)[0]
    assert_close(split, per_mb, torch.float64, "split vs verl per micro-batch")
    assert not torch.allclose(split, whole, rtol=1e-6), "the split must select differently from the whole batch"


@pytest.mark.parametrize("case", ["kl_cov", "clip_cov_window_kl_entropy"])
def test_packed_single_micro_batch_equals_padded(case: str) -> None:
    """Packed (THD) rows give the padded result: kl_cov's selection depends only on the valid tokens; clip_cov's
    random keys sit at token positions, so the packed call is given the padded call's keys by packing the
    batch without gaps (one row = one segment of length T: the same flat positions)."""
    cfg = load_config(None, CASES[case][0])
    batch = _batch(14)
    padded = _ours(cfg, batch, seed=6)
    packed = {k: v.reshape(-1) if k != "advantages" else v for k, v in batch.items()}
    layout = PackedSequences(torch.arange(0, T * len(LENGTHS) + 1, T))
    lp = packed["logprobs"].clone().requires_grad_()
    gen = torch.Generator().manual_seed(6) if "clip_cov" in case else None
    loss, _ = GRPOLoss(cfg)(lp, packed["old_logprobs"], packed["advantages"], packed["loss_mask"],
                            ref_logprobs=packed["ref_logprobs"], entropy=packed["entropy"], layout=layout,
                            generator=gen)
    (loss * 0.7).backward()
    assert_close(loss, padded[0], torch.float64, case)
    assert_close(lp.grad.view(len(LENGTHS), T), padded[1], torch.float64, case)
