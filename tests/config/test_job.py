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
    ],
)
def test_errors_name_the_key(overrides, match) -> None:
    with pytest.raises(ConfigError, match=match):
        load_job_config({}, overrides)


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ConfigError, match="mismatch_safe"):
        load_job_config({"loss_preset": "no_such_preset"})


def test_output_path_defaults_to_logits_and_switches_to_fused() -> None:
    assert load_job_config({}).model.output_path == OutputPath.LOGITS
    assert load_job_config({}, ["model.output_path=fused"]).model.output_path == OutputPath.FUSED
