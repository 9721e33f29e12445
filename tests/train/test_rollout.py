"""The rollout engine (mp_grpo/train/rollout.py) on one process: its log-probs against the trainer's and float64.

Knob at zero with fp32 weights: the engine's log-probs equal the float64 reference (and so the trainer's)
to fp32 precision; bf16 weights: to bf16 precision, not exactly; logit noise and lagging weights move
them further. Completions are keyed: the same rows sampled in another batch order are the same.
"""

from __future__ import annotations

import pytest
import torch

from mp_grpo.config.job import EngineConfig, EngineDtype
from mp_grpo.config.precision import LogitDtype
from mp_grpo.train import rollout
from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config, random_full_weights
from mp_grpo.train.rollout import RolloutEngine
from mp_grpo.train.sampler import keyed_normal
from mp_grpo.train.task import make_prompts, successor_reward
from tests.reference import filtered_logprobs_reference, logprobs_reference
from tests.tolerances import assert_close

VOCAB, HIDDEN, MAX_LEN, T = 32, 16, 16, 0.8
LOGIT_OFFSET = 16.0
"""The stand-in's logits at a trained LLM's scale (maximum ~18), where bf16 rounds them in steps of 1/16–1/8."""
FP32_HEAD_MAX_ERROR = 1e-4
"""The fp32 head's largest log-prob error against float64 logits of the same bf16 operands (issue's CPU target):
its fp32 sums over H + 1 = 17 products and its fp32 log-softmax; bf16-rounded logits are off by ~100× more (the test
prints both)."""


