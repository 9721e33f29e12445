"""The mismatch lab's experiments (a)–(i) at tiny sizes: the qualitative effects the docs report."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mp_grpo.train.mismatch_lab import __main__ as lab_cli
from mp_grpo.config import load_config
from mp_grpo.train.mismatch_lab import (
    is_correction,
    nan_guard,
    normalizer,
    pairing,
    support_replay,
    top_p_loop,
    top_p_replay,
    training,
    trust_region_loop,
)
from mp_grpo.train.mismatch_lab.policy import PolicyShape, RolloutEngine, TinyPolicy, make_rollouts
from tests.tolerances import tolerance

TINY = PolicyShape(vocab=16, hidden=16, num_prompts=4, group_size=4, min_length=1, max_length=8)


def test_engine_at_zero_noise_agrees_with_trainer_to_bf16():
    gen = torch.Generator().manual_seed(1)
    policy = TinyPolicy(TINY, gen)
    r = make_rollouts(policy, RolloutEngine(policy, 0.0), gen)
    with torch.no_grad():
        trainer = torch.log_softmax(policy(r.prompts, r.tokens), -1).gather(-1, r.tokens[..., None])[..., 0]
    diff = torch.where(r.loss_mask, trainer - r.rollout_logprobs, torch.zeros_like(trainer))
    assert diff.abs().max() < 0.1  # bf16 weights only: small but not zero
    assert diff.abs().max() > 0


def test_grad_norm_ratio_grows_as_is_mean_shrinks():
    setup = is_correction.ISCorrectionSetup(shape=TINY, noise_levels=(0.0, 3.0))
    low, high = is_correction.run(setup)["rows"]
    assert abs(low["is_applied_mean"] - 1) < 0.1
    assert 0.8 < low["grad_norm_ratio"] < 1.25
    assert high["is_applied_mean"] < 0.2
    assert high["grad_norm_ratio"] > 5 * low["grad_norm_ratio"]
    assert high["vllm_kl_k3"] > 10 * low["vllm_kl_k3"]


def test_applied_is_weight_matches_explicit_formula():
    cfg = is_correction.load_config(is_correction.preset_path("trl_dapo"))
    gen = torch.Generator().manual_seed(2)
    old, rollout = torch.randn(6, 5, generator=gen, dtype=torch.float64), torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = torch.rand(6, 5, generator=gen) < 0.7
    raw, applied = is_correction.sequence_is_weights(cfg, old, rollout, mask)
    for s in range(6):
        ratio = math.exp(sum(float(old[s, t] - rollout[s, t]) for t in range(5) if mask[s, t]))
        assert raw[s].item() == pytest.approx(ratio, rel=1e-12)
        assert applied[s].item() == pytest.approx(ratio if ratio <= 3.0 else 0.0, rel=1e-12)


def test_global_normalizer_is_split_invariant_per_micro_batch_is_not():
    setup = normalizer.NormalizerSetup(shape=TINY, splits=(1, 2, 4))
    rows = normalizer.run(setup)["rows"]
    fp32 = tolerance(torch.float32)["rtol"]
    for r in rows:
        if r["normalizer"].startswith("global"):
            assert r["relative_grad_change"] <= fp32, r
    bug = [r for r in rows if r["normalizer"].startswith("per-micro-batch") and r["micro_batches"] == 4]
    assert all(r["relative_grad_change"] > 100 * fp32 for r in bug), bug
    assert len({r["normalizer"] for r in rows}) == 2


def test_unguarded_exp_gives_nan_mp_grpo_stays_finite():
    rows = {r["case"]: r for r in nan_guard.run(nan_guard.NaNGuardSetup(shape=TINY))["rows"]}
    control = rows.pop("clean inputs (control)")
    torch.testing.assert_close(control["unguarded"]["loss"], control["mp_grpo"]["loss"], **tolerance(torch.float32))
    for name, r in rows.items():
        assert not math.isfinite(r["unguarded"]["loss"]) and r["unguarded"]["grad_nonfinite"] > 0, name
        assert math.isfinite(r["mp_grpo"]["loss"]) and r["mp_grpo"]["grad_nonfinite"] == 0, name
        assert r["mp_grpo"]["masked_grad_max"] == 0.0, name
    # garbage confined to masked positions leaves mp_grpo's loss equal to the clean one
    garbage = rows["old log-probs = -1e4 at padding (fill value)"]
    assert garbage["mp_grpo"]["loss"] == control["mp_grpo"]["loss"]


def test_cli_writes_table_and_json(tmp_path):
    assert lab_cli.main(["--experiments", "c", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "nan_guard.json").read_text())
    assert result["experiment"] == "nan_guard" and len(result["rows"]) == len(nan_guard.CASES)
    assert "| case |" in (tmp_path / "nan_guard.md").read_text()


@pytest.mark.parametrize("variant", sorted(training.VARIANTS))
def test_training_variants_are_valid_loss_configs(variant):
    overrides = [o.removeprefix("loss.") for o in training.NO_CORRECTION + training.VARIANTS[variant]]
    cfg = load_config(None, overrides)
    rc = cfg.rollout_correction
    corrections = [rc.weight_level, rc.reject_level, cfg.opsm.delta, cfg.mismatch.skip_threshold]
    active = [c for c in corrections if c is not None]
    assert (not active) if variant == "no correction" else active, (variant, corrections)


def test_training_knob_rises_linearly_from_zero():
    setup = training.TrainingSetup(steps=5, max_noise_std=2.0)
    assert [training.noise_at(setup, s) for s in range(5)] == [0.0, 0.5, 1.0, 1.5, 2.0]


TINY_JOB = ("train.num_microbatches=1", "train.micro_batch_size=8", "rollout.group_size=4", "task.completion_length=3",
            "output.progress_bar=false")
"""A learning job of 8 sequences × 3 completion tokens (the lab's (d) / (e) at test size)."""


@pytest.fixture
def world_of_one(monkeypatch):
    """The lab's runs start a gloo world of one (mp_grpo.train.loop.setup_distributed) on a free port; the
    environment it sets is restored and the group destroyed afterwards, for the tests that follow."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_training_skip_variant_stops_updating_once_the_knob_rises(world_of_one):
    setup = training.TrainingSetup(steps=2, variants=("no correction", "mismatch skip (vllm-kl > 0.1)"),
                                   extra_overrides=("parallel.tensor_model_parallel_size=1", *TINY_JOB))
    runs = training.run(setup)["runs"]
    plain, skip = runs["no correction"]["steps"], runs["mismatch skip (vllm-kl > 0.1)"]["steps"]
    assert [s["noise_std"] for s in plain] == [0.0, 2.0]
    # σ = 0: bf16 only, below the threshold; σ = 2: far above it
    assert plain[0]["vllm_kl"] < 1e-3 < 0.1 < plain[1]["vllm_kl"]
    assert [s["skipped"] for s in plain] == [False, False]
    assert [s["skipped"] for s in skip] == [False, True]
    assert math.isnan(skip[1]["grad_norm"]) and math.isfinite(plain[1]["grad_norm"])  # skipped: no optimizer step
    assert "| mismatch skip (vllm-kl > 0.1) |" in training.table({"runs": runs})


def test_top_p_replay_removes_the_filter_mismatch(world_of_one):
    p = 0.8
    setup = top_p_replay.TopPReplaySetup(top_ps=(p,), engine_dtypes=("fp32",), batches=1, extra_overrides=TINY_JOB)
    rows = {r["trainer"]: r for r in top_p_replay.run(setup)["rows"]}
    full, replay = rows[top_p_replay.TRAINER_MODES[0]], rows[top_p_replay.TRAINER_MODES[1]]
    assert full["tokens"] == replay["tokens"] == 24
    # no replay: every token ratio is the kept mass of its row, in [p, 1), so the mean IS ratio is below 1
    assert p - 1e-5 <= full["token_is_min"] and full["token_is_mean"] < 0.99
    assert full["sequence_is_mean"] < full["token_is_mean"] and full["vllm_kl_k3"] > 1e-4
    # replay with the same (fp32) numerics: the same nucleus, ratios 1 to fp32 rounding
    assert replay["outside_trainer_filter"] == 0
    assert abs(replay["token_is_mean"] - 1) < 1e-5 and abs(replay["sequence_is_mean"] - 1) < 1e-5
    assert replay["vllm_kl_k3"] < 1e-9 and replay["vllm_kl_k3_inside"] == replay["vllm_kl_k3"]
    assert "| fp32 | 0.8 |" in top_p_replay.table({"rows": list(rows.values())})


def test_top_p_loop_replay_restores_the_is_mean(world_of_one):
    """(f) at test size: the loop without replay has IS means below 1 and vllm-kl of the filter's size; with replay
    they are at the bf16 level; the lab's statistics (from the loop's micro-batches) agree with the loop's metric."""
    setup = top_p_loop.TopPLoopSetup(steps=1, variants=("top_p 0.8, no replay", "top_p 0.8, replay"),
                                     extra_overrides=("parallel.tensor_model_parallel_size=1",
                                                      "parallel.sequence_format=padded", *TINY_JOB))
    result = top_p_loop.run(setup)
    (plain,), (replay,) = (result["runs"][v]["steps"] for v in setup.variants)
    assert plain["tokens"] == 24 and replay["tokens"] + round(replay["outside_filter"] * 24) == 24
    assert plain["sequence_is_mean"] < plain["token_is_mean"] < 0.95 and plain["vllm_kl_k3"] > 1e-3
    assert abs(replay["token_is_mean"] - 1) < 0.01 and abs(replay["sequence_is_mean"] - 1) < 0.03
    assert replay["vllm_kl_k3"] < 1e-3
    for s in (plain, replay):  # the lab's float64 statistics and the loop's own mismatch/k3, on the same tokens
        assert s["vllm_kl_k3"] == pytest.approx(s["vllm_kl_loop"], rel=1e-4, abs=1e-9)
    report = top_p_loop.report(result)
    assert "| top_p 0.8, replay |" in report and "Sequence IS mean per step:" in report


