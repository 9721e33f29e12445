"""The main job's config schema (mp_grpo/config/job.py): the shipped YAMLs load, presets merge, errors name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from mp_grpo.config import ConfigError, Objective, RatioLevel
from mp_grpo.config.job import JobConfig, OutputPath, ParamsDtype, SequenceFormat, load_job_config

CONFIGS = Path(__file__).resolve().parents[2] / "mp_grpo" / "train" / "configs"


@pytest.mark.parametrize("name", ["grpo_gpu.yaml", "grpo_cpu.yaml"])
def test_shipped_configs_load(name: str) -> None:
    cfg = load_job_config(CONFIGS / name)
    assert isinstance(cfg, JobConfig)
    assert cfg.model.vocab_size % cfg.parallel.tensor_model_parallel_size == 0


def test_cpu_config_and_overrides() -> None:
    cfg = load_job_config(CONFIGS / "grpo_cpu.yaml", ["train.steps=1", "parallel.sequence_format=padded"])
    assert cfg.train.steps == 1 and cfg.parallel.sequence_format == SequenceFormat.PADDED
    assert cfg.model.params_dtype == ParamsDtype.FP32
    assert cfg.loss.policy.eps_high == 0.28 and cfg.loss.rollout_correction.weight_level == RatioLevel.TOKEN


def test_preset_is_the_base_of_the_inline_loss() -> None:
    source = {"loss_preset": "gspo", "loss": {"policy": {"eps_high": 0.005}}}
    cfg = load_job_config(source)
    assert cfg.loss.policy.objective == Objective.GSPO  # from the preset
    assert cfg.loss.policy.eps_high == 0.005  # the inline key wins
    from_cli = load_job_config({}, ["loss_preset=gspo"])
    assert from_cli.loss.policy.objective == Objective.GSPO


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["train.stepz=3"], "stepz"),
        (["parallel.sequence_format=ragged"], "parallel.sequence_format"),
        (["model.vocab_size=1001", "parallel.tensor_model_parallel_size=2"], "model.vocab_size"),
        (["model.num_attention_heads=3", "parallel.tensor_model_parallel_size=2"], "model.num_attention_heads"),
        (["parallel.calculate_per_token_loss=true", "parallel.average_in_collective=true"], "parallel.average_in_collective"),
        (["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
        (["rollout.temperature=0"], "rollout.temperature"),
        (["rollout.tool_mask_fraction=1.0"], "rollout.tool_mask_fraction"),
        (["rollout.prompt_min_length=9", "rollout.prompt_max_length=8"], "rollout.prompt_min_length"),
        (["model.max_sequence_length=16"], "model.max_sequence_length"),
        (["train.num_microbatches=0"], "train.num_microbatches"),
        (["loss.policy.objective=ppo"], "loss.policy.objective"),
        (["model.output_path=fast"], "model.output_path"),
        (["model.logit_dtype=fp16"], "model.logit_dtype"),
        (["engine.logit_dtype=float32"], "engine.logit_dtype"),
        (["model.logit_dtyp=fp32"], "logit_dtyp"),
        (["engine.logits_dtype=fp32"], "logits_dtype"),
        (["model.cpu_logit_offset=nan"], "model.cpu_logit_offset"),
        (["model.cpu_logit_offset=big"], "model.cpu_logit_offset"),
        (["engine.topk_logprobs=-1"], "engine.topk_logprobs"),
        (["engine.topk_logprobs=true"], "engine.topk_logprobs"),
        (["loss_preset=trl_dppo", "loss.trust_region.mode=topk_tv"], "engine.topk_logprobs: 0"),
        (["loss_preset=trl_dppo", "engine.topk_logprobs=20"], "engine.topk_logprobs: 20 has no effect"),
        (["loss_preset=trl_dppo", "loss.trust_region.mode=topk_kl", "engine.topk_logprobs=2000"],
         "engine.topk_logprobs: 2000 exceeds model.vocab_size"),
    ],
)
def test_errors_name_the_key(overrides, match) -> None:
    with pytest.raises(ConfigError, match=match):
        load_job_config({}, overrides)


def test_topk_logprobs_with_a_topk_trust_region() -> None:
    cfg = load_job_config({}, ["loss_preset=trl_dppo", "loss.trust_region.mode=topk_tv", "engine.topk_logprobs=20"])
    assert cfg.engine.topk_logprobs == 20 and cfg.loss.needs_topk_logprobs
    assert load_job_config({}).engine.topk_logprobs == 0


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ConfigError, match="mismatch_safe"):
        load_job_config({"loss_preset": "no_such_preset"})


def test_output_path_defaults_to_logits_and_switches_to_fused() -> None:
    assert load_job_config({}).model.output_path == OutputPath.LOGITS
    assert load_job_config({}, ["model.output_path=fused"]).model.output_path == OutputPath.FUSED


def test_logit_dtypes_default_to_bf16_and_switch_to_fp32() -> None:
    """``model.logit_dtype`` (the trainer's logits) and ``engine.logit_dtype`` (the rollout engine's head) are set
    apart; both default to bf16 (the output layer's own dtype). Where each acts: tests/train/test_logit_dtype.py,
    tests/train/test_rollout.py."""
    from mp_grpo.config.precision import LogitDtype

    default = load_job_config({})
    assert default.model.logit_dtype == LogitDtype.BF16 and default.engine.logit_dtype == LogitDtype.BF16
    assert default.model.cpu_logit_offset == 0.0
    trainer = load_job_config(CONFIGS / "grpo_cpu.yaml", ["model.logit_dtype=fp32"])
    assert trainer.model.logit_dtype == LogitDtype.FP32 and trainer.engine.logit_dtype == LogitDtype.BF16
    engine = load_job_config(CONFIGS / "grpo_cpu.yaml", ["engine.logit_dtype=fp32"])
    assert engine.model.logit_dtype == LogitDtype.BF16 and engine.engine.logit_dtype == LogitDtype.FP32
