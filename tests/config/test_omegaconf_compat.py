"""load_config under omegaconf 2.3 (hydra-core 1.3) and 2.4, and presets loaded by name (mp_grpo/config/loading.py).

omegaconf 2.3 converts a string to an enum member by *name* only, 2.4 by name or value; the YAML files hold
the values. CI runs this file in both environments (``.ci/run``); every expectation here is built without
OmegaConf (PyYAML + the enums' own lookup), so both runs check against the same result.
"""

from __future__ import annotations

import dataclasses
import typing
from enum import Enum
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from mp_grpo.config import (
    PRESETS_DIR,
    Aggregation,
    ConfigError,
    KLEstimator,
    LossConfig,
    Objective,
    RatioLevel,
    load_config,
    preset_names,
    preset_path,
)
from mp_grpo.config.job import OutputPath, SequenceFormat, load_job_config

PRESET_FILES = sorted(PRESETS_DIR.glob("*.yaml"))


def _build(cls: type, raw: dict) -> object:
    """``cls`` from a plain nested dict of YAML values, without OmegaConf: enum fields through ``Enum(value)``."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        annotation = hints[key]
        inner = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
        target = inner[0]
        if dataclasses.is_dataclass(target):
            kwargs[key] = _build(target, value)
        elif isinstance(target, type) and issubclass(target, Enum) and value is not None:
            kwargs[key] = target(value)
        else:
            kwargs[key] = value
    return cls(**kwargs)


def test_preset_names_are_the_shipped_files() -> None:
    names = preset_names()
    assert names == sorted(p.stem for p in PRESET_FILES) and len(names) >= 10
    assert PRESETS_DIR.parent.name == "mp_grpo"  # package data, not a folder of the checkout
    # a preset added where they used to live would not ship: they live only in the package
    old = Path(__file__).resolve().parents[2] / "configs" / "presets"
    assert not list(old.glob("*.y*ml")), f"move {sorted(p.name for p in old.glob('*.y*ml'))} to {PRESETS_DIR}"


@pytest.mark.parametrize("path", PRESET_FILES, ids=lambda p: p.stem)
def test_every_preset_loads_by_name_and_path_to_the_yaml_values(path: Path) -> None:
    expected = _build(LossConfig, yaml.safe_load(path.read_text()) or {})
    by_name = load_config(path.stem)
    assert by_name == load_config(path) == load_config(str(path)) == expected
    assert by_name == load_config(yaml.safe_load(path.read_text()))  # the same keys as a dict source
    assert preset_path(path.stem) == path


def test_by_name_works_from_any_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert load_config("trl_dapo", ["kl.coef=0.001"]).kl.coef == 0.001
    # a string with a YAML suffix or a path separator is a file path, relative to the working directory
    (tmp_path / "trl_dapo.yaml").write_text("policy:\n  eps_high: 0.5\n")
    assert load_config("trl_dapo.yaml").policy.eps_high == 0.5
    assert load_config("./trl_dapo.yaml").policy.eps_high == 0.5
    with pytest.raises(FileNotFoundError, match="source"):
        load_config("missing/trl_dapo")


def test_unknown_name_lists_the_known_presets() -> None:
    with pytest.raises(ConfigError) as info:
        load_config("trl_dapoo")
    message = str(info.value)
    assert "'trl_dapoo'" in message and "allowed" in message
    assert all(name in message for name in preset_names())


def test_enum_values_and_names_in_every_kind_of_source() -> None:
    expected = LossConfig()
    expected.policy.objective = Objective.GSPO
    expected.policy.eps_low, expected.policy.eps_high = 3e-4, 4e-4
    expected.aggregation.mode = Aggregation.SEQ_MEAN_TOKEN_MEAN
    expected.kl.estimator = KLEstimator.K2
    expected.rollout_correction.weight_level = RatioLevel.TOKEN
    values = {"policy": {"objective": "gspo", "eps_low": 3e-4, "eps_high": 4e-4},
              "aggregation": {"mode": "seq_mean_token_mean"}, "kl": {"estimator": "k2"},
              "rollout_correction": {"weight_level": "token"}}
    names = {"policy": {"objective": "GSPO", "eps_low": 3e-4, "eps_high": 4e-4},
             "aggregation": {"mode": "Aggregation.SEQ_MEAN_TOKEN_MEAN"}, "kl": {"estimator": "K2"},
             "rollout_correction": {"weight_level": RatioLevel.TOKEN}}
    dotlist = ["policy.objective=gspo", "policy.eps_low=3e-4", "policy.eps_high=4e-4",
               "aggregation.mode=seq_mean_token_mean", "kl.estimator=k2", "rollout_correction.weight_level=token"]
    assert load_config(values) == load_config(names) == load_config(None, dotlist) == expected
    source = OmegaConf.create(values)
    assert load_config(source) == expected
    assert source.policy.objective == "gspo"  # the caller's DictConfig is not rewritten
    # an enum key set back to null by an override, and a later override winning over the source
    assert load_config(values, ["rollout_correction.weight_level=null"]).rollout_correction.weight_level is None
    assert load_config(values, ["policy.objective=cispo", "policy.eps_low=null"]).policy.objective is Objective.CISPO


@pytest.mark.parametrize(
    ("source", "overrides", "message"),
    [
        ({"policy": {"objective": "ppo"}}, None,
         "policy.objective: got 'ppo'; allowed: ppo_clip | cispo | sapo | gspo | gmpo | reinforce"),
        (None, ["rollout_correction.weight_level=tok"],
         "rollout_correction.weight_level: got 'tok' (did you mean token?); allowed: null | token | sequence | geometric"),
        (None, ["kl.estimator=3"], "kl.estimator: got 3 (did you mean k3?); allowed: k1 | k2 | k3"),
        ({"aggregation": {"mode": "token-mean"}}, None, "aggregation.mode: got 'token-mean' (did you mean token_mean?); allowed: token_mean | "),
    ],
)
def test_bad_enum_value_names_key_value_and_allowed_values(source, overrides, message) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(source, overrides)
    assert str(info.value).startswith(message), str(info.value)


def test_job_config_enums_and_its_loss_preset() -> None:
    cfg = load_job_config({"parallel": {"sequence_format": "packed"}, "loss_preset": "trl_dapo"},
                          ["model.output_path=fused", "loss.kl.estimator=k1"])
    assert cfg.parallel.sequence_format is SequenceFormat.PACKED and cfg.model.output_path is OutputPath.FUSED
    assert cfg.loss.kl.estimator is KLEstimator.K1
    assert cfg.loss.policy.eps_high == load_config("trl_dapo").policy.eps_high
    with pytest.raises(ConfigError, match=r"^loss\.policy\.objective: got 'ppo'; allowed: ppo_clip"):
        load_job_config({}, ["loss.policy.objective=ppo"])


def test_presets_compose_with_hydra() -> None:
    """A verl / NeMo-RL user composes a preset through Hydra (``pkg://mp_grpo.presets``) and loads the result."""
    hydra = pytest.importorskip("hydra", reason="hydra-core is not installed (the omegaconf 2.3 CI venv has it)")
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="mp_grpo.presets", version_base=None):
        for name in preset_names():
            cfg = compose(config_name=name, overrides=["++kl.coef=0.002"])
            assert load_config(cfg) == load_config(name, ["kl.coef=0.002"]), (name, hydra.__version__)