def test_mismatch_statistics_match_explicit_formulas():
    gen = torch.Generator().manual_seed(4)
    trainer, engine = -torch.rand(5, 6, generator=gen, dtype=torch.float64) * 3, -torch.rand(5, 6, generator=gen, dtype=torch.float64) * 3
    mask = torch.rand(5, 6, generator=gen) < 0.7
    mask[:, 0] = True
    trainer[0, 0] = float("-inf")  # a token outside the trainer's nucleus: d clamped to -20
    s = top_p_replay.mismatch_statistics(trainer, engine, mask, clamp=20.0)
    ds = [[max(-20.0, float(trainer[i, j] - engine[i, j])) for j in range(6) if mask[i, j]] for i in range(5)]
    flat = [d for row in ds for d in row]
    assert s["tokens"] == len(flat) and s["outside_trainer_filter"] == 1
    assert s["vllm_kl_k3"] == pytest.approx(sum(math.exp(d) - d - 1 for d in flat) / len(flat), rel=1e-12)
    assert s["token_is_mean"] == pytest.approx(sum(math.exp(d) for d in flat) / len(flat), rel=1e-12)
    assert s["token_is_min"] == pytest.approx(min(math.exp(d) for d in flat), rel=1e-12)
    inside = [d for d in flat[1:]]  # row 0's first token is the one outside
    assert s["vllm_kl_k3_inside"] == pytest.approx(sum(math.exp(d) - d - 1 for d in inside) / len(inside), rel=1e-12)
    assert s["sequence_is_mean"] == pytest.approx(sum(math.exp(max(-20.0, sum(r))) for r in ds) / 5, rel=1e-12)


