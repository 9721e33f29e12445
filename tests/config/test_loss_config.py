"""LossConfig and load_config (mp_grpo/config/loss.py, mp_grpo/config/loading.py): sources, presets, the
documentation of every key, and every error path (each names the key and what is allowed)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mp_grpo.config import (
    PRESETS_DIR,
    Aggregation,
    ConfigError,
    KLEstimator,
    LossConfig,
    M2POScope,
    Objective,
    RatioLevel,
    TrustRegion,
    load_config,
    preset_path,
)

REPO = Path(__file__).resolve().parents[2]
PRESETS = ["trl_grpo", "trl_dapo", "trl_dr_grpo", "trl_cispo", "trl_sapo", "gspo", "verl_ppo", "nemo_rl_grpo",
           "megatron_lm_grpo", "deepseek_v32", "mismatch_safe", "trl_vespo", "trl_luspo", "verl_clip_cov", "verl_kl_cov",
           "trl_dppo", "nemo_rl_dppo_binary_tv", "prime_rl_dppo", "areal_m2po"]


def _leaf_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            keys += _leaf_keys(f.default_factory, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def test_defaults_and_base_yaml_agree() -> None:
    assert load_config(None) == LossConfig()
    assert load_config(REPO / "configs" / "base.yaml") == LossConfig()
    # base.yaml lists every key (so it cannot silently fall behind the schema)
    base = OmegaConf.load(REPO / "configs" / "base.yaml")
    listed = {f"{s}.{k}" for s in base for k in base[s]}
    assert listed == set(_leaf_keys(LossConfig))


def test_sources_and_overrides() -> None:
    as_dict = load_config({"policy": {"eps_high": 0.28}, "kl": {"coef": 0.001}})
    as_dictconfig = load_config(OmegaConf.create({"policy": {"eps_high": 0.28}, "kl": {"coef": 0.001}}))
    as_overrides = load_config(None, ["policy.eps_high=0.28", "kl.coef=0.001"])
    assert as_dict == as_dictconfig == as_overrides
    assert as_dict.policy.eps_high == 0.28 and as_dict.kl.coef == 0.001 and as_dict.policy.eps_low == 0.2
    later_wins = load_config({"policy": {"objective": "gspo"}}, ["policy.objective=cispo"])
    assert later_wins.policy.objective is Objective.CISPO
    enums = load_config(None, ["aggregation.mode=seq_mean_token_sum", "kl.estimator=k2",
                               "rollout_correction.weight_level=geometric"])
    assert enums.aggregation.mode is Aggregation.SEQ_MEAN_TOKEN_SUM and enums.kl.estimator is KLEstimator.K2
    assert enums.rollout_correction.weight_level is RatioLevel.GEOMETRIC


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load(name: str) -> None:
    cfg = load_config(preset_path(name))
    assert isinstance(cfg, LossConfig)


def test_preset_values() -> None:
    dapo = load_config(preset_path("trl_dapo"))
    assert (dapo.policy.eps_low, dapo.policy.eps_high, dapo.aggregation.mode) == (0.2, 0.28, Aggregation.TOKEN_MEAN)
    cispo = load_config(preset_path("trl_cispo"))
    assert cispo.policy.eps_low is None and 1.0 + cispo.policy.eps_high == 5.0  # TRL's cap epsilon_high = 5
    dr = load_config(preset_path("trl_dr_grpo"))
    assert dr.aggregation.norm_constant == 512 and dr.aggregation.count_empty_sequences
    verl = load_config(preset_path("verl_ppo"))
    assert verl.policy.dual_clip_c == 3.0
    nemo = load_config(preset_path("nemo_rl_grpo"))
    assert (nemo.kl.coef, nemo.kl.input_clamp, nemo.kl.output_clamp, nemo.kl.score_function) == (0.01, 20, 10, True)
    mlm = load_config(preset_path("megatron_lm_grpo"))  # train_rl.py's defaults (Megatron-LM d98e8a6)
    assert (mlm.policy.eps_low, mlm.policy.eps_high, mlm.kl.coef, mlm.policy.log_ratio_clamp, mlm.kl.input_clamp,
            mlm.kl.output_clamp) == (0.01, 0.01, 0.001, None, None, None)
    ds = load_config(preset_path("deepseek_v32"))
    assert ds.opsm.delta == 0.5 and ds.kl.bias_correction
    safe = load_config(preset_path("mismatch_safe"))
    assert safe.rollout_correction.reject_level is RatioLevel.GEOMETRIC and safe.mismatch.skip_threshold == 0.1
    clip_cov = load_config(preset_path("verl_clip_cov")).policy  # verl/trainer/config/actor/actor.yaml (b178a3c)
    assert clip_cov.objective is Objective.CLIP_COV and (clip_cov.clip_cov_ratio, clip_cov.clip_cov_lb,
                                                          clip_cov.clip_cov_ub) == (0.0002, 1.0, 5.0)
    kl_cov = load_config(preset_path("verl_kl_cov")).policy
    assert kl_cov.objective is Objective.KL_COV and (kl_cov.kl_cov_ratio, kl_cov.ppo_kl_coef) == (0.0002, 0.1)
    trl_dppo = load_config(preset_path("trl_dppo"))  # DPPOConfig's defaults (TRL ef1b500^)
    assert (trl_dppo.trust_region.mode, trl_dppo.trust_region.delta_low, trl_dppo.trust_region.delta_high,
            1.0 + trl_dppo.policy.eps_high, trl_dppo.rollout_correction.bypass) == (TrustRegion.BINARY_TV, 0.15, 0.15,
                                                                                  20.0, True)
    prime = load_config(preset_path("prime_rl_dppo"))  # default_loss_fn's dppo_mask_low / _high (559b447)
    assert (prime.trust_region.delta_low, prime.trust_region.delta_high, prime.policy.eps_low,
            prime.policy.eps_high) == (0.2, 0.2, None, None)
    m2po = load_config(preset_path("areal_m2po"))  # examples/math/gsm8k_m2po.yaml (AReaL 4aef98d)
    assert (m2po.m2po.bound, m2po.m2po.scope, m2po.rollout_correction.reject_max) == (0.04, M2POScope.ALL, 5.0)
    assert {p.stem for p in PRESETS_DIR.glob("*.yaml")} == set(PRESETS)


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ConfigError, match="trl_dapo"):
        preset_path("trl_dapoo")


def test_docs_list_every_key() -> None:
    doc = (REPO / "docs" / "loss.md").read_text()
    missing = [k for k in _leaf_keys(LossConfig) if f"`{k}`" not in doc]
    assert not missing, f"docs/loss.md does not document {missing}"


@dataclasses.dataclass
class Trainer:
    """A stand-in for a job config's other sections."""

    steps: int = 1


