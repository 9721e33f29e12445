"""The options only the torch path implements (VESPO, GSPO-token, separate KL / entropy aggregation, the
sequence-level KL bias correction, the bonus on selected tokens, ``kl_logprobs``, the adaptive entropy
coefficient) against the float64 reference of tests/reference.py, and their routing: ``LossBackend.AUTO``
takes the torch path for them, ``LossBackend.TRITON`` refuses them when the GRPOLoss is built."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from mp_grpo.config import ConfigError, load_config
from mp_grpo.loss import AdaptiveEntropyCoefficient, GRPOLoss, LossBackend, fused_unsupported
from tests.loss.helpers import AGGREGATIONS, TORCH_ONLY_FEATURES, config, make_batch
from tests.reference import grpo_objective_reference
from tests.tolerances import assert_close

LENGTHS = [5, 3, 0, 6, 1, 4]
T = 7


def _leaves(batch):
    return batch["logprobs"].clone().requires_grad_(), batch["entropy"].clone().requires_grad_()


def _compare(cfg, batch, *, backend=LossBackend.TORCH, kl_logprobs=None, entropy_coef=None):
    lp, ent = _leaves(batch)
    kl_lp = None if kl_logprobs is None else kl_logprobs.clone().requires_grad_()
    loss, metrics = GRPOLoss(cfg, backend=backend)(
        lp, batch["old_logprobs"], batch["advantages"], batch["loss_mask"],
        rollout_logprobs=batch["rollout_logprobs"], ref_logprobs=batch["ref_logprobs"], entropy=ent,
        kl_logprobs=kl_lp, entropy_coef=entropy_coef,
    )
    (loss * 0.7).backward()
    r_lp, r_ent = _leaves(batch)
    r_kl = None if kl_logprobs is None else kl_logprobs.clone().requires_grad_()
    j = grpo_objective_reference(
        cfg, r_lp, batch["old_logprobs"], batch["advantages"], batch["loss_mask"],
        rollout_logprobs=batch["rollout_logprobs"], ref_logprobs=batch["ref_logprobs"], entropy=r_ent,
        kl_logprobs=r_kl, entropy_coef=entropy_coef,
    )
    (j * 0.7).backward()
    assert_close(loss, j, torch.float64, "loss")
    for name, got, want in (("logprobs", lp, r_lp), ("entropy", ent, r_ent), ("kl_logprobs", kl_lp, r_kl)):
        if got is None:
            continue
        g = torch.zeros_like(got) if got.grad is None else got.grad
        w = torch.zeros_like(want) if want.grad is None else want.grad
        assert_close(g, w, torch.float64, f"d/d{name}")
        assert (g[~batch["loss_mask"]] == 0).all(), f"d/d{name} leaks into masked positions"
    return loss, metrics


@pytest.mark.parametrize("aggregation", list(AGGREGATIONS))
@pytest.mark.parametrize("feature", list(TORCH_ONLY_FEATURES))
def test_matches_reference(feature: str, aggregation: str) -> None:
    cfg = config(feature, aggregation)
    batch = make_batch(zlib.crc32(f"{feature}/{aggregation}".encode()), LENGTHS, T)
    _compare(cfg, batch)


@pytest.mark.parametrize("feature", list(TORCH_ONLY_FEATURES))
def test_per_token_advantages_far_off_policy(feature: str) -> None:
    """Per-token advantages, and log-ratios far beyond every clamp (VESPO's [log 1e-8, 20] included)."""
    cfg = config(feature, "token_mean")
    batch = make_batch(11, LENGTHS, T, per_token_advantages=True)
    mask = batch["loss_mask"]
    gen = torch.Generator().manual_seed(5)
    far = torch.randn(mask.shape, generator=gen, dtype=torch.float64) * 15
    for name in ("old_logprobs", "rollout_logprobs"):
        batch[name] = torch.where(mask, batch[name] + far, batch[name])
        far = -far
    loss, _ = _compare(cfg, batch)
    assert torch.isfinite(loss)


def test_vespo_weight_by_hand() -> None:
    """One sequence, on-policy then shifted: φ(1) = 1 and φ(w) = e^λ·w^k·e^(−λw) for w = e^(Σℓ)."""
    cfg = load_config(None, ["policy.objective=vespo"])
    lp = torch.tensor([[-0.5, -1.0, -0.25]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    for shift, adv in ((0.0, 1.0), (0.1, 1.0), (0.1, -1.0)):
        old = lp.detach() - shift
        loss, m = GRPOLoss(cfg)(lp, old, torch.tensor([adv], dtype=torch.float64), mask)
        w = math.exp(3 * shift)
        k, lam = (2.0, 3.0) if adv >= 0 else (3.0, 2.0)
        phi = torch.tensor(math.exp(lam) * w**k * math.exp(-lam * w), dtype=torch.float64)
        assert_close(m["vespo_phi/mean"][0] / m["vespo_phi/mean"][1], phi, torch.float64, "phi")
        assert_close(loss, -phi * adv * lp.detach().sum() / 3, torch.float64, "loss")


def test_kl_logprobs_carry_the_kl_and_its_gradient() -> None:
    cfg = load_config(None, ["kl.coef=0.1", "kl.score_function=true", "aggregation.mode=seq_mean_token_mean"])
    batch = make_batch(4, LENGTHS, T)
    unfiltered = torch.where(batch["loss_mask"], batch["logprobs"] - 0.3, batch["logprobs"])
    _compare(cfg, batch, kl_logprobs=unfiltered)


def test_adaptive_entropy_coefficient() -> None:
    """TRL's controller: applied only while the last step's entropy is ≤ target; ± delta within bounds."""
    cfg = load_config(None, ["entropy.adaptive=true", "entropy.bonus_coef=0.01", "entropy.target=0.5",
                             "entropy.coef_delta=0.004", "entropy.coef_max=0.02", "entropy.top_quantile=0.5"])
    ctl = AdaptiveEntropyCoefficient(cfg.entropy)
    assert ctl.applied == 0.0  # no step measured yet (TRL: last entropy = inf)
    ctl.update(0.4)
    assert ctl.coefficient == pytest.approx(0.014) and ctl.applied == pytest.approx(0.014)
    ctl.update(0.3)
    ctl.update(0.3)
    assert ctl.coefficient == pytest.approx(0.02)  # capped at coef_max
    ctl.update(0.9)
    assert ctl.coefficient == pytest.approx(0.016) and ctl.applied == 0.0
    state = ctl.state_dict()
    other = AdaptiveEntropyCoefficient(cfg.entropy)
    other.load_state_dict(state)
    assert other.state_dict() == state
    # the loss applies the coefficient it is given, like a fixed bonus_coef of that value
    batch = make_batch(8, LENGTHS, T)
    _, metrics = _compare(cfg, batch, entropy_coef=0.25)
    selected = metrics["entropy/selected"]
    ctl.update_from_metrics({"entropy/selected": float(selected[0] / selected[1])})
    with pytest.raises(ValueError, match="entropy_coef"):
        GRPOLoss(cfg)(batch["logprobs"], None, batch["advantages"], batch["loss_mask"], entropy=batch["entropy"])
    with pytest.raises(ValueError, match="entropy_coef"):
        GRPOLoss(load_config(None))(batch["logprobs"], None, batch["advantages"], batch["loss_mask"], entropy_coef=0.1)
    with pytest.raises(ValueError, match="entropy.adaptive"):
        AdaptiveEntropyCoefficient(load_config(None).entropy)


@pytest.mark.parametrize("feature", list(TORCH_ONLY_FEATURES))
def test_auto_routes_to_torch_and_triton_refuses(feature: str, monkeypatch) -> None:
    cfg = config(feature, "token_mean")
    assert fused_unsupported(cfg) is not None
    with pytest.raises(ValueError, match="backend TRITON does not implement"):
        GRPOLoss(cfg, backend=LossBackend.TRITON)
    auto = GRPOLoss(cfg, backend=LossBackend.AUTO)
    assert auto.backend == LossBackend.TORCH and auto._fused is None
    # even for tensors the fused path would take (CUDA), AUTO stays on the torch path
    batch = make_batch(2, LENGTHS, T)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert auto._use_fused(batch["logprobs"], auto_layout()) is False


def auto_layout():
    from mp_grpo.loss import PaddedSequences

    return PaddedSequences()


def test_fused_supported_configs_keep_the_fused_path() -> None:
    cfg = load_config(None, ["policy.objective=gspo", "kl.coef=0.1", "kl.bias_correction=true"])
    assert fused_unsupported(cfg) is None
    assert GRPOLoss(cfg, backend=LossBackend.AUTO)._fused is not None


def test_kl_logprobs_refused_by_triton_and_rerouted_by_auto() -> None:
    cfg = load_config(None, ["kl.coef=0.1"])
    batch = make_batch(6, LENGTHS, T)
    args = (batch["logprobs"], batch["old_logprobs"], batch["advantages"], batch["loss_mask"])
    kwargs = dict(ref_logprobs=batch["ref_logprobs"], kl_logprobs=batch["logprobs"] - 0.1)
    with pytest.raises(ValueError, match="kl_logprobs: backend TRITON"):
        GRPOLoss(cfg, backend=LossBackend.TRITON)(*args, **kwargs)
    auto = GRPOLoss(cfg, backend=LossBackend.AUTO)

    def no_fused(*a, **k):
        raise AssertionError("the fused path ran with kl_logprobs")

    auto._fused = no_fused  # CPU tensors under AUTO never reach it anyway; make sure on any device
    auto._use_fused = lambda *a: True
    loss, _ = auto(*args, **kwargs)
    torch_loss, _ = GRPOLoss(cfg, backend=LossBackend.TORCH)(*args, **kwargs)
    assert_close(loss, torch_loss, torch.float64, "AUTO = TORCH with kl_logprobs")


def test_config_errors_name_the_key() -> None:
    cases = {
        "rollout_correction.weight_level": ["policy.objective=vespo", "rollout_correction.weight_level=sequence"],
        "rollout_correction.reject_level": ["policy.objective=vespo", "rollout_correction.reject_level=geometric",
                                            "rollout_correction.reject_max=2.0"],
        "rollout_correction.normalize_weights": ["policy.objective=vespo", "rollout_correction.weight_level=token",
                                                 "rollout_correction.normalize_weights=true"],
        "policy.gspo_gradient": ["policy.gspo_gradient=token"],
        "policy.vespo_lambda_neg": ["policy.vespo_lambda_neg=-1.0"],
        "kl.bias_correction_level": ["kl.bias_correction_level=geometric"],
        "entropy.bonus_on_selected": ["entropy.bonus_on_selected=true"],
        "aggregation.norm_constant": ["aggregation.regularizer_mode=seq_mean_token_sum_norm"],
        "entropy.bonus_coef": ["entropy.adaptive=true", "entropy.bonus_coef=2.0"],
    }
    for key, overrides in cases.items():
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, overrides)


def test_positive_example_nll_matches_reference_and_splits() -> None:
    """VAPO's NLL: one call (count from the call) = the reference = two micro-batches with a GlobalBatch and
    the step's positive-token count; masked positions get no gradient."""
    from mp_grpo.loss import GlobalBatch

    cfg = load_config(None, ["nll.positive_coef=0.3", "aggregation.mode=seq_mean_token_mean", "kl.coef=0.05"])
    assert fused_unsupported(cfg) is not None
    batch = make_batch(13, LENGTHS, T)
    positive = torch.tensor([True, False, True, True, False, True])
    lp, _ = _leaves(batch)
    args = (batch["old_logprobs"], batch["advantages"], batch["loss_mask"])
    kwargs = dict(ref_logprobs=batch["ref_logprobs"])
    loss, metrics = GRPOLoss(cfg)(lp, *args, positive=positive, **kwargs)
    (loss * 0.7).backward()
    r_lp, _ = _leaves(batch)
    j = grpo_objective_reference(cfg, r_lp, *args, positive=positive, **kwargs)
    (j * 0.7).backward()
    assert_close(loss, j, torch.float64, "loss")
    assert_close(lp.grad, r_lp.grad, torch.float64, "d/dlogprobs")
    assert (lp.grad[~batch["loss_mask"]] == 0).all()
    assert "nll/positive" in metrics
    # split into two micro-batches
    mask = batch["loss_mask"]
    halves = [slice(0, 3), slice(3, 6)]
    gb = GlobalBatch.from_masks([mask[h] for h in halves])
    pos_tok = positive.unsqueeze(1).expand_as(mask)
    count = GlobalBatch.from_masks([(mask & pos_tok)[h] for h in halves]).valid_tokens
    total = torch.zeros((), dtype=torch.float64)
    split_lp, _ = _leaves(batch)
    for h in halves:
        share, _ = GRPOLoss(cfg)(split_lp[h], batch["old_logprobs"][h], batch["advantages"][h], mask[h],
                                 ref_logprobs=batch["ref_logprobs"][h], positive=positive[h], batch=gb,
                                 positive_tokens=count)
        total = total + share
    (total * 0.7).backward()
    assert_close(total, j, torch.float64, "sum of shares")
    assert_close(split_lp.grad, r_lp.grad, torch.float64, "split d/dlogprobs")
    with pytest.raises(ValueError, match="positive_tokens must be given"):
        GRPOLoss(cfg)(split_lp[halves[0]], batch["old_logprobs"][halves[0]], batch["advantages"][halves[0]],
                      mask[halves[0]], ref_logprobs=batch["ref_logprobs"][halves[0]], positive=positive[halves[0]],
                      batch=gb)
    with pytest.raises(ValueError, match="positive must be given"):
        GRPOLoss(cfg)(lp.detach(), *args, **kwargs)
