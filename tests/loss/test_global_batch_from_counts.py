"""GlobalBatch.from_counts (mp_grpo/loss/global_batch.py, mp_grpo/loss/step_counts.py): parity with from_masks /
from_rollouts in float64 (values and gradients identical), its errors, the per-micro-batch check of a counts batch."""

from __future__ import annotations

import math

import pytest
import torch

from mp_grpo.config import load_config
from mp_grpo.loss import GlobalBatch, GRPOLoss, StaleGlobalBatchError, reduce_metrics
from mp_grpo.ops.checks import check_errors, deferred_checks
from tests.loss.helpers import AGGREGATIONS, DIVERGENCE_FEATURES, FEATURE_CONFIGS, make_batch

LENGTHS = [4, 0, 2, 5, 0, 3]  # two empty sequences: valid sequences (4) ≠ all sequences (6)
T = 6
SPLIT = ((slice(0, 2), slice(0, 5)), (slice(2, 6), slice(0, 6)))  # two micro-batches of other shapes


def _parts(batch: dict[str, torch.Tensor], name: str) -> list[torch.Tensor]:
    x = batch[name]
    return [x[rows] if x.dim() == 1 else x[rows, cols] for rows, cols in SPLIT]


def _run(cfg, batch, gb, seed: int):
    """Σ shares of both micro-batches, their metrics, and d(upstream · Σ shares)/d logprobs, entropy."""
    lp = batch["logprobs"].clone().requires_grad_()
    ent = batch["entropy"].clone().requires_grad_()
    data = {**batch, "logprobs": lp, "entropy": ent}
    loss_fn = GRPOLoss(cfg)
    total, metrics = 0.0, []
    for i in range(len(SPLIT)):
        share, m = loss_fn(
            _parts(data, "logprobs")[i], _parts(data, "old_logprobs")[i], _parts(data, "advantages")[i],
            _parts(data, "loss_mask")[i], rollout_logprobs=_parts(data, "rollout_logprobs")[i],
            ref_logprobs=_parts(data, "ref_logprobs")[i], entropy=_parts(data, "entropy")[i], batch=gb)
        total = total + share
        metrics.append(m)
    upstream = torch.randn((), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    (upstream * total).backward()
    return total.detach(), metrics, lp.grad, ent.grad


def _counts_of(gb: GlobalBatch) -> dict[str, int]:
    return {"valid_tokens": int(gb.valid_tokens), "valid_sequences": int(gb.valid_sequences),
            "all_sequences": int(gb.all_sequences), "micro_batches": int(gb.num_micro_batches)}


def _assert_identical(got, want) -> None:
    total, metrics, grad_lp, grad_ent = got
    assert torch.equal(total, want[0]), (total, want[0])
    assert torch.equal(grad_lp, want[2])
    assert (grad_ent is None and want[3] is None) or torch.equal(grad_ent, want[3])
    for m, w in zip(metrics, want[1]):
        assert m.keys() == w.keys()
        for k in m:
            assert torch.equal(m[k], w[k]), k


@pytest.mark.parametrize("count_empty", [False, True], ids=["valid_sequences", "all_sequences"])
@pytest.mark.parametrize("aggregation", list(AGGREGATIONS))
def test_counts_of_the_masks_give_the_same_loss_and_gradients(aggregation: str, count_empty: bool) -> None:
    """Both meanings of "sequences": from_counts with only the count the config divides by (plus the
    tokens) equals from_masks — values, gradients and metrics, bit for bit in float64."""
    batch = make_batch(11, LENGTHS, T)
    cfg = load_config(None, ["kl.coef=0.05", "entropy.bonus_coef=0.01", *AGGREGATIONS[aggregation],
                             f"aggregation.count_empty_sequences={str(count_empty).lower()}"])
    masks_gb = GlobalBatch.from_masks(_parts(batch, "loss_mask"))
    counts = _counts_of(masks_gb)
    assert (counts["valid_sequences"], counts["all_sequences"]) == (4, 6)
    want = _run(cfg, batch, masks_gb, seed=1)
    only = "all_sequences" if count_empty else "valid_sequences"
    counts_gb = GlobalBatch.from_counts(valid_tokens=counts["valid_tokens"], micro_batches=2, device="cpu",
                                        **{only: counts[only]})
    _assert_identical(_run(cfg, batch, counts_gb, seed=1), want)
    # The counts as 0-dim tensors (NeMo-RL, Megatron-LM hand tensors): the same.
    as_tensors = GlobalBatch.from_counts(**{k: torch.tensor(v) for k, v in counts.items()}, device=torch.device("cpu"))
    _assert_identical(_run(cfg, batch, as_tensors, seed=1), want)


@pytest.mark.parametrize("feature", ["cispo_tis_normalized", "sapo_entropy_kl", "reinforce_opsm_skip",
                                     "ppo_seq_reject_kl_st", "dppo_kl_m2po"])
def test_step_statistics_passed_in_give_the_same_loss_and_gradients(feature: str) -> None:
    """A config that needs step-level passes: the statistics from_rollouts computes, handed to from_counts
    (as a loop would after its own pass), give the same values, gradients and metrics."""
    batch = make_batch(12, LENGTHS, T)
    cfg = load_config(None, {**FEATURE_CONFIGS, **DIVERGENCE_FEATURES}[feature])
    full = GlobalBatch.from_rollouts(cfg, _parts(batch, "loss_mask"), old_logprobs=_parts(batch, "old_logprobs"),
                                     rollout_logprobs=_parts(batch, "rollout_logprobs"),
                                     entropies=_parts(batch, "entropy"))
    stats = {name: getattr(full, name) for name in ("weight_mean", "entropy_threshold", "mismatch_k3", "m2po_threshold")
             if getattr(full, name) is not None}
    assert stats, "the feature must need a step-level pass"
    counts_gb = GlobalBatch.from_counts(**_counts_of(full), config=cfg, device="cpu", **stats)
    if full.skip is not None:
        assert torch.equal(counts_gb.skip, full.skip)
    _assert_identical(_run(cfg, batch, counts_gb, seed=2), _run(cfg, batch, full, seed=2))


def test_step_level_pass_missing_is_refused_naming_it() -> None:
    batch = make_batch(13, LENGTHS, T)
    counts = dict(valid_tokens=14, valid_sequences=4, all_sequences=6, device="cpu")
    norm = load_config(None, ["rollout_correction.weight_level=token", "rollout_correction.normalize_weights=true"])
    top = load_config(None, ["entropy.top_quantile=0.5"])
    skip = load_config(None, ["mismatch.skip_threshold=0.1"])
    with pytest.raises(ValueError, match=r"weight_mean must be given: config rollout_correction.normalize_weights needs"):
        GlobalBatch.from_counts(**counts, config=norm)
    with pytest.raises(ValueError, match=r"entropy_threshold must be given: config entropy.top_quantile < 1"):
        GlobalBatch.from_counts(**counts, config=top)
    with pytest.raises(ValueError, match=r"mismatch_k3 must be given: config mismatch.skip_threshold"):
        GlobalBatch.from_counts(**counts, config=skip)
    # Built without config (counts only), then used with a config that needs a pass: refused at the loss.
    gb = GlobalBatch.from_counts(**counts)
    part = {k: _parts(batch, k)[0] for k in ("logprobs", "old_logprobs", "advantages", "loss_mask", "entropy",
                                              "rollout_logprobs")}
    with pytest.raises(StaleGlobalBatchError, match=r"entropy.top_quantile < 1 needs entropy_threshold"):
        GRPOLoss(top)(part["logprobs"], part["old_logprobs"], part["advantages"], part["loss_mask"],
                      entropy=part["entropy"], batch=gb)
    with pytest.raises(StaleGlobalBatchError, match=r"mismatch.skip_threshold needs mismatch_k3"):
        GRPOLoss(skip)(part["logprobs"], part["old_logprobs"], part["advantages"], part["loss_mask"],
                       rollout_logprobs=part["rollout_logprobs"], batch=gb)
    # Given with the config they were computed for, but the loss runs another config.
    built = GlobalBatch.from_counts(**counts, config=top, entropy_threshold=0.7)
    with pytest.raises(StaleGlobalBatchError, match="different LossConfig"):
        GRPOLoss(load_config(None, ["entropy.top_quantile=0.4"]))(
            part["logprobs"], part["old_logprobs"], part["advantages"], part["loss_mask"], entropy=part["entropy"],
            batch=built)


@pytest.mark.parametrize(("overrides", "missing"), [
    (["aggregation.mode=seq_mean_token_mean"], "valid_sequences"),
    (["aggregation.mode=seq_mean_token_sum", "aggregation.count_empty_sequences=true"], "all_sequences"),
    (["aggregation.mode=token_mean", "aggregation.regularizer_mode=seq_mean_token_mean", "kl.coef=0.1"],
     "valid_sequences"),
])
def test_sequence_count_missing_is_refused_naming_it(overrides: list[str], missing: str) -> None:
    batch = make_batch(14, LENGTHS, T)
    other = "all_sequences" if missing == "valid_sequences" else "valid_sequences"
    gb = GlobalBatch.from_counts(valid_tokens=14, device="cpu", **{other: 4})
    part = {k: _parts(batch, k)[0] for k in ("logprobs", "old_logprobs", "advantages", "loss_mask", "ref_logprobs")}
    with pytest.raises(StaleGlobalBatchError, match=f"without {missing}: pass {missing}= to GlobalBatch.from_counts"):
        GRPOLoss(load_config(None, overrides))(part["logprobs"], part["old_logprobs"], part["advantages"],
                                               part["loss_mask"], ref_logprobs=part["ref_logprobs"], batch=gb)


def test_micro_batches_missing_leaves_only_the_step_totals_nan() -> None:
    batch = make_batch(15, LENGTHS, T)
    gb = GlobalBatch.from_counts(valid_tokens=14, device="cpu")
    _, metrics, _, _ = _run(load_config(None, []), batch, gb, seed=3)
    reduced = reduce_metrics(metrics)
    assert math.isnan(reduced["loss"]) and math.isnan(reduced["valid_tokens"])
    assert math.isnan(reduced["nonfinite_inputs"])  # a step total too
    assert all(math.isfinite(v) for k, v in reduced.items() if k not in ("loss", "valid_tokens", "nonfinite_inputs"))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"valid_tokens": None}, TypeError, "valid_tokens must be given"),
    ({"valid_tokens": -1}, ValueError, "valid_tokens ≥ 0"),
    ({"valid_tokens": float("nan")}, ValueError, "valid_tokens is finite"),
    ({"valid_tokens": float("inf")}, ValueError, "valid_tokens is finite"),
    ({"valid_tokens": 3.5}, ValueError, "valid_tokens is a whole number"),
    ({"valid_tokens": True}, TypeError, "valid_tokens must be a Python number or a 0-dim tensor, got bool"),
    ({"valid_tokens": "12"}, TypeError, "valid_tokens must be a Python number"),
    ({"valid_tokens": torch.tensor([12])}, ValueError, r"valid_tokens must be a Python number or a 0-dim tensor, got a tensor of shape \(1,\)"),
    ({"all_sequences": torch.tensor(True)}, TypeError, "all_sequences must be a real number"),
    ({"valid_sequences": 7}, ValueError, "valid_sequences ≤ all_sequences"),
    ({"valid_sequences": 13, "all_sequences": 20}, ValueError, r"valid_sequences ≤ valid_tokens"),
    ({"valid_sequences": 0}, ValueError, "valid_sequences ≥ 1 when valid_tokens > 0"),
    ({"all_sequences": 0, "valid_sequences": None}, ValueError, "all_sequences ≥ 1 when valid_tokens > 0"),
    ({"micro_batches": 0}, ValueError, "micro_batches ≥ 1"),
    ({"micro_batches": 1.5}, ValueError, "micro_batches is a whole number"),
    ({"device": 0}, TypeError, "device must be a torch.device"),
    ({"device": "gpu"}, ValueError, "device"),
    ({"step": 1.0}, TypeError, "step must be an int"),
    ({"config": {}}, TypeError, "config must be a LossConfig"),
    ({"weight_mean": 1.0}, ValueError, "weight_mean is given without config="),
    ({"entropy_threshold": 0.5, "config": "plain"}, ValueError, r"entropy_threshold is given but config does not use it"),
])
def test_from_counts_errors(kwargs, error, match) -> None:
    args = {"valid_tokens": 12, "valid_sequences": 3, "all_sequences": 6, "device": "cpu"} | kwargs
    if args.get("config") == "plain":
        args["config"] = load_config(None, [])
    with pytest.raises(error, match=match):
        GlobalBatch.from_counts(**{k: v for k, v in args.items() if v is not None or k == "valid_tokens"})


