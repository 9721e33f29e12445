"""GRPOLoss (mp_grpo/loss/grpo_loss.py): values and gradients against the float64 reference, TRL's formulas
checked by hand, NaN safety, empty batches and input errors — for both backends (the plain torch path and
the fused Triton kernels, here under the Triton interpreter; tests/ops/test_grpo_loss.py compares the two)."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from mp_grpo.config import LossConfig, load_config
from mp_grpo.loss import GlobalBatch, GRPOLoss, LossBackend, reduce_metrics
from tests.loss.helpers import AGGREGATIONS, FEATURE_CONFIGS, config, make_batch
from tests.reference import grpo_objective_reference
from tests.tolerances import assert_close

LENGTHS = [5, 3, 0, 6, 1, 4]  # uneven, with an empty sequence
T = 7


@pytest.fixture(params=[LossBackend.TORCH, LossBackend.TRITON], ids=lambda b: b.value)
def backend(request) -> LossBackend:
    """Every numerical test runs on both backends."""
    return request.param


def _run(cfg: LossConfig, batch: dict, backend: LossBackend, *, dtype=torch.float64, old=True, per_call_kwargs=None):
    """Loss and gradients (logprobs, entropy) of one GRPOLoss call on the whole batch, upstream gradient g."""
    lp = batch["logprobs"].clone().requires_grad_()
    ent = batch["entropy"].clone().requires_grad_()
    loss, metrics = GRPOLoss(cfg, backend=backend)(
        lp, batch["old_logprobs"] if old else None, batch["advantages"], batch["loss_mask"],
        rollout_logprobs=batch["rollout_logprobs"],
        ref_logprobs=batch["ref_logprobs"], entropy=ent, **(per_call_kwargs or {}),
    )
    g = 0.7
    (loss * g).backward()
    return loss, _grad(lp), _grad(ent), metrics


def _grad(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x) if x.grad is None else x.grad


def _reference(cfg: LossConfig, batch: dict, *, old=True):
    lp = batch["logprobs"].double().clone().requires_grad_()
    ent = batch["entropy"].double().clone().requires_grad_()
    j = grpo_objective_reference(
        cfg, lp, batch["old_logprobs"] if old else None, batch["advantages"], batch["loss_mask"],
        rollout_logprobs=batch["rollout_logprobs"], ref_logprobs=batch["ref_logprobs"], entropy=ent,
    )
    (j * 0.7).backward()
    return j, _grad(lp), _grad(ent)


@pytest.mark.parametrize("aggregation", list(AGGREGATIONS))
@pytest.mark.parametrize("feature", list(FEATURE_CONFIGS))
def test_matches_reference(feature: str, aggregation: str, backend: LossBackend) -> None:
    cfg = config(feature, aggregation)
    batch = make_batch(zlib.crc32(f"{feature}/{aggregation}".encode()), LENGTHS, T)
    loss, g_lp, g_ent, _ = _run(cfg, batch, backend)
    j, r_lp, r_ent = _reference(cfg, batch)
    assert_close(loss, j, torch.float64, "loss")
    assert_close(g_lp, r_lp, torch.float64, "d/dlogprobs")
    assert_close(g_ent, r_ent, torch.float64, "d/dentropy")
    masked = ~batch["loss_mask"]
    assert (g_lp[masked] == 0).all() and (g_ent[masked] == 0).all()


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo", "gmpo", "sapo", "cispo", "reinforce"])
def test_per_token_advantages_and_on_policy(objective: str, backend: LossBackend) -> None:
    cfg = load_config(None, [f"policy.objective={objective}", "aggregation.mode=seq_mean_token_mean"])
    batch = make_batch(3, LENGTHS, T, per_token_advantages=True)
    for old in (True, False):
        loss, g_lp, _, _ = _run(cfg, batch, backend, old=old)
        j, r_lp, _ = _reference(cfg, batch, old=old)
        assert_close(loss, j, torch.float64, f"loss old={old}")
        assert_close(g_lp, r_lp, torch.float64, f"grad old={old}")


def test_bypass_uses_rollout_as_old(backend: LossBackend) -> None:
    cfg = load_config(None, ["rollout_correction.bypass=true", "rollout_correction.reject_level=token",
                             "rollout_correction.reject_max=1.1", "policy.objective=ppo_clip"])
    batch = make_batch(4, LENGTHS, T)
    loss, g_lp, _, _ = _run(cfg, batch, backend, old=False)
    j, r_lp, _ = _reference(cfg, batch, old=False)
    assert_close(loss, j, torch.float64)
    assert_close(g_lp, r_lp, torch.float64)
    reinforce = load_config(None, ["rollout_correction.bypass=true", "policy.objective=reinforce",
                                   "rollout_correction.weight_level=sequence", "rollout_correction.weight_max=2"])
    loss, g_lp, _, _ = _run(reinforce, batch, backend, old=False)
    j, r_lp, _ = _reference(reinforce, batch, old=False)
    assert_close(g_lp, r_lp, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs(dtype: torch.dtype, backend: LossBackend) -> None:
    cfg = config("ppo_seq_reject_kl_st", "seq_mean_token_mean")
    batch = make_batch(5, LENGTHS, T, dtype=dtype)
    loss, g_lp, g_ent, _ = _run(cfg, batch, backend)
    assert loss.dtype == torch.float32 and g_lp.dtype == dtype
    j, r_lp, r_ent = _reference(cfg, batch)  # the same rounded inputs, upcast
    assert_close(loss, j, torch.float32)
    assert_close(g_lp, r_lp, dtype)


# ------------------------------------------------------------------------------ TRL formulas by hand
# Two sequences: A = +1 with ratios r = [1.5, 0.5, 1.0]; A = −1 with r = [2.0, 1.1]; old log-probs 0,
# so log π_θ = log r. eps = 0.2.
def _trl_batch():
    r = torch.tensor([[1.5, 0.5, 1.0], [2.0, 1.1, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return r.log(), torch.zeros_like(r), torch.tensor([1.0, -1.0], dtype=torch.float64), mask


def _trl_loss(overrides: list[str], backend: LossBackend):
    lp, old, adv, mask = _trl_batch()
    lp = lp.clone().requires_grad_()
    loss, _ = GRPOLoss(load_config(None, overrides), backend=backend)(lp, old, adv, mask)
    loss.backward()
    return loss.item(), lp.grad


def test_trl_dapo_by_hand(backend: LossBackend) -> None:
    # A=+1: −min(r, clip(r, .8, 1.2)) = [−1.2, −0.5, −1.0]; A=−1: max(r, clip(r)) = [2.0, 1.1] → Σ = 0.4.
    # dapo (token_mean): 0.4 / 5 tokens = 0.08.
    loss, grad = _trl_loss([], backend)
    assert loss == pytest.approx(0.08, abs=1e-12)
    # d/d log π = −A·r/5 where unclipped: r=1.5 clipped → 0; 0.5 → −0.1; 1.0 → −0.2; 2.0 → 0.4; 1.1 → 0.22.
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.1, -0.2], [0.4, 0.22, 0.0]], dtype=torch.float64))


def test_trl_grpo_by_hand(backend: LossBackend) -> None:
    # grpo: mean over sequences of token means: (−2.7/3 + 3.1/2) / 2 = (−0.9 + 1.55) / 2 = 0.325.
    loss, grad = _trl_loss(["aggregation.mode=seq_mean_token_mean"], backend)
    assert loss == pytest.approx(0.325, abs=1e-12)
    # gradient of 0.5 · (term / n): r=0.5 → −0.5/6; r=1.0 → −1/6; r=2.0 → 2/4; r=1.1 → 1.1/4.
    expected = torch.tensor([[0.0, -0.5 / 6, -1.0 / 6], [0.5, 0.275, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected)


def test_trl_dr_grpo_by_hand(backend: LossBackend) -> None:
    # dr_grpo with max_completion_length 4: Σ / (2 sequences · 4) = 0.4 / 8 = 0.05.
    loss, _ = _trl_loss(["aggregation.mode=seq_mean_token_sum_norm", "aggregation.norm_constant=4",
                         "aggregation.count_empty_sequences=true"], backend)
    assert loss == pytest.approx(0.05, abs=1e-12)


def test_trl_cispo_by_hand(backend: LossBackend) -> None:
    # TRL cispo, epsilon_high = 5 (cap r at 5, no lower bound) → eps_high = 4, eps_low = null.
    # term = −min(r, 5)·A·log r: A=+1: −(1.5 ln 1.5 + 0.5 ln 0.5 + 0) = −(0.608198 − 0.346574) = −0.261624;
    # A=−1: +(2 ln 2 + 1.1 ln 1.1) = 1.386294 + 0.104841 = 1.491135. Σ = 1.229511, / 5 tokens = 0.245902.
    loss, grad = _trl_loss(["policy.objective=cispo", "policy.eps_high=4.0", "policy.eps_low=null"], backend)
    assert loss == pytest.approx(0.2459022, abs=1e-6)
    # d/d log π = −sg(r)·A / 5: [−0.3, −0.1, −0.2], [0.4, 0.22].
    torch.testing.assert_close(grad, torch.tensor([[-0.3, -0.1, -0.2], [0.4, 0.22, 0.0]], dtype=torch.float64))


def test_trl_sapo_by_hand(backend: LossBackend) -> None:
    # sapo at r = 1 for every token: −(4/τ)·σ(0)·A = −2A/τ: A=+1, τ=1 → −2 (3 tokens); A=−1, τ=1.05 → 2/1.05.
    # TRL's sapo aggregates like grpo: (−2 + 2/1.05) / 2 = −0.047619.
    lp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    cfg = load_config(None, ["policy.objective=sapo", "aggregation.mode=seq_mean_token_mean"])
    loss, _ = GRPOLoss(cfg, backend=backend)(lp, torch.zeros(2, 3, dtype=torch.float64), adv, mask)
    assert loss.item() == pytest.approx((-2.0 + 2.0 / 1.05) / 2, abs=1e-12)
    loss.backward()
    # d term/d log π at r=1: −(4/τ)·τ·σ'(0)·A = −A (σ'(0) = 1/4), then /n/2: −1/6 and +1/4.
    torch.testing.assert_close(lp.grad, torch.tensor([[-1 / 6] * 3, [0.25, 0.25, 0.0]], dtype=torch.float64))


# ------------------------------------------------------------------------------ NaN safety and edges
@pytest.mark.parametrize("feature", list(FEATURE_CONFIGS))
def test_extreme_log_ratios_stay_finite(feature: str, backend: LossBackend) -> None:
    cfg = config(feature, "token_mean")
    batch = make_batch(7, LENGTHS, T, dtype=torch.float32)
    sign = torch.where(torch.rand(batch["logprobs"].shape) < 0.5, -1.0, 1.0)
    for name in ("old_logprobs", "rollout_logprobs", "ref_logprobs"):
        batch[name] = torch.where(batch["loss_mask"], batch["logprobs"] + 1e4 * sign, batch[name])
    loss, g_lp, g_ent, metrics = _run(cfg, batch, backend)
    assert torch.isfinite(loss) and torch.isfinite(g_lp).all() and torch.isfinite(g_ent).all()
    values = reduce_metrics([metrics])
    assert all(math.isfinite(v) for k, v in values.items() if not k.endswith(("/min", "/max"))), values


def test_zero_valid_tokens_gives_exact_zero(backend: LossBackend) -> None:
    for feature in FEATURE_CONFIGS:
        for aggregation in AGGREGATIONS:
            cfg = config(feature, aggregation)
            batch = make_batch(8, [0, 0, 0], T)
            loss, g_lp, g_ent, metrics = _run(cfg, batch, backend)
            assert loss.item() == 0.0 and (g_lp == 0).all() and (g_ent == 0).all(), (feature, aggregation)
            assert reduce_metrics([metrics])["valid_tokens"] == 0.0


def test_skip_gives_zero_loss_and_gradient(backend: LossBackend) -> None:
    cfg = load_config(None, ["mismatch.skip_threshold=1e-9", "kl.coef=0.1"])
    batch = make_batch(9, LENGTHS, T)
    loss, g_lp, _, metrics = _run(cfg, batch, backend)
    assert loss.item() == 0.0 and (g_lp == 0).all()
    assert reduce_metrics([metrics])["mismatch/skipped"] == 1.0


def test_packed_equals_padded_single_call(backend: LossBackend) -> None:
    from mp_grpo.loss import PackedSequences

    cfg = config("gspo_seq_is_geo_reject", "seq_mean_token_mean")
    batch = make_batch(10, LENGTHS, T)
    loss, g_lp, _, _ = _run(cfg, batch, backend)
    # Pack the rows back to back (each row a segment of length T), one trailing junk position.
    packed = {k: torch.cat([v.reshape(-1), v.reshape(-1)[:1]]) if k != "advantages" else v for k, v in batch.items()}
    packed["loss_mask"] = torch.cat([batch["loss_mask"].reshape(-1), torch.ones(1, dtype=torch.bool)])
    layout = PackedSequences(torch.arange(0, T * len(LENGTHS) + 1, T))
    lp = packed["logprobs"].clone().requires_grad_()
    loss_p, _ = GRPOLoss(cfg, backend=backend)(lp, packed["old_logprobs"], packed["advantages"], packed["loss_mask"],
                              rollout_logprobs=packed["rollout_logprobs"], ref_logprobs=packed["ref_logprobs"],
                              entropy=packed["entropy"], layout=layout)
    (loss_p * 0.7).backward()
    assert_close(loss_p, loss, torch.float64)
    assert_close(lp.grad[:-1].view(len(LENGTHS), T), g_lp, torch.float64)
    assert lp.grad[-1] == 0  # the position after the last segment is never valid


def test_metrics_reduce_over_micro_batches(backend: LossBackend) -> None:
    cfg = config("sapo_entropy_kl", "token_mean")
    batch = make_batch(11, LENGTHS, T)
    whole = reduce_metrics([_run(cfg, batch, backend)[3]])
    parts = [{k: v[i:i + 2] for k, v in batch.items()} for i in range(0, len(LENGTHS), 2)]
    gb = GlobalBatch.from_rollouts(cfg, [p["loss_mask"] for p in parts], entropies=[p["entropy"] for p in parts])
    split = reduce_metrics([_run(cfg, p, backend, per_call_kwargs={"batch": gb})[3] for p in parts])
    assert whole.keys() == split.keys()
    for k in whole:
        assert split[k] == pytest.approx(whole[k], rel=1e-12, abs=1e-15), k


# ------------------------------------------------------------------------------ input errors
def _good():
    b = make_batch(12, [3, 2], 4)
    return dict(logprobs=b["logprobs"], old_logprobs=b["old_logprobs"], advantages=b["advantages"],
                loss_mask=b["loss_mask"], rollout_logprobs=b["rollout_logprobs"], ref_logprobs=b["ref_logprobs"],
                entropy=b["entropy"])


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"logprobs": torch.zeros(2, 4, dtype=torch.int64)}, TypeError, "logprobs"),
        ({"logprobs": torch.zeros(8, dtype=torch.float64)}, ValueError, "logprobs"),
        ({"old_logprobs": torch.zeros(2, 5, dtype=torch.float64)}, ValueError, "old_logprobs"),
        ({"old_logprobs": torch.zeros(2, 4, dtype=torch.int32)}, TypeError, "old_logprobs"),
        ({"advantages": torch.zeros(3, dtype=torch.float64)}, ValueError, "advantages"),
        ({"advantages": torch.zeros(2, 1, dtype=torch.float64)}, ValueError, "advantages"),
        ({"advantages": torch.zeros(2, dtype=torch.int64)}, TypeError, "advantages"),
        ({"loss_mask": torch.ones(2, 3, dtype=torch.bool)}, ValueError, "loss_mask"),
        ({"loss_mask": [1, 0]}, TypeError, "loss_mask"),
        ({"rollout_logprobs": torch.zeros(4, 2, dtype=torch.float64)}, ValueError, "rollout_logprobs"),
        ({"ref_logprobs": torch.zeros(2, 4, dtype=torch.bool)}, TypeError, "ref_logprobs"),
        ({"entropy": torch.zeros(1, 4, dtype=torch.float64)}, ValueError, "entropy"),
    ],
)
def test_bad_input_names_the_argument(change, error, match, backend: LossBackend) -> None:
    kwargs = _good() | change
    with pytest.raises(error, match=match):
        GRPOLoss(LossConfig(), backend=backend)(kwargs.pop("logprobs"), kwargs.pop("old_logprobs"),
                                                kwargs.pop("advantages"), kwargs.pop("loss_mask"), **kwargs)


@pytest.mark.parametrize(
    ("overrides", "missing"),
    [
        (["rollout_correction.weight_level=token"], "rollout_logprobs"),
        (["mismatch.skip_threshold=0.1"], "rollout_logprobs"),
        (["kl.coef=0.1"], "ref_logprobs"),
        (["entropy.bonus_coef=0.1"], "entropy"),
        (["entropy.top_quantile=0.5"], "entropy"),
    ],
)
def test_missing_input_for_config(overrides: list[str], missing: str, backend: LossBackend) -> None:
    kwargs = _good()
    kwargs[missing] = None
    with pytest.raises(ValueError, match=missing):
        GRPOLoss(load_config(None, overrides), backend=backend)(kwargs.pop("logprobs"), kwargs.pop("old_logprobs"),
                                               kwargs.pop("advantages"), kwargs.pop("loss_mask"), **kwargs)


def test_bypass_rejects_old_logprobs_and_config_type() -> None:
    kwargs = _good()
    with pytest.raises(ValueError, match="old_logprobs"):
        GRPOLoss(load_config(None, ["rollout_correction.bypass=true"]))(
            kwargs.pop("logprobs"), kwargs.pop("old_logprobs"), kwargs.pop("advantages"), kwargs.pop("loss_mask"),
            **kwargs)
    with pytest.raises(TypeError, match="config"):
        GRPOLoss({"policy": {}})  # type: ignore[arg-type]