@pytest.fixture(scope="module", autouse=True)
def solo_world(tmp_path_factory):
    """A gloo world of one (megatron-core's layers want a TP group object), torn down after the module."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(seed: int = 2, logit_offset: float = 0.0) -> CpuGPTStandIn:
    import torch.distributed as dist

    config = cpu_model_config(hidden_size=HIDDEN)
    m = CpuGPTStandIn(config, vocab_size=VOCAB, max_sequence_length=MAX_LEN, tp_group=dist.group.WORLD,
                      logit_offset_channel=logit_offset != 0.0)
    m.load_full_weights(random_full_weights(config, vocab_size=VOCAB, max_sequence_length=MAX_LEN, seed=seed,
                                            logit_offset=logit_offset))
    return m


def _generate(engine_config: EngineConfig, trainer: CpuGPTStandIn, order=None, *, return_engine: bool = False):
    offset = trainer.logit_offset_channel
    engine = RolloutEngine(_model(seed=99, logit_offset=LOGIT_OFFSET if offset else 0.0), engine_config, temperature=T,
                           seed=5, tp_group=None)
    engine.sync_weights(trainer)
    prompts, lengths = make_prompts(num_prompts=12, min_length=2, max_length=5, modulus=VOCAB, seed=5, step=1)
    ids = torch.arange(12) if order is None else order
    gen = engine.generate(prompts[ids], lengths[ids], completion_length=6, step=1, sequence_ids=ids)
    return (gen, lengths[ids], engine) if return_engine else (gen, lengths[ids])


def _reference_logprobs(trainer: CpuGPTStandIn, gen) -> torch.Tensor:
    with torch.no_grad():
        logits = trainer(gen.tokens, torch.arange(gen.tokens.shape[1]).expand_as(gen.tokens))
    # the logit at s - 1 scores the token at s
    target = torch.where(gen.completion_mask[:, 1:], gen.tokens[:, 1:], torch.full_like(gen.tokens[:, 1:], -100))
    lp, _ = logprobs_reference(logits[:, :-1], target, temperature=T)
    return torch.cat([torch.zeros(lp.shape[0], 1, dtype=lp.dtype), lp], dim=1)


def test_fp32_engine_matches_the_trainer_to_fp32() -> None:
    trainer = _model()
    gen, lengths = _generate(EngineConfig(dtype=EngineDtype.FP32), trainer)
    assert gen.completion_mask.sum(1).tolist() == [6] * 12
    assert bool((gen.tokens[:, :-1].max() < VOCAB))
    ref = _reference_logprobs(trainer, gen)
    assert_close(gen.rollout_logprobs, ref, torch.float32, msg="fp32 engine vs float64 reference")
    assert bool((gen.rollout_logprobs[~gen.completion_mask] == 0).all())
    rewards = successor_reward(gen.tokens, lengths, 6, VOCAB)
    assert rewards.shape == (12,) and bool(((rewards >= 0) & (rewards <= 1)).all())


def test_bf16_engine_and_knobs_move_the_logprobs() -> None:
    trainer = _model()
    fp32, _ = _generate(EngineConfig(dtype=EngineDtype.FP32), trainer)
    bf16, _ = _generate(EngineConfig(dtype=EngineDtype.BF16), trainer)
    mask = bf16.completion_mask
    ref = _reference_logprobs(trainer, bf16)
    assert_close(bf16.rollout_logprobs, ref, torch.bfloat16, msg="bf16 engine vs float64 reference")
    gap_bf16 = float((bf16.rollout_logprobs - ref)[mask].abs().max())
    assert gap_bf16 > 1e-4, "bf16 weights should give a different numerics path"
    noisy, _ = _generate(EngineConfig(dtype=EngineDtype.FP32, logit_noise_std=1.0), trainer)
    gap_noise = float((noisy.rollout_logprobs - _reference_logprobs(trainer, noisy))[noisy.completion_mask].abs().mean())
    assert gap_noise > 0.1
    assert not torch.equal(noisy.tokens, fp32.tokens)


@pytest.mark.parametrize("top_k, top_p", [(0, 0.8), (5, 0.9)])
def test_filtered_engine_samples_the_kept_set_and_reports_its_logprobs(top_k: int, top_p: float) -> None:
    """fp32 engine with top-p (and top-k): every sampled token is in the float64 kept set and the engine's
    log-probs are those of the filtered, renormalized softmax (as vLLM reports them) — above the full-vocabulary
    ones; the filter the trainer replays is the engine's."""
    trainer = _model()
    config = EngineConfig(dtype=EngineDtype.FP32, top_k=top_k, top_p=top_p)
    gen, _ = _generate(config, trainer)
    with torch.no_grad():
        logits = trainer(gen.tokens, torch.arange(gen.tokens.shape[1]).expand_as(gen.tokens))
    target = torch.where(gen.completion_mask[:, 1:], gen.tokens[:, 1:], torch.full_like(gen.tokens[:, 1:], -100))
    ref, _ = filtered_logprobs_reference(logits[:, :-1], target, top_k=top_k or None, top_p=top_p, temperature=T)
    ref = torch.cat([torch.zeros(ref.shape[0], 1, dtype=ref.dtype), ref], dim=1)
    mask = gen.completion_mask
    assert bool(torch.isfinite(ref[mask]).all()), "a sampled token lies outside the float64 kept set"
    assert_close(gen.rollout_logprobs, ref, torch.float32, msg=f"top_k={top_k}, top_p={top_p} engine vs float64 filtered reference")
    full = _reference_logprobs(trainer, gen)
    assert bool((gen.rollout_logprobs[mask] >= full[mask].float() - 1e-6).all())
    assert float((gen.rollout_logprobs - full)[mask].mean()) > 0.05  # the filter drops real mass at T = 0.8
    filt = RolloutEngine(_model(), config, temperature=T, seed=5, tp_group=None).sampling_filter
    assert (filt.top_k, filt.top_p, filt.min_p) == (top_k or None, top_p, None)
    assert RolloutEngine(_model(), EngineConfig(), temperature=T, seed=5, tp_group=None).sampling_filter is None


def test_lagging_weights() -> None:
    engine = RolloutEngine(_model(seed=99), EngineConfig(dtype=EngineDtype.FP32, weight_lag=1), temperature=T, seed=5, tp_group=None)
    first, second = _model(seed=2), _model(seed=3)
    engine.sync_weights(first)
    engine.sync_weights(second)  # lag 1: still the first model's weights
    assert torch.equal(engine.model.mix.weight, first.mix.weight)
    engine.sync_weights(second)
    assert torch.equal(engine.model.mix.weight, second.mix.weight)