@pytest.mark.parametrize(("name", "overrides", "value", "match"), [
    ("weight_mean", ["rollout_correction.weight_level=token", "rollout_correction.normalize_weights=true"], 0.0,
     "weight_mean > 0"),
    ("weight_mean", ["rollout_correction.weight_level=token", "rollout_correction.normalize_weights=true"],
     float("nan"), "weight_mean is finite"),
    ("entropy_threshold", ["entropy.top_quantile=0.5"], float("inf"), "entropy_threshold is finite"),
    ("mismatch_k3", ["mismatch.skip_threshold=0.1"], -0.1, "mismatch_k3 ≥ 0"),
])
def test_statistic_errors(name: str, overrides: list[str], value: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GlobalBatch.from_counts(valid_tokens=5, device="cpu", config=load_config(None, overrides), **{name: value})


def test_tensor_counts_are_checked_on_the_device_and_deferred() -> None:
    """A tensor count is checked without a host read: at once on the CPU, at check_errors() where deferred."""
    with pytest.raises(ValueError, match="valid_tokens is a whole number"):
        GlobalBatch.from_counts(valid_tokens=torch.tensor(2.5), device="cpu")
    with deferred_checks():
        GlobalBatch.from_counts(valid_tokens=torch.tensor(5), valid_sequences=torch.tensor(7.0),
                                all_sequences=torch.tensor(6, dtype=torch.int32), device="cpu")
    with pytest.raises(ValueError, match=r"broke valid_sequences ≤ valid_tokens .*; valid_sequences ≤ all_sequences"):
        check_errors()
    check_errors()  # cleared once raised


def test_check_micro_batch_of_a_counts_batch() -> None:
    """Without masks, a counts batch checks what its counts bound: a micro-batch with more valid tokens, or
    more rows with a valid token, than the step is refused (deferred like the other device checks)."""
    batch = make_batch(16, LENGTHS, T)
    part = {k: _parts(batch, k)[1] for k in ("logprobs", "old_logprobs", "advantages", "loss_mask")}  # 10 tokens, 3 rows
    loss_fn = GRPOLoss(load_config(None, []))
    args = (part["logprobs"], part["old_logprobs"], part["advantages"], part["loss_mask"])
    loss_fn(*args, batch=GlobalBatch.from_counts(valid_tokens=10, valid_sequences=3, device="cpu"))  # fits exactly
    with pytest.raises(StaleGlobalBatchError, match=r"valid tokens 10 > the step's valid_tokens 9"):
        loss_fn(*args, batch=GlobalBatch.from_counts(valid_tokens=9, device="cpu"))
    with pytest.raises(StaleGlobalBatchError, match=r"rows with a valid token 3 > the step's all_sequences 2"):
        loss_fn(*args, batch=GlobalBatch.from_counts(valid_tokens=10, all_sequences=2, device="cpu"))
    with deferred_checks():
        loss_fn(*args, batch=GlobalBatch.from_counts(valid_tokens=20, valid_sequences=2, device="cpu"))
    with pytest.raises(StaleGlobalBatchError, match=r"rows with a valid token 3 > the step's valid_sequences 2"):
        check_errors()
    with pytest.raises(ValueError, match="on the tokens' device"):
        GlobalBatch.from_counts(valid_tokens=10, device="meta").check_micro_batch(part["loss_mask"])
