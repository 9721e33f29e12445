"""Typed configuration: dataclass schemas loaded through OmegaConf, validated at load time.

- :mod:`mp_grpo.config.loss`: :class:`LossConfig` and its sections and enums (plain dataclasses).
- :mod:`mp_grpo.config.precision`: :class:`LogitDtype`, the precision of the output layer's logits.
- :mod:`mp_grpo.config.loading`: :func:`load_config` (any dataclass schema; LossConfig by default),
  :func:`preset_names`, :func:`preset_path` (the presets are package data in ``mp_grpo/presets``;
  ``load_config("trl_dapo")`` loads one by name). omegaconf 2.3 and 2.4 are supported; omegaconf is imported on the first call, so the loss runs where it is not
  installed (the dataclasses can be built directly, with the same checks).
"""

from mp_grpo.config.loading import PRESETS_DIR, load_config, preset_names, preset_path

from mp_grpo.config.precision import LogitDtype
from mp_grpo.config.loss import (
    Aggregation,
    AggregationConfig,
    ConfigError,
    EntropyConfig,
    GSPOGradient,
    KLConfig,
    KLEstimator,
    LossConfig,
    M2POConfig,
    M2POScope,
    MismatchConfig,
    NLLConfig,
    NonFiniteConfig,
    Objective,
    OPSMConfig,
    PolicyConfig,
    RatioLevel,
    RolloutCorrectionConfig,
    TrustRegion,
    TrustRegionConfig,
    TrustRegionDirection,
)

__all__ = [
    "PRESETS_DIR",
    "Aggregation",
    "AggregationConfig",
    "ConfigError",
    "EntropyConfig",
    "GSPOGradient",
    "KLConfig",
    "KLEstimator",
    "LogitDtype",
    "LossConfig",
    "M2POConfig",
    "M2POScope",
    "MismatchConfig",
    "NLLConfig",
    "NonFiniteConfig",
    "OPSMConfig",
    "Objective",
    "PolicyConfig",
    "RatioLevel",
    "RolloutCorrectionConfig",
    "TrustRegion",
    "TrustRegionConfig",
    "TrustRegionDirection",
    "load_config",
    "preset_names",
    "preset_path",
]