def test_completions_do_not_depend_on_batch_order() -> None:
    trainer = _model()
    gen, _ = _generate(EngineConfig(dtype=EngineDtype.FP32), trainer)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    shuffled, _ = _generate(EngineConfig(dtype=EngineDtype.FP32), trainer, order=order)
    assert torch.equal(shuffled.tokens, gen.tokens[order])


def test_engine_config_errors_name_the_key() -> None:
    from mp_grpo.config import ConfigError

    with pytest.raises(ConfigError, match="engine.logit_noise_std"):
        EngineConfig(logit_noise_std=-1.0)
    with pytest.raises(ConfigError, match="engine.weight_lag"):
        EngineConfig(weight_lag=-1)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ConfigError, match="engine.top_p"):
            EngineConfig(top_p=bad)
    for bad in (-1, True):
        with pytest.raises(ConfigError, match="engine.top_k"):
            EngineConfig(top_k=bad)
        with pytest.raises(ConfigError, match="engine.topk_logprobs"):
            EngineConfig(topk_logprobs=bad)


def test_engine_filter_keys_checked_at_load_time() -> None:
    """Typed keys: a top_k that is not an integer, a negative one, a misspelt replay key all fail at load time."""
    from mp_grpo.config import ConfigError
    from mp_grpo.config.job import load_job_config
    from mp_grpo.train.__main__ import config_path

    assert load_job_config(config_path("cpu"), ["engine.top_k=20", "engine.top_p=0.9"]).engine.top_k == 20
    for override, key in (("engine.top_k=-1", "engine.top_k"), ("engine.top_k=2.5", "engine.top_k"),
                          ("engine.replay_filtr=false", "engine.replay_filtr")):
        with pytest.raises(ConfigError, match=key):
            load_job_config(config_path("cpu"), [override])


# ------------------------------------------------------------------------------------------ top-K log-probs
def _dense_top_k(gen, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, S, k]`` ids and log-probs of the generation's top-K CSR (K entries at every completion position, checked)."""
    counts = gen.top_ids.indptr.diff().view(gen.tokens.shape)
    assert torch.equal(counts, gen.completion_mask.to(torch.int64) * k)
    n, width = gen.tokens.shape
    ids = torch.full((n, width, k), -1, dtype=torch.int64)
    lp = torch.zeros(n, width, k, dtype=gen.top_logprobs.dtype)
    ids[gen.completion_mask] = gen.top_ids.ids.view(-1, k)
    lp[gen.completion_mask] = gen.top_logprobs.view(-1, k)
    return ids, lp


def test_engine_top_k_logprobs_are_the_float64_top_k() -> None:
    """fp32 engine, K = 5: at every completion position its 5 ids are the float64 reference's 5 most probable (the
    logit at s − 1 scores the token at s), most probable first, with the reference's log-probs; none elsewhere."""
    trainer = _model()
    gen, _ = _generate(EngineConfig(dtype=EngineDtype.FP32, topk_logprobs=5), trainer)
    ids, lp = _dense_top_k(gen, 5)
    with torch.no_grad():
        logits = trainer(gen.tokens, torch.arange(gen.tokens.shape[1]).expand_as(gen.tokens))
    ref = torch.log_softmax(logits.double() / T, -1)
    ref = torch.cat([torch.zeros_like(ref[:, :1]), ref[:, :-1]], dim=1)  # position s: the distribution of token s
    mask = gen.completion_mask
    best = ref.topk(5, dim=-1)
    assert torch.equal(ids[mask], best.indices[mask])
    assert_close(lp[mask], best.values[mask], torch.float32, msg="engine top-K log-probs vs float64")
    assert bool((lp[mask].diff(dim=-1) <= 0).all())
    assert torch.equal(gen.top_ids.indptr[-1], torch.tensor(int(mask.sum()) * 5))
    assert _generate(EngineConfig(dtype=EngineDtype.FP32), trainer)[0].top_ids is None