def test_pairing_at_zero_upstream_difference(world_of_one):
    """(g) at test size with no upstream difference (σ = 0: both sides sum the same bf16 products): heads of equal
    precision agree to fp32 arithmetic, a head of the other precision on one side only leaves the bf16 rounding
    between them (NeMo-RL's case); the lab's statistics agree with the loop's own mismatch/k3."""
    setup = pairing.PairingSetup(steps=1, noise_levels=(0.0,), extra_overrides=(
        "parallel.tensor_model_parallel_size=1", "parallel.sequence_format=padded", *TINY_JOB))
    result = pairing.run(setup)
    rms = {(r["trainer"], r["engine"]): r["summary"]["all"]["rms_d"] for r in result["runs"]}
    assert set(rms) == set(pairing.PAIRINGS)
    assert rms["bf16", "bf16"] < 1e-5 and rms["fp32", "fp32"] < 1e-5, rms
    assert rms["fp32", "bf16"] > 1e-3 and rms["bf16", "fp32"] > 1e-3, rms
    for r in result["runs"]:
        (step,) = r["steps"]
        assert step["sums"]["all"]["n"] == 24 and r["summary"]["logit_max_first"] > 15.0
        assert r["summary"]["all"]["vllm_kl_k3"] == pytest.approx(step["vllm_kl_loop"], rel=1e-4, abs=1e-9)
    report = pairing.report(result)
    assert "| 0 | bf16 / bf16 |" in report and "| upstream σ | bf16 / bf16 | fp32 / bf16 |" in report


