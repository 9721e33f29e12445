"""GlobalBatch.unnormalized (mp_grpo/loss/global_batch.py) and step_counts.nonlinear_in_counts: shares with
N = S = 1 times 1/N (token_mean) or 1/S (the seq_mean modes) are the shares of the step's counts — values and
gradients, float64, every feature configuration linear in that count; the configurations that are not are refused
naming the setting; the counts bound no micro-batch."""

from __future__ import annotations

import pytest
import torch

from mp_grpo.config import load_config
from mp_grpo.loss import GlobalBatch, GRPOLoss
from mp_grpo.loss.step_counts import STEP_STATISTICS, divides_by_tokens, nonlinear_in_counts
from tests.loss.helpers import AGGREGATIONS, FEATURE_CONFIGS, TORCH_ONLY_FEATURES, config, make_batch
from tests.tolerances import assert_close

LENGTHS = [4, 0, 2, 5, 3]
T = 6
SPLIT = (slice(0, 2), slice(2, 5))


def _run(cfg, batch, gb, scale: float):
    """Σ shares × ``scale`` of two micro-batches (rows), and the gradients w.r.t. log-probs and entropy."""
    lp = batch["logprobs"].clone().requires_grad_()
    ent = batch["entropy"].clone().requires_grad_()
    loss_fn = GRPOLoss(cfg)
    total = 0.0
    for rows in SPLIT:
        torch.manual_seed(0)  # clip_cov's random selection: the same draw for both batches
        share, _ = loss_fn(lp[rows], batch["old_logprobs"][rows], batch["advantages"][rows], batch["loss_mask"][rows],
                           rollout_logprobs=batch["rollout_logprobs"][rows], ref_logprobs=batch["ref_logprobs"][rows],
                           entropy=ent[rows], batch=gb)
        total = total + share * scale
    total.backward()
    return total.detach(), lp.grad, ent.grad


LINEAR = [(feature, aggregation) for feature in [*FEATURE_CONFIGS, *TORCH_ONLY_FEATURES] for aggregation in AGGREGATIONS
          if not nonlinear_in_counts(config(feature, aggregation))]


@pytest.mark.parametrize("feature,aggregation", LINEAR)
def test_unnormalized_shares_rescaled_are_the_step_shares(feature: str, aggregation: str) -> None:
    cfg = config(feature, aggregation)
    name = f"{feature}/{aggregation}"
    batch = make_batch(7, LENGTHS, T)
    mask = batch["loss_mask"]
    tokens = float(mask.sum())
    sequences = float(len(LENGTHS)) if cfg.aggregation.count_empty_sequences else float(mask.any(-1).sum())
    counts = GlobalBatch.from_counts(valid_tokens=tokens, valid_sequences=float(mask.any(-1).sum()),
                                     all_sequences=float(len(LENGTHS)), device="cpu")
    want = _run(cfg, batch, counts, 1.0)
    n = tokens if divides_by_tokens(cfg.aggregation.mode) else sequences
    got = _run(cfg, batch, GlobalBatch.unnormalized(device="cpu"), 1.0 / n)
    for g, w, what in zip(got, want, ("objective", "d/dlogprobs", "d/dentropy")):
        if w is None:
            assert g is None
        else:
            assert_close(g, w, torch.float64, f"{name}: {what}")


def test_unnormalized_counts_bound_no_micro_batch() -> None:
    gb = GlobalBatch.unnormalized(device="cpu", step=3)
    assert gb.valid_tokens.item() == gb.valid_sequences.item() == gb.all_sequences.item() == 1.0 and not gb.normalized
    gb.check_micro_batch(torch.ones(4, 9, dtype=torch.bool))  # 36 valid tokens > 1: no bound
    gb.check_step(3)
    with pytest.raises(TypeError, match="loss_mask must be a tensor"):
        gb.check_micro_batch([1, 1])


NONLINEAR = {
    "rollout_correction.normalize_weights": ["rollout_correction.weight_level=token",
                                             "rollout_correction.normalize_weights=true"],
    "entropy.top_quantile < 1": ["entropy.top_quantile=0.5"],
    "mismatch.skip_threshold": ["mismatch.skip_threshold=0.1"],
    "nonfinite.skip_step": ["nonfinite.skip_step=true"],
    "nll.positive_coef": ["nll.positive_coef=0.1"],
    "m2po.bound": ["m2po.bound=0.04"],
    "aggregation.regularizer_mode": ["aggregation.mode=seq_mean_token_mean", "aggregation.regularizer_mode=token_mean",
                                     "kl.coef=0.01"],
}


def test_nonlinear_settings_cover_the_step_statistics() -> None:
    assert {stat.key for stat in STEP_STATISTICS} <= set(NONLINEAR)


@pytest.mark.parametrize("key", sorted(NONLINEAR))
def test_unnormalized_refuses_a_config_not_linear_in_its_count(key: str) -> None:
    cfg = load_config("trl_dapo", NONLINEAR[key])
    batch = make_batch(1, [3, 2], 4)
    nll = {"positive": torch.ones(2, dtype=torch.bool), "positive_tokens": torch.tensor(5.0, dtype=torch.float64)} \
        if cfg.nll.positive_coef else {}
    with pytest.raises(ValueError, match=f"^batch \\(GlobalBatch.unnormalized\\): .*{key.split(' ')[0]}") as err:
        GRPOLoss(cfg)(batch["logprobs"], batch["old_logprobs"], batch["advantages"], batch["loss_mask"],
                      rollout_logprobs=batch["rollout_logprobs"], ref_logprobs=batch["ref_logprobs"],
                      entropy=batch["entropy"], batch=GlobalBatch.unnormalized(device="cpu"), **nll)
    assert "\n" not in str(err.value)


def test_a_regularizer_mode_dividing_by_the_same_count_is_linear() -> None:
    same = load_config("trl_dapo", ["aggregation.mode=seq_mean_token_mean", "aggregation.regularizer_mode=seq_mean_token_sum",
                                    "kl.coef=0.01"])
    assert nonlinear_in_counts(same) == []
    without_terms = load_config("trl_dapo", ["aggregation.mode=seq_mean_token_mean",
                                             "aggregation.regularizer_mode=token_mean", "kl.coef=0"])
    assert nonlinear_in_counts(without_terms) == []