def test_engine_top_k_logprobs_under_a_filter_are_of_the_filtered_distribution() -> None:
    """K = the vocabulary with top-p 0.8: the ids outside the kept set have log-prob −inf, the sampled token's entry is
    its reported (filtered) log-prob, and the kept ids' probabilities sum to 1."""
    trainer = _model()
    gen, _ = _generate(EngineConfig(dtype=EngineDtype.FP32, top_p=0.8, topk_logprobs=VOCAB), trainer)
    ids, lp = _dense_top_k(gen, VOCAB)
    mask = gen.completion_mask
    sampled = (ids == gen.tokens.unsqueeze(-1))[mask]
    assert torch.equal(sampled.sum(-1), torch.ones(int(mask.sum()), dtype=torch.int64))
    assert torch.equal(lp[mask][sampled], gen.rollout_logprobs[mask])
    kept = torch.isfinite(lp[mask])
    assert bool((kept.sum(-1) < VOCAB).any()), "top-p 0.8 should drop some ids"
    assert_close(torch.where(kept, lp[mask].double().exp(), 0.0).sum(-1), torch.ones(int(mask.sum()), dtype=torch.float64),
                 torch.float32, msg="kept mass")


def test_top_k_rows_cut_the_csr_by_sequence() -> None:
    trainer = _model()
    gen, _ = _generate(EngineConfig(dtype=EngineDtype.FP32, topk_logprobs=3), trainer)
    ids, lp = _dense_top_k(gen, 3)
    part_ids, part_lp = gen.top_k_rows(4, 7)
    width = gen.tokens.shape[1]
    assert part_ids.indptr.shape == (3 * width + 1,) and int(part_ids.indptr[0]) == 0
    mask = gen.completion_mask[4:7]
    assert torch.equal(part_ids.ids, ids[4:7][mask].reshape(-1))
    assert torch.equal(part_lp, lp[4:7][mask].reshape(-1))
    for bad in ((7, 4), (0, 13), (-1, 2)):
        with pytest.raises(ValueError, match="top_k_rows"):
            gen.top_k_rows(*bad)
    with pytest.raises(ValueError, match="engine.topk_logprobs = 0"):
        _generate(EngineConfig(dtype=EngineDtype.FP32), trainer)[0].top_k_rows(0, 1)
    with pytest.raises(ValueError, match="engine.topk_logprobs"):
        _generate(EngineConfig(dtype=EngineDtype.FP32, topk_logprobs=VOCAB + 1), trainer)


# ------------------------------------------------------------------------------------------ the head's precision
def _engine_sums(engine: RolloutEngine, gen) -> torch.Tensor:
    """``[N, S, V]`` float64 sums of the engine's own head operands (its bf16 hidden states and weight), the logit at
    s − 1 scoring the token at s: what an exact head would compute."""
    captured = {}
    hook = engine.model.output_layer.register_forward_pre_hook(lambda module, args: captured.update(x=args[0]))
    try:
        with torch.no_grad():
            engine.model(gen.tokens, torch.arange(gen.tokens.shape[1]).expand_as(gen.tokens))
    finally:
        hook.remove()
    hidden = captured["x"]  # [S, N, H + 1] in the engine's dtype (no attention: a position sees its own token only)
    return (hidden.double() @ engine.model.output_layer.weight.double().t()).transpose(0, 1)


def _logprobs_of(logits: torch.Tensor, gen) -> torch.Tensor:
    """``[N, S]`` log-probs of the sampled tokens from ``[N, S, V]`` logits (position s − 1 scores the token at s)."""
    lp = torch.log_softmax(logits[:, :-1].double() / T, -1).gather(-1, gen.tokens[:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros(lp.shape[0], 1, dtype=lp.dtype), lp], dim=1)
    return torch.where(gen.completion_mask, lp, torch.zeros_like(lp))


def _noise(gen, lengths: torch.Tensor, std: float) -> torch.Tensor:
    """``[N, S, V]``: the engine's keyed logit noise (seed 5, step 1, rows 0..N−1), at s − 1 for the token at s."""
    n, width = gen.tokens.shape
    pos = torch.arange(width).expand(n, width) + 1  # the logit at s scores the token at s + 1
    noise = keyed_normal(5, 1, torch.arange(n)[:, None, None], pos[..., None], torch.arange(VOCAB)[None, None, :])
    return (std * noise).float().double()