def test_pairing_statistics_match_explicit_formulas():
    gen = torch.Generator().manual_seed(5)
    old, rollout = -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 4, -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 4
    mask = torch.rand(4, 5, generator=gen) < 0.7
    mask[:, 0] = True
    sums = pairing.pairing_sums(old, rollout, mask, clamp=20.0)
    tokens = [(float(old[i, j] - rollout[i, j]), math.exp(float(rollout[i, j]))) for i in range(4) for j in range(5) if mask[i, j]]
    steps = [{"sums": sums, "reward": 0.5, "skipped": False, "logit_max": 18.0}]
    s = pairing.summarize(steps)
    for name, keep in (("all", lambda p: True), ("p<0.1", lambda p: p < 0.1), ("p>=0.5", lambda p: p >= 0.5)):
        ds = [d for d, p in tokens if keep(p)]
        assert sums[name]["n"] == len(ds)
        if ds:
            assert s[name]["rms_d"] == pytest.approx(math.sqrt(sum(d * d for d in ds) / len(ds)), rel=1e-12)
            assert s[name]["vllm_kl_k3"] == pytest.approx(sum(math.exp(d) - d - 1 for d in ds) / len(ds), rel=1e-12)
            r = [math.exp(d) for d in ds]
            mean = sum(r) / len(r)
            assert s[name]["token_is_std"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in r) / len(r)), rel=1e-9, abs=1e-12)
    seq = [math.exp(sum(float(old[i, j] - rollout[i, j]) for j in range(5) if mask[i, j])) for i in range(4)]
    mean = sum(seq) / 4
    assert s["sequence_is_std"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in seq) / 4), rel=1e-9)


def test_support_replay_removes_the_filter_mismatch(world_of_one):
    """(h) at test size, fp32 engine, top-k 50 of 64 ids: no replay's log ratio is log S token by token (TRL #6789's
    closed form); the captured support gives the engine's distribution to fp32 rounding on every token; the tables."""
    setup = support_replay.SupportReplaySetup(filters=("top_k 50",), engine_dtypes=("fp32",), batches=1, vocab_size=64,
                                              extra_overrides=TINY_JOB)
    result = support_replay.run(setup)
    rows = {r["trainer"]: r for r in result["rows"]}
    full, recomputed, captured = (rows[m] for m in support_replay.TRAINER_MODES)
    assert full["tokens"] == captured["tokens"] == 24
    assert full["token_is_mean"] < 0.99 and full["max_abs_log_ratio_minus_log_kept_mass"] < 1e-5
    assert full["mean_log_ratio"] == pytest.approx(full["mean_log_kept_mass"], abs=1e-5)
    assert captured["outside_trainer_filter"] == 0 and captured["vllm_kl_k3"] < 1e-9
    assert abs(captured["token_is_mean"] - 1) < 1e-5 and abs(captured["sequence_is_mean"] - 1) < 1e-5
    assert recomputed["captured_ids_mean"] == pytest.approx(50.0, abs=1.0)  # k = 50 (ties kept)
    report = support_replay.report(result)
    assert "| fp32 | top_k 50 | captured support (CapturedSupport) | 24 |" in report
    assert "Recomputed filter against the captured set" in report


def test_captured_support_of_the_engine_is_its_kept_set(world_of_one):
    """The engine's captured support holds, for each sampled token, exactly its kept set (the sampler's own
    threshold search on the engine's z) — the sampled token among the ids — and no ids elsewhere."""
    import torch.distributed as dist

    from mp_grpo.config.job import EngineConfig, EngineDtype
    from mp_grpo.train import loop
    from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config, random_full_weights
    from mp_grpo.train.rollout import RolloutEngine

    loop.setup_distributed()  # a world of one (megatron-core's layers want a process group)

    config = cpu_model_config(hidden_size=8)
    model = CpuGPTStandIn(config, vocab_size=40, max_sequence_length=8, tp_group=dist.group.WORLD)
    model.load_full_weights(random_full_weights(config, vocab_size=40, max_sequence_length=8, seed=3))
    engine = RolloutEngine(model, EngineConfig(dtype=EngineDtype.FP32, top_k=7), temperature=1.0, seed=0, tp_group=None)
    gen = engine.generate(torch.tensor([[3, 4], [5, 0]]), torch.tensor([2, 1]), completion_length=3, step=0,
                          sequence_ids=torch.arange(2), capture_support=True)
    counts = gen.support.indptr.diff().view(2, -1)
    assert torch.equal(counts > 0, gen.completion_mask) and bool((counts[gen.completion_mask] == 7).all())
    for i, j in gen.completion_mask.nonzero().tolist():
        k = i * gen.tokens.shape[1] + j
        ids = gen.support.ids[gen.support.indptr[k]:gen.support.indptr[k + 1]]
        assert int(gen.tokens[i, j]) in ids.tolist() and bool((ids.diff() > 0).all())