@dataclasses.dataclass
class Job:
    """A job config nesting the loss config."""

    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    trainer: Trainer = dataclasses.field(default_factory=Trainer)


def test_section_and_schema_for_a_job_config(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("loss:\n  policy:\n    eps_high: 0.28\ntrainer:\n  steps: 3\n")
    job = load_config(path, ["loss.kl.coef=0.01"], schema=Job)
    assert job.trainer.steps == 3 and job.loss.policy.eps_high == 0.28 and job.loss.kl.coef == 0.01
    assert load_config(path, section="loss").policy.eps_high == 0.28
    with pytest.raises(ConfigError, match=r"^loss: .*allowed keys: policy"):
        load_config(path)  # the loss schema has no `loss` (nor `trainer`) section
    with pytest.raises(ConfigError, match=r"los: .*allowed: loss \| trainer"):
        load_config(path, section="los")
    with pytest.raises(ConfigError, match=r"loss\.policy\.eps_low: got 2\.0"):
        load_config(path, ["loss.policy.eps_low=2"], schema=Job)


# ----------------------------------------------------------------------------------- every error path
ERRORS = [
    # (source, overrides, the key the message must name, a fragment of the allowed values)
    ({"policy": {"objective": "ppo"}}, None, "policy.objective", "ppo_clip | cispo | sapo | gspo | gmpo | reinforce"),
    ({"policy": {"eps_lo": 0.1}}, None, "policy.eps_lo", "eps_low"),
    ({"polcy": {}}, None, "polcy", "policy | aggregation"),
    ({"policy": 3}, None, "policy", "a mapping with keys objective"),
    (None, ["kl.coef=abc"], "kl.coef", "float"),
    (None, ["kl.estimator=k4"], "kl.estimator", "k1 | k2 | k3"),
    (None, ["aggregation.mode=token-mean"], "aggregation.mode", "seq_mean_token_sum_norm"),
    (None, ["rollout_correction.weight_level=tok"], "rollout_correction.weight_level", "null | token | sequence"),
    (None, ["rollout_correction.bypass=maybe"], "rollout_correction.bypass", "bool"),
    (None, ["policy.eps_low=-0.1"], "policy.eps_low", "0.0 ≤ x ≤ 1.0"),
    (None, ["policy.eps_low=1.5"], "policy.eps_low", "0.0 ≤ x ≤ 1.0"),
    (None, ["policy.eps_high=-1"], "policy.eps_high", "0.0 ≤ x"),
    (None, ["policy.eps_high=inf"], "policy.eps_high", "0.0 ≤ x"),
    (None, ["policy.delta=0.9"], "policy.delta", "1.0 < x"),
    (None, ["policy.objective=cispo", "policy.delta=4"], "policy.delta", "null with cispo"),
    (None, ["policy.dual_clip_c=1.0"], "policy.dual_clip_c", "1.0 < x"),
    (None, ["policy.objective=sapo", "policy.dual_clip_c=3"], "policy.dual_clip_c", "null with sapo"),
    (None, ["policy.sapo_tau_pos=0"], "policy.sapo_tau_pos", "0.0 < x"),
    (None, ["policy.sapo_tau_neg=-1"], "policy.sapo_tau_neg", "0.0 < x"),
    (None, ["policy.sapo_tau_neg=null"], "policy.sapo_tau_neg", "float"),
    (None, ["policy.log_ratio_clamp=0"], "policy.log_ratio_clamp", "null or a float with 0.0 < x"),
    (None, ["aggregation.mode=seq_mean_token_sum_norm"], "aggregation.norm_constant", "0.0 < x"),
    (None, ["aggregation.mode=seq_mean_token_sum_norm", "aggregation.norm_constant=0"], "aggregation.norm_constant",
     "0.0 < x"),
    (None, ["aggregation.norm_constant=512"], "aggregation.norm_constant", "null with mode token_mean"),
    (None, ["rollout_correction.weight_max=2"], "rollout_correction.weight_max", "set weight_level"),
    (None, ["rollout_correction.weight_min=0.5"], "rollout_correction.weight_min", "set weight_level"),
    (None, ["rollout_correction.normalize_weights=true"], "rollout_correction.normalize_weights", "set weight_level"),
    (None, ["rollout_correction.weight_level=token", "rollout_correction.weight_min=-1"],
     "rollout_correction.weight_min", "0.0 ≤ x"),
    (None, ["rollout_correction.weight_level=token", "rollout_correction.weight_max=0"],
     "rollout_correction.weight_max", "0.0 < x"),
    (None, ["rollout_correction.weight_level=token", "rollout_correction.weight_min=3", "rollout_correction.weight_max=2"],
     "rollout_correction.weight_min", "weight_min ≤ weight_max"),
    (None, ["rollout_correction.reject_max=2"], "rollout_correction.reject_max", "set reject_level"),
    (None, ["rollout_correction.reject_min=0.5"], "rollout_correction.reject_min", "set reject_level"),
    (None, ["rollout_correction.reject_level=sequence"], "rollout_correction.reject_level",
     "at least one of reject_min / reject_max"),
    (None, ["rollout_correction.reject_level=token", "rollout_correction.reject_min=-0.1"],
     "rollout_correction.reject_min", "0.0 ≤ x"),
    (None, ["rollout_correction.reject_level=token", "rollout_correction.reject_max=0"],
     "rollout_correction.reject_max", "0.0 < x"),
    (None, ["rollout_correction.reject_level=token", "rollout_correction.reject_min=2", "rollout_correction.reject_max=1"],
     "rollout_correction.reject_min", "reject_min ≤ reject_max"),
    (None, ["rollout_correction.bypass=true", "rollout_correction.weight_level=token",
            "rollout_correction.normalize_weights=true", "policy.objective=reinforce"],
     "rollout_correction.normalize_weights", "false with bypass"),
    (None, ["rollout_correction.bypass=true", "rollout_correction.weight_level=token"],
     "rollout_correction.weight_level", "policy.objective reinforce"),
    (None, ["rollout_correction.bypass=true", "mismatch.skip_threshold=0.1"], "mismatch.skip_threshold",
     "null with bypass"),
    (None, ["opsm.delta=-0.5"], "opsm.delta", "0.0 ≤ x"),
    (None, ["kl.coef=-0.1"], "kl.coef", "0.0 ≤ x"),
    (None, ["kl.input_clamp=0"], "kl.input_clamp", "0.0 < x"),
    (None, ["kl.output_clamp=-1"], "kl.output_clamp", "0.0 < x"),
    (None, ["kl.bias_correction=true", "kl.score_function=true"], "kl.score_function", "at most one of them"),
    (None, ["kl.straight_through=true", "kl.estimator=k1"], "kl.straight_through", "estimator k3"),
    (None, ["entropy.bonus_coef=nan"], "entropy.bonus_coef", "finite float"),
    (None, ["entropy.top_quantile=1.5"], "entropy.top_quantile", "0.0 ≤ x ≤ 1.0"),
    (None, ["entropy.top_quantile=-0.1"], "entropy.top_quantile", "0.0 ≤ x ≤ 1.0"),
    (None, ["mismatch.skip_threshold=0"], "mismatch.skip_threshold", "0.0 < x"),
]


@pytest.mark.parametrize(("source", "overrides", "key", "allowed"), ERRORS, ids=[f"{e[2]}-{i}" for i, e in enumerate(ERRORS)])
def test_errors_name_key_and_allowed_values(source, overrides, key, allowed) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(source, overrides)
    message = str(info.value)
    assert message.startswith(f"{key}:"), message
    assert "allowed" in message and allowed in message, message


def test_direct_construction_validates() -> None:
    from mp_grpo.config import PolicyConfig

    with pytest.raises(ConfigError, match=r"^policy\.delta:"):
        PolicyConfig(delta=0.5)
    with pytest.raises(ConfigError, match=r"^rollout_correction\.weight_level:"):
        LossConfig(rollout_correction=load_config(None, ["rollout_correction.bypass=true",
                                                         "rollout_correction.weight_level=token",
                                                         "policy.objective=reinforce"]).rollout_correction)


def test_bad_sources(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="source"):
        load_config(tmp_path / "missing.yaml")
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="source"):
        load_config(listing)
    with pytest.raises(TypeError, match="source"):
        load_config(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="overrides"):
        load_config(None, "policy.eps_high=0.3")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="schema"):
        load_config(None, schema=dict)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=re.escape("loss: must be a mapping")):
        load_config({"loss": 3}, section="loss")


def test_vespo_luspo_preset_values() -> None:
    vespo = load_config(preset_path("trl_vespo"))
    p = vespo.policy
    assert p.objective is Objective.VESPO and (p.vespo_k_pos, p.vespo_lambda_pos, p.vespo_k_neg, p.vespo_lambda_neg) \
        == (2.0, 3.0, 3.0, 2.0)
    assert vespo.aggregation.mode is Aggregation.TOKEN_MEAN
    assert vespo.rollout_correction.weight_level is RatioLevel.TOKEN and vespo.rollout_correction.weight_max == 3.0
    luspo = load_config(preset_path("trl_luspo"))
    assert luspo.policy.objective is Objective.GSPO and (luspo.policy.eps_low, luspo.policy.eps_high) == (2e-3, 2.5e-3)
    assert luspo.aggregation.mode is Aggregation.SEQ_MEAN_TOKEN_SUM and luspo.aggregation.count_empty_sequences