def _fp32_head_error(gen, engine) -> float:
    """Largest |engine log-prob − float64 log-prob of its own operands| over the sampled tokens."""
    exact = _logprobs_of(_engine_sums(engine, gen), gen)
    return float((gen.rollout_logprobs.double() - exact)[gen.completion_mask].abs().max())


def _rounding_head(original):
    """A mutant of :func:`mp_grpo.train.rollout.fp32_head` whose fp32 logits are rounded to bf16."""
    import contextlib

    @contextlib.contextmanager
    def head(model):
        layer = model.output_layer
        with original(model):
            inner = layer.forward
            layer.forward = lambda *args, **kwargs: (inner(*args, **kwargs)[0].bfloat16().float(), None)
            try:
                yield
            finally:
                layer.forward = inner
    return head


def test_fp32_head_keeps_the_engines_logits_in_fp32(monkeypatch) -> None:
    """A bf16 engine at an LLM's logit scale: ``logit_dtype = fp32`` gives the log-probs of its own bf16 operands'
    exact products to ≤ 1e-4; bf16 (the default) those of the logits rounded to bf16 (error measured and printed,
    > 100× the bound); a mutant fp32 head that rounds to bf16 fails the fp32 bound."""
    trainer = _model(logit_offset=LOGIT_OFFSET)
    fp32, _, engine = _generate(EngineConfig(logit_dtype=LogitDtype.FP32), trainer, return_engine=True)
    assert engine.dtype == torch.bfloat16
    sums = _engine_sums(engine, fp32)
    assert 15.0 < float(sums.max(-1).values.mean()) < 30.0, "the logits are not at an LLM's scale"
    error_fp32 = _fp32_head_error(fp32, engine)
    assert error_fp32 <= FP32_HEAD_MAX_ERROR, error_fp32
    bf16, _, engine_bf16 = _generate(EngineConfig(), trainer, return_engine=True)
    assert torch.equal(bf16.completion_mask, fp32.completion_mask)
    error_bf16 = _fp32_head_error(bf16, engine_bf16)
    rounded = _logprobs_of(_engine_sums(engine_bf16, bf16).bfloat16(), bf16)  # the bf16 head: the sums rounded
    assert_close(bf16.rollout_logprobs, rounded, torch.float32, msg="bf16 head vs float64 of the bf16-rounded logits")
    assert error_bf16 > 100 * FP32_HEAD_MAX_ERROR, error_bf16
    print(f"\nengine head vs float64 of its operands, max |Δ log-prob|: fp32 {error_fp32:.2e}, bf16 {error_bf16:.2e}")
    monkeypatch.setattr(rollout, "fp32_head", _rounding_head(rollout.fp32_head))
    mutant, _, engine_mutant = _generate(EngineConfig(logit_dtype=LogitDtype.FP32), trainer, return_engine=True)
    assert _fp32_head_error(mutant, engine_mutant) > FP32_HEAD_MAX_ERROR


@pytest.mark.parametrize("logit_dtype", [LogitDtype.BF16, LogitDtype.FP32])
def test_logit_noise_enters_before_the_heads_rounding(logit_dtype: LogitDtype) -> None:
    """The noise knob is an upstream difference: it enters the head's fp32 sums, and a bf16 head rounds the noisy
    sums (not the sums before the noise is added)."""
    std = 0.05
    trainer = _model(logit_offset=LOGIT_OFFSET)
    gen, lengths, engine = _generate(EngineConfig(logit_dtype=logit_dtype, logit_noise_std=std), trainer, return_engine=True)
    sums, noise = _engine_sums(engine, gen), _noise(gen, lengths, std)
    if logit_dtype == LogitDtype.FP32:
        expected = _logprobs_of(sums + noise, gen)
        assert float((gen.rollout_logprobs.double() - expected)[gen.completion_mask].abs().max()) <= FP32_HEAD_MAX_ERROR
    else:
        expected = _logprobs_of((sums + noise).bfloat16(), gen)
        assert_close(gen.rollout_logprobs, expected, torch.float32, msg="bf16 head: the noisy sums rounded")
        after = _logprobs_of(sums.bfloat16().double() + noise, gen)  # noise added to the rounded logits instead
        assert float((gen.rollout_logprobs.double() - after)[gen.completion_mask].abs().max()) > 1e-3