# ------------------------------------------------------------------------------------------ (i) trust regions
TINY_TRUST_REGION = trust_region_loop.TrustRegionLoopSetup(
    steps=2, noise_levels=(2.0,), seeds=(0,),
    extra_overrides=("parallel.tensor_model_parallel_size=1", "parallel.sequence_format=padded", *TINY_JOB))
"""(i) at test size: every arm, σ = 2 (a mismatch where every rule acts on some tokens, not all), 2 steps."""


def test_trust_region_loop_masks_what_the_float64_rules_mask(world_of_one, monkeypatch):
    """(i) at test size, every arm: the loss's masked fraction is, token for token in count, the float64 rule's on the
    policy's own log-probs (the clip's active side; |π − μ| > δ in the advantage's direction; the top-K TV from the
    engine's 20 ids); no NaN / Inf anywhere; the loop's own vllm-kl is the lab's float64 one. On the captured micro-
    batches, with the loss called directly: its zero-gradient tokens (A ≠ 0) are exactly the rule's, and its top-K
    divergence is the float64 recomputation's from the same ids."""
    from mp_grpo.config.loss import TrustRegion
    from mp_grpo.loss import GRPOLoss, TopKLogprobs
    from mp_grpo.loss.trust_region import topk_divergence
    from mp_grpo.ops.checks import CheckInputs

    captured: dict[str, list] = {}
    measure = trust_region_loop.rollout_statistics

    def capture(policy, micro, loss_cfg, temperature):
        captured.setdefault(loss_cfg.trust_region.mode.value, []).append(
            (policy_state(policy), micro, loss_cfg, temperature, policy))
        return measure(policy, micro, loss_cfg, temperature)

    def policy_state(policy):
        return {k: v.detach().clone() for k, v in policy.state_dict().items() if torch.is_tensor(v)}

    monkeypatch.setattr(trust_region_loop, "rollout_statistics", capture)
    result = trust_region_loop.run(TINY_TRUST_REGION)
    assert [r["arm"] for r in result["runs"]] == list(trust_region_loop.ARMS)
    for run in result["runs"]:
        for s in run["steps"]:
            assert s["nonfinite"] == 0 and s["nonfinite_inputs"] == 0, run["arm"]
            assert s["tokens"] == 24
            assert s["masked_frac"] * s["tokens"] == pytest.approx(s["expected_masked"], abs=1e-6), run["arm"]
            assert s["vllm_kl_loss"] == pytest.approx(s["vllm_kl"], rel=1e-4)
        assert 0 < sum(s["expected_masked"] for s in run["steps"]) < 2 * 24, run["arm"]
    report = trust_region_loop.report(result)
    assert "| 2 | DPPO top-K TV (K = 20) |" in report and "differs from the float64 recomputation: 0." in report
    # --- the loss called directly on the first step's micro-batches, at the policy they were measured with ---
    assert sorted(captured) == ["binary_tv", "none", "topk_tv"]
    for mode, calls in captured.items():
        state, micro, loss_cfg, temperature, policy = calls[0]
        policy.load_state_dict(state, strict=False)
        for mb in micro:
            full = trust_region_loop.policy_logprobs(policy, mb, temperature)
            valid = mb.loss_mask
            lp = full.gather(-1, torch.where(valid, mb.targets, 0).unsqueeze(-1)).squeeze(-1).requires_grad_(True)
            adv = mb.sequences.broadcast(mb.advantages, valid.shape).double()
            topk = divergence = None
            if mode == "topk_tv":
                top = mb.rollout_top_k
                counts = top.ids.indptr.diff()
                position = torch.repeat_interleave(torch.arange(valid.numel()), counts, output_size=top.ids.nnz)
                topk = TopKLogprobs(top.ids.indptr, top.logprobs.double(), full.reshape(-1, full.shape[-1])[position, top.ids.ids])
                divergence = trust_region_loop.topk_tv(full, top)
                from_loss = topk_divergence(TrustRegion.TOPK_TV, topk, valid, CheckInputs.OFF)
                assert torch.allclose(from_loss[valid], divergence[valid], rtol=0, atol=1e-12)
            loss, _ = GRPOLoss(loss_cfg)(lp, None, mb.advantages, valid, rollout_logprobs=mb.rollout_logprobs.double(),
                                         topk_logprobs=topk)
            loss.backward()
            rule = trust_region_loop.masked_by_rule(loss_cfg, lp.detach(), mb.rollout_logprobs.double(), adv, divergence)
            moving = valid & (adv != 0)
            assert torch.equal((lp.grad == 0)[moving], rule[moving]), mode
            assert bool(rule[moving].any()) and not bool(rule[moving].all()), mode
