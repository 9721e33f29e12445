"""Hypothesis strategies for the loss's property tests (tests/loss/test_properties*.py).

* :func:`loss_configs`: valid :class:`~mp_grpo.config.LossConfig` sections as a nested dict (what a YAML holds),
  drawn section by section within what :mod:`mp_grpo.config.loss` allows — every objective, aggregation, rollout
  correction, KL, entropy, OPSM, mismatch and NLL option, restricted to what the fused kernels implement for
  ``backend="triton"``; :func:`raw_config_overrides` draws keys and values with no regard for validity.
* :func:`steps`: one optimizer step as a padded batch — uneven sequences with holes in their loss masks, empty
  sequences, per-sequence or per-token advantages (exact zeros among them), log-probs from near 0 to −1e30,
  log-ratios from 0 to beyond the clamps, ratios placed a hair inside / outside a clip bound, tied entropies,
  per-input dtypes — and finite junk (±dtype max, ±1e4) at every masked position.
* :func:`splits`: the same tokens over (rank, micro-batch) pairs: row permutations, padded micro-batches of their
  own widths, packed micro-batches (``[T]`` / ``[1, T]``, padded segments, empty segments, trailing positions
  outside every segment), micro-batches whose tokens are all masked, packed micro-batches without a sequence.

Values are drawn in float64 from a seeded ``torch.Generator`` (the seed is part of the example: a failure
reproduces from what hypothesis prints) and rounded to each input's dtype; the reference reads the rounded values.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import typing
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from mp_grpo.config import LossConfig, load_config
from mp_grpo.config.loading import _field_types as _uncached_field_types
from mp_grpo.config.loading import _strip_optional

OBJECTIVES_FUSED = ["ppo_clip", "cispo", "sapo", "gspo", "gmpo", "reinforce"]
OBJECTIVES_TORCH = OBJECTIVES_FUSED + ["vespo"]
AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
LEVELS = ["token", "sequence", "geometric"]
TRUST_REGIONS = ["binary_tv", "binary_kl", "topk_tv", "topk_kl"]
TOPK_K = 3
"""Entries per token position of a drawn top-K input (each valid position holds 1 … TOPK_K of them)."""
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
INPUTS = ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs", "entropy", "kl_logprobs", "advantages")


_STRATEGIES: dict = {}
"""Strategies built once (:func:`_memo`)."""


def _strategy_key(value):
    """A key equal only for equal arguments of the same types (``0.0`` / ``-0.0``, ``1`` / ``1.0`` / ``True`` differ);
    other objects (strategies, dtypes) by their own equality — the cache keeps them alive."""
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(_strategy_key(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return type(value).__name__, repr(value)
    return "object", value


def _memo(build, *args):
    """``build(*args)``, built once per distinct arguments. A strategy is a description of its draws (no state), so
    the same one serves every draw; building it anew each time (validation, its recursive properties) was ~2/3 of
    drawing a loss config."""
    key = (build, _strategy_key(args))
    strategy = _STRATEGIES.get(key)
    if strategy is None:
        strategy = _STRATEGIES[key] = build(*args)
    return strategy


def _sampled(values):
    """``st.sampled_from(values)``, built once per distinct ``values``."""
    return _memo(st.sampled_from, values)


def _one_of(*strategies):
    """``st.one_of(*strategies)``, built once per distinct ``strategies``."""
    return _memo(st.one_of, *strategies)


def _maybe(strategy, none_weight: int = 1):
    """``None`` or a value of ``strategy`` (``none_weight`` : 1 odds towards None … here 1:1 by default)."""
    return _one_of(*([st.none()] * none_weight), strategy)


def _positive(lo: float, hi: float, specials=()):
    """A float in [lo + 1e-3, hi] (bounds of a config are never tiny: float32 would round them to 0), biased
    towards a few meaningful values."""
    return _one_of(_sampled(list(specials)) if specials else st.nothing(), _floats(lo + 1e-3, hi))


def _floats(lo: float, hi: float):
    """A float in [lo, hi] with four decimals (what a config holds; never a tiny non-zero)."""
    return _memo(_rounded_floats, lo, hi)


def _rounded_floats(lo: float, hi: float):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False).map(lambda x: min(max(round(x, 4), lo), hi))


# ----------------------------------------------------------------------------------------------- configs
@st.composite
def loss_configs(draw, backend: str = "torch") -> dict:
    """A valid loss config as a nested dict; ``backend="triton"``: only what the fused kernels implement."""
    fused = backend == "triton"
    objective = draw(_sampled(OBJECTIVES_FUSED if fused else OBJECTIVES_TORCH))
    policy: dict = {"objective": objective}
    clip_family = objective in ("ppo_clip", "gspo")
    policy["eps_low"] = draw(_maybe(_positive(0.0, 1.0, [0.0, 0.2, 1.0]) if objective != "gmpo"
                                    else _positive(0.0, 3.0, [0.0, 0.2, 0.4])))
    policy["eps_high"] = draw(_maybe(_positive(0.0, 5.0, [0.0, 0.2, 0.28, 4.0])))
    if clip_family:
        policy["delta"] = draw(_maybe(_positive(1.0, 10.0, [1.05, 3.0]), 2))
        policy["dual_clip_c"] = draw(_maybe(_positive(1.0, 10.0, [1.05, 3.0]), 2))
    if objective == "sapo":
        policy["sapo_tau_pos"] = draw(_positive(0.05, 10.0, [1.0]))
        policy["sapo_tau_neg"] = draw(_positive(0.05, 10.0, [1.05]))
    if objective == "vespo":
        for sign in ("pos", "neg"):
            policy[f"vespo_k_{sign}"] = draw(_one_of(_sampled([0.0, 2.0, 3.0]), _floats(0.0, 6.0)))
            policy[f"vespo_lambda_{sign}"] = draw(_one_of(_sampled([0.0, 2.0, 3.0]), _floats(0.0, 6.0)))
    if objective == "gspo" and not fused:
        policy["gspo_gradient"] = draw(_sampled(["sequence", "token"]))
    policy["log_ratio_clamp"] = draw(_sampled([20.0, 20.0, None, 1.0, 5.0]))

    modes = AGGREGATIONS
    aggregation: dict = {"mode": draw(_sampled(modes)),
                         "count_empty_sequences": draw(st.booleans())}
    if not fused and draw(st.booleans()):
        aggregation["regularizer_mode"] = draw(_sampled(modes))
    if "seq_mean_token_sum_norm" in (aggregation["mode"], aggregation.get("regularizer_mode")):
        aggregation["norm_constant"] = draw(_positive(0.01, 64.0, [1.0, 7.0]))

    rc: dict = {}
    bypass = draw(st.booleans()) if draw(st.integers(0, 4)) == 0 else False
    levels = ["token"] if objective == "vespo" else LEVELS
    if (not bypass or objective == "reinforce") and draw(st.booleans()):
        rc["weight_level"] = draw(_sampled(levels))
        lo = draw(_maybe(_one_of(_sampled([0.0, 0.5, 0.95]), _floats(0.0, 2.0))))
        hi = draw(_maybe(_positive(0.0, 10.0, [1.05, 2.0])))
        if lo is not None and hi is not None and lo > hi:
            lo, hi = hi, lo
        rc["weight_min"], rc["weight_max"] = lo, hi
        rc["normalize_weights"] = not bypass and objective != "vespo" and draw(st.booleans())
    if draw(st.booleans()):
        rc["reject_level"] = draw(_sampled(levels))
        lo = draw(_maybe(_one_of(_sampled([0.0, 0.5, 0.9, 0.999]), _floats(0.0, 2.0))))
        hi = draw(_positive(0.0, 10.0, [1.001, 1.1, 2.0]) if lo is None else _maybe(_positive(0.0, 10.0, [1.1, 2.0])))
        if lo is not None and hi is not None and lo > hi:
            lo, hi = hi, lo
        rc["reject_min"], rc["reject_max"] = lo, hi
    rc["bypass"] = bypass

    kl: dict = {"coef": draw(_sampled([0.0, 0.0, 0.05, 1.0])),
                "estimator": draw(_sampled(["k1", "k2", "k3"])),
                "input_clamp": draw(_sampled([20.0, 20.0, None, 2.0])),
                "output_clamp": draw(_sampled([10.0, 10.0, None, 0.5]))}
    weight = draw(_sampled(["none", "none", "bias_correction", "score_function"]))
    if weight == "bias_correction":
        kl["bias_correction"] = True
        kl["bias_correction_level"] = "token" if fused else draw(_sampled(LEVELS))
    elif weight == "score_function":
        kl["score_function"] = True
    kl["straight_through"] = kl["estimator"] == "k3" and draw(st.booleans())

    entropy: dict = {"bonus_coef": draw(_sampled([0.0, 0.0, 0.01, -0.05, 1.0])),
                     "top_quantile": draw(_sampled([1.0, 1.0, 0.0, 0.2, 0.5, 0.99]))}
    if not fused and entropy["top_quantile"] < 1.0:
        entropy["bonus_on_selected"] = draw(st.booleans())
    if not fused and draw(st.integers(0, 5)) == 0:
        entropy["adaptive"] = True
        entropy["coef_min"], entropy["coef_max"] = 0.0, 1.0
        entropy["bonus_coef"] = draw(_sampled([0.0, 0.01, 1.0]))

    opsm = {"delta": draw(_maybe(_one_of(_sampled([0.0, 0.05, 0.5]), _floats(0.0, 5.0)), 2))}
    mismatch = {"skip_threshold": None if bypass else draw(_maybe(_positive(0.0, 2.0, [1e-4, 0.01, 0.1]), 2))}
    nll = {"positive_coef": 0.0 if fused else draw(_sampled([0.0, 0.0, 0.0, 0.3]))}
    trust_region: dict = {"mode": draw(_sampled(["none"] * 8 + TRUST_REGIONS))}
    if trust_region["mode"] != "none":
        trust_region["direction"] = draw(_sampled(["directional", "symmetric"]))
        deltas = [0.02, 0.05, 0.15, 0.2] if trust_region["mode"].endswith("kl") else [0.05, 0.15, 0.2, 0.5]
        low = draw(_maybe(_one_of(_sampled(deltas), _floats(1e-3, 1.0)), 1))
        trust_region["delta_low"] = low
        trust_region["delta_high"] = draw(_one_of(_sampled(deltas), _floats(1e-3, 1.0)) if low is None
                                          else _maybe(_one_of(_sampled(deltas), _floats(1e-3, 1.0)), 1))
    m2po: dict = {}
    if not bypass and draw(st.integers(0, 4)) == 0:
        m2po = {"bound": draw(_one_of(_sampled([0.0, 0.01, 0.04, 1.0]), _floats(0.0, 10.0))),
                "scope": draw(_sampled(["all", "clip_quadrants"]))}
    return {"policy": policy, "aggregation": aggregation, "rollout_correction": rc, "kl": kl, "entropy": entropy,
            "opsm": opsm, "mismatch": mismatch, "nll": nll, "trust_region": trust_region, "m2po": m2po}


RAW_KEYS: dict[str, list] = {
    "policy.objective": ["ppo_clip", "cispo", "sapo", "gspo", "gmpo", "reinforce", "vespo", "clip_cov", "kl_cov"],
    "policy.eps_low": [None, -0.1, 0.0, 0.2, 1.0, 1.5],
    "policy.eps_high": [None, -0.1, 0.0, 0.28, 4.0],
    "policy.delta": [None, 0.5, 1.0, 1.05, 3.0],
    "policy.dual_clip_c": [None, 1.0, 3.0],
    "policy.sapo_tau_pos": [0.0, 1.0, -1.0],
    "policy.vespo_k_neg": [-1.0, 0.0, 3.0],
    "policy.vespo_lambda_pos": [-0.5, 0.0, 3.0],
    "policy.gspo_gradient": ["sequence", "token"],
    "policy.log_ratio_clamp": [None, 0.0, 20.0, -1.0],
    "policy.clip_cov_ratio": [0.0, 0.2, 1.5],
    "policy.clip_cov_lb": [1.0, 6.0],
    "policy.kl_cov_ratio": [0.0, 0.2],
    "policy.ppo_kl_coef": [-0.1, 0.1],
    "aggregation.mode": AGGREGATIONS,
    "aggregation.norm_constant": [None, 0.0, 7.0],
    "aggregation.regularizer_mode": [None] + AGGREGATIONS,
    "aggregation.count_empty_sequences": [False, True],
    "rollout_correction.weight_level": [None] + LEVELS,
    "rollout_correction.weight_min": [None, -0.1, 0.0, 0.5, 3.0],
    "rollout_correction.weight_max": [None, 0.0, 2.0],
    "rollout_correction.reject_level": [None] + LEVELS,
    "rollout_correction.reject_min": [None, -1.0, 0.5, 3.0],
    "rollout_correction.reject_max": [None, 0.0, 1.1],
    "rollout_correction.normalize_weights": [False, True],
    "rollout_correction.bypass": [False, True],
    "opsm.delta": [None, -0.1, 0.0, 0.5],
    "kl.coef": [0.0, -0.1, 0.05],
    "kl.estimator": ["k1", "k2", "k3"],
    "kl.input_clamp": [None, 0.0, 20.0],
    "kl.output_clamp": [None, -1.0, 10.0],
    "kl.bias_correction": [False, True],
    "kl.bias_correction_level": LEVELS,
    "kl.score_function": [False, True],
    "kl.straight_through": [False, True],
    "entropy.bonus_coef": [0.0, 0.01, 2.0],
    "entropy.top_quantile": [-0.1, 0.0, 0.5, 1.0, 1.5],
    "entropy.bonus_on_selected": [False, True],
    "entropy.adaptive": [False, True],
    "entropy.coef_min": [0.0, 0.5],
    "entropy.coef_max": [0.2, 1.0],
    "mismatch.skip_threshold": [None, 0.0, 0.1],
    "nll.positive_coef": [-0.1, 0.0, 0.3],
    "trust_region.mode": ["none", "binary_tv", "binary_kl", "topk_tv", "topk_kl", "ratio"],
    "trust_region.direction": ["directional", "symmetric"],
    "trust_region.delta_low": [None, -0.1, 0.0, 0.15],
    "trust_region.delta_high": [None, 0.05, 1.5],
    "m2po.bound": [None, -1.0, 0.0, 0.04],
    "m2po.scope": ["all", "clip_quadrants"],
}
"""Keys and values for :func:`raw_config_overrides`: valid and invalid values of every section."""


@st.composite
def raw_config_overrides(draw) -> dict:
    """A nested dict of a few keys of :data:`RAW_KEYS`, valid or not, alone or in combination."""
    keys = draw(st.lists(_sampled(sorted(RAW_KEYS)), min_size=1, max_size=6, unique=True))
    out: dict = {}
    for key in keys:
        section, name = key.split(".")
        out.setdefault(section, {})[name] = draw(_sampled(RAW_KEYS[key]))
    return out


def build_config(sections: dict) -> LossConfig:
    """The config ``load_config`` makes of a nested dict (the path a YAML takes), and refuses what it refuses.

    OmegaConf's merge took ~40 % of a GPU-profile example's host time, so a dict of plain sections whose values
    already have their fields' types (an int for a float field, a member's value for an enum field, ``None`` for
    an optional one) builds the dataclasses directly (:func:`_direct_config`; their ``__post_init__`` runs every
    value and combination check, as ``OmegaConf.to_object`` does); anything else — unknown sections or keys, other
    types, a check that fails — goes through ``load_config`` itself, so a refusal is always its own ConfigError.
    ``tests/loss/test_strategies.py`` checks that both give the same config (its ``repr``, types included) for
    every drawn config."""
    try:
        cfg = _direct_config(sections)
    except Exception:  # a check failed: load_config refuses it in its own words
        cfg = None
    return load_config(sections) if cfg is None else cfg


_field_types = functools.lru_cache(maxsize=None)(_uncached_field_types)


def _direct_config(sections) -> LossConfig | None:
    """``LossConfig`` built from ``sections`` without OmegaConf; None where a value is not of its field's type
    (or names no field): :func:`build_config` then asks ``load_config``."""
    if not isinstance(sections, dict):
        return None
    section_types = _field_types(LossConfig)
    built = {}
    for name, values in sections.items():
        section = section_types.get(name) if isinstance(name, str) else None
        if section is None or not dataclasses.is_dataclass(section) or not isinstance(values, dict):
            return None
        hints = _field_types(section)
        kwargs = {}
        for key, value in values.items():
            if not isinstance(key, str) or key not in hints:
                return None
            ok, typed = _typed_value(hints[key], value)
            if not ok:
                return None
            kwargs[key] = typed
        built[name] = section(**kwargs)
    return LossConfig(**built)


def _typed_value(annotation, value) -> tuple[bool, object]:
    """(True, the value as OmegaConf stores it in a field of ``annotation``) for a value of that type; (False,
    None) for anything else."""
    if value is None:
        return type(None) in typing.get_args(annotation), None
    inner = _strip_optional(annotation)
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        member = next((m for m in inner if isinstance(value, str) and m.value == value), None)
        return member is not None, member
    if inner is bool:
        return type(value) is bool, value
    if inner is float:
        return type(value) in (int, float), float(value) if type(value) in (int, float) else None
    if inner is int:
        return type(value) is int, value
    if inner is str:
        return type(value) is str, value
    return False, None


# ----------------------------------------------------------------------------------------------- steps
@dataclass
class Step:
    """One optimizer step as a padded batch ``[B, W]`` (W = T + 2: two trailing columns are always masked)."""

    cfg: LossConfig
    data: dict[str, torch.Tensor]
    """Inputs in their dtypes (absent ones missing); masked positions hold finite junk."""
    per_token_advantages: bool
    positive: torch.Tensor | None
    """``[B]`` bool: positive examples (``nll.positive_coef`` only)."""
    entropy_coef: float | None
    """The adaptive entropy coefficient of the step (``entropy.adaptive`` only)."""
    upstream: float
    """The upstream gradient the loss is multiplied by before backward."""
    notes: dict = field(default_factory=dict)
    topk: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """A top-K trust region's input per position: (count [B, W] int64, rollout [B, W, TOPK_K], trainer
    [B, W, TOPK_K]) — each position's first ``count`` entries (``tests.loss.properties.topk_for`` makes the CSR)."""

    def __repr__(self) -> str:  # what hypothesis prints of a falsifying example: the draw, not the tensors
        dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in self.data.items() if k != "loss_mask"}
        return (f"Step(rows={self.rows}, {self.notes}, dtypes={dtypes}, per_token_advantages="
                f"{self.per_token_advantages}, upstream={self.upstream}, entropy_coef={self.entropy_coef})")

    def _repr_pretty_(self, printer, cycle) -> None:  # hypothesis' printer
        printer.text(repr(self))

    def to_json(self) -> str:  # hypothesis' observability (tests/property_stats.py): the same, not every tensor's repr
        return repr(self)

    @property
    def rows(self) -> int:
        return int(self.data["loss_mask"].shape[0])

    @property
    def width(self) -> int:
        return int(self.data["loss_mask"].shape[1])

    def needed_width(self, b: int) -> int:
        """Positions of row ``b`` up to its last valid token (0 without one)."""
        idx = torch.nonzero(self.data["loss_mask"][b]).flatten()
        return int(idx.max()) + 1 if idx.numel() else 0

    def compute_dtype(self) -> torch.dtype:
        """What the loss computes in (float64 for float64 log-probs, else float32)."""
        return torch.promote_types(self.data["logprobs"].dtype, torch.float32)


_LP_REGIMES = ("typical", "typical", "near_zero", "very_negative", "huge_negative")
_DELTA_SCALES = (0.0, 1e-3, 0.1, 0.1, 1.0, 5.0, 50.0)


def _junk(dtype: torch.dtype) -> torch.Tensor:
    big = torch.finfo(dtype).max
    return torch.tensor([big, -big, 1e4, -1e4], dtype=torch.float64)


@st.composite
def steps(draw, cfg_dict: dict, *, max_rows: int = 5, max_len: int = 7, low_precision: bool = True,
          mixed_dtypes: bool = True, kl_logprobs: bool = False, tie_free: bool = False,
          compute: torch.dtype | None = None) -> Step:
    """One step for the config ``cfg_dict`` (see the module docstring). ``kl_logprobs``: maybe a separate KL
    input (torch path only). ``tie_free``: per-token advantages without exact zeros, typical log-probs, no edges
    (no ties among the tokens' covariances). ``compute``: only log-prob dtypes that make the loss compute in it
    (float64: float64 log-probs; float32: float32 / bfloat16 / float16 ones; None: any)."""
    if compute not in (None, torch.float32, torch.float64):
        raise ValueError(f"compute must be None, torch.float32 or torch.float64, got {compute}")
    if compute == torch.float32 and not low_precision:
        raise ValueError("compute=torch.float32 needs low_precision=True (without it every input is float64)")
    cfg = build_config(cfg_dict)
    rc = cfg.rollout_correction
    B = draw(st.integers(1, max_rows))
    T = max_len
    lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    hole_p = draw(_sampled([0.0, 0.0, 0.2, 0.6]))
    regimes = draw(st.lists(_sampled(("typical",) if tie_free else _LP_REGIMES), min_size=B, max_size=B))
    lp_dtypes = {None: [torch.float64, torch.float64, torch.float32, torch.bfloat16, torch.float16],
                 torch.float64: [torch.float64], torch.float32: [torch.float32, torch.bfloat16, torch.float16]}[compute]
    if low_precision:
        base = draw(_sampled(lp_dtypes))
    else:
        base = torch.float64
    dtypes = {name: base for name in INPUTS}
    if mixed_dtypes and low_precision and draw(st.integers(0, 3)) == 0:
        for name in INPUTS:
            dtypes[name] = draw(_sampled(DTYPES if name != "logprobs" or compute is None else lp_dtypes))
    # A float16 gradient holds at most 65504: float16 leaves get ratios and advantages whose gradients fit.
    half = torch.float16 in (dtypes["logprobs"], dtypes["entropy"], dtypes["kl_logprobs"])
    clamped = cfg.policy.log_ratio_clamp is not None
    scales = [s for s in _DELTA_SCALES if (clamped and not half) or s <= 1.0]
    old_scale, roll_scale = draw(_sampled(scales)), draw(_sampled(scales))
    ref_scale = draw(_sampled([0.1, 1.0, 30.0] if cfg.kl.input_clamp is not None and not half else [0.1, 1.0]))
    adv_scale = draw(_sampled([1.0, 1.0, 1e-3, 1e3] + ([] if half else [1e6])))
    adv_zero_p = 0.0 if tie_free else draw(_sampled([0.0, 0.0, 0.3, 1.0]))
    per_token = tie_free or draw(st.booleans())
    tied_entropy = draw(st.booleans())
    give_old = rc.bypass is False and draw(st.integers(0, 4)) > 0
    give_rollout = cfg.needs_rollout_logprobs or draw(st.booleans())
    give_ref = cfg.kl.coef != 0.0 or draw(st.booleans())
    give_entropy = cfg.needs_entropy or draw(st.booleans())
    give_kl_lp = kl_logprobs and give_ref and draw(st.integers(0, 3)) == 0
    seed = draw(st.integers(0, 2**32 - 1))
    edges = not tie_free and base == torch.float64 and all(d == torch.float64 for d in dtypes.values()) and draw(st.booleans())
    upstream = draw(_sampled([1.0, 0.7, -2.5, 1e-3]))

    gen = torch.Generator().manual_seed(seed)
    W = T + 2

    def rnd(scale=1.0):
        return torch.randn(B, W, generator=gen, dtype=torch.float64) * scale

    def uni():
        return torch.rand(B, W, generator=gen, dtype=torch.float64)

    pos = torch.arange(W).unsqueeze(0)
    mask = (pos < torch.tensor(lengths).unsqueeze(1)) & (uni() >= hole_p)
    lp = -rnd().abs() - 0.05
    # −1e30 log-probs: not in float16; and not with mixed dtypes, where old − rollout (~1 apart) exists in float64
    # but not after the loss rounds both to float32 — the GlobalBatch's skip would be decided on another d.
    small = torch.float16 in (dtypes["logprobs"], dtypes["old_logprobs"], dtypes["rollout_logprobs"],
                              dtypes["ref_logprobs"], dtypes["kl_logprobs"]) or len(set(dtypes.values())) > 1
    for b, regime in enumerate(regimes):
        if regime == "near_zero":
            lp[b] = -uni()[b] * torch.tensor([0.0, 1e-30, 1e-6, 1e-3])[torch.randint(0, 4, (W,), generator=gen)]
        elif regime == "very_negative":
            lp[b] = -20.0 - uni()[b] * 1e3
        elif regime == "huge_negative" and not small:
            lp[b] = -1e30 * (1.0 + uni()[b])
    old = lp + rnd(old_scale)
    trainer = lp if rc.bypass else old
    rollout = trainer + rnd(roll_scale)
    ref = lp + rnd(ref_scale)
    kl_lp = lp + rnd(0.3)
    entropy = (torch.tensor([0.25, 0.5, 1.5])[torch.randint(0, 3, (B, W), generator=gen)] if tied_entropy
               else uni() * 3.0)
    adv_dtype = dtypes["advantages"]
    if adv_dtype == torch.float16:
        adv_scale = min(adv_scale, 1e3)
    adv = rnd(adv_scale) if per_token else torch.randn(B, generator=gen, dtype=torch.float64) * adv_scale
    adv = torch.where(torch.rand(adv.shape, generator=gen, dtype=torch.float64) < adv_zero_p, torch.zeros(()), adv)
    notes = {"seed": seed, "lengths": lengths, "regimes": regimes, "edges": edges}
    if edges:  # ratios a hair inside / outside a bound of the config, on about a third of the tokens
        old, rollout = _place_on_edges(cfg, gen, lp, old, rollout, mask)
    data = {"logprobs": lp, "loss_mask": mask, "advantages": adv}
    if give_old:
        data["old_logprobs"] = old
    if give_rollout:
        data["rollout_logprobs"] = rollout
    if give_ref:
        data["ref_logprobs"] = ref
    if give_entropy:
        data["entropy"] = entropy
    if give_kl_lp:
        data["kl_logprobs"] = kl_lp
    for name in list(data):
        if name == "loss_mask":
            continue
        dtype = dtypes[name]
        value = data[name]
        if name == "advantages" and not per_token:
            data[name] = value.to(dtype)
            continue
        junk = _junk(dtype)[torch.randint(0, 4, value.shape, generator=gen)]
        data[name] = torch.where(mask, value, junk).to(dtype)
    positive = None
    if cfg.nll.positive_coef != 0.0:
        positive = torch.rand(B, generator=gen) < 0.5
    entropy_coef = None
    if cfg.entropy.adaptive:
        entropy_coef = draw(_sampled([0.0, 0.02, 0.5]))
    topk = None
    if cfg.needs_topk_logprobs:
        topk = _topk_inputs(gen, mask, draw(_sampled([0.0, 0.1, 1.0, 5.0])), draw(st.booleans()))
    if cfg.m2po.bound is not None and "rollout_logprobs" in data and draw(st.booleans()):
        data["rollout_logprobs"] = _tied_rollout(gen, data, mask)
        notes["m2po_ties"] = True
    return Step(cfg, data, per_token, positive, entropy_coef, upstream, notes, topk)


def _topk_inputs(gen: torch.Generator, mask: torch.Tensor, spread: float, edges: bool):
    """(count, rollout, trainer) of a top-K input: 1 … TOPK_K entries at each valid position (0 … TOPK_K elsewhere,
    with junk), the engine's log-probs of distinct ids summing to at most 1, the trainer's at the same ids ``spread``
    away; ``edges``: probabilities of 1 (log-prob 0), of 0 (−inf) and a whole mass in the top-K (rest at its floor)."""
    B, W = mask.shape
    count = torch.randint(1, TOPK_K + 1, (B, W), generator=gen)
    count = torch.where(mask, count, torch.randint(0, TOPK_K + 1, (B, W), generator=gen))
    weights = torch.rand(B, W, TOPK_K + 1, generator=gen, dtype=torch.float64) ** 3  # the last one: the rest
    probs = weights / weights.sum(-1, keepdim=True)
    rollout = probs[..., :TOPK_K].log()
    trainer = (rollout + torch.randn(B, W, TOPK_K, generator=gen, dtype=torch.float64) * spread).clamp(max=0.0)
    if edges:
        pick = torch.randint(0, 4, (B, W), generator=gen)
        one = torch.tensor([0.0] + [-math.inf] * (TOPK_K - 1), dtype=torch.float64)
        rollout = torch.where((pick == 0).unsqueeze(-1), one, rollout)  # μ(k) = 1: rest 0
        trainer = torch.where((pick == 1).unsqueeze(-1), one, trainer)  # π(k) = 1
        trainer = torch.where((pick == 2).unsqueeze(-1), torch.full_like(trainer, -math.inf), trainer)  # π(k) = 0
    junk = torch.tensor([1e4, -1e4, math.nan], dtype=torch.float64)[torch.randint(0, 3, (B, W, TOPK_K), generator=gen)]
    masked = ~mask.unsqueeze(-1)
    return count, torch.where(masked, junk, rollout).float(), torch.where(masked, junk, trainer).float()


def _tied_rollout(gen: torch.Generator, data: dict, mask: torch.Tensor) -> torch.Tensor:
    """Rollout log-probs whose d = old − rollout takes a few values ± c only: M2PO's d² tie across tokens."""
    old = data.get("old_logprobs", data["logprobs"]).double()
    offsets = torch.tensor([-0.3, 0.3, 0.1, -0.1, 0.0], dtype=torch.float64)
    tied = old - offsets[torch.randint(0, 5, mask.shape, generator=gen)]
    dtype = data["rollout_logprobs"].dtype
    return torch.where(mask, tied.to(dtype), data["rollout_logprobs"])


def _place_on_edges(cfg: LossConfig, gen: torch.Generator, lp, old, rollout, mask):
    """Move about a third of the tokens' policy ratio (old) or rollout ratio (rollout) to a bound of the config
    times (1 ± 1e-9): a hair inside or outside, far beyond float64 rounding, never an exact tie."""
    p, rc = cfg.policy, cfg.rollout_correction
    policy_bounds = [b for b in (None if p.eps_low is None else 1.0 - p.eps_low,
                                 None if p.eps_high is None else 1.0 + p.eps_high, p.delta,
                                 None if p.log_ratio_clamp is None else math.exp(p.log_ratio_clamp),
                                 None if p.log_ratio_clamp is None else math.exp(-p.log_ratio_clamp))
                     if b is not None and b > 0]
    if p.objective.value == "gmpo":
        policy_bounds += [math.exp(x) for x in (p.eps_high, None if p.eps_low is None else -p.eps_low) if x is not None]
    rollout_bounds = [b for b in (rc.weight_min, rc.weight_max, rc.reject_min, rc.reject_max,
                                  None if p.log_ratio_clamp is None else math.exp(p.log_ratio_clamp))
                      if b is not None and b > 0]
    shape = lp.shape
    old, rollout = old.clone(), rollout.clone()
    for bounds, which in ((policy_bounds, "old"), (rollout_bounds, "rollout")):
        if not bounds:
            continue
        pick = torch.rand(shape, generator=gen) < 1 / 3
        target = torch.tensor(bounds, dtype=torch.float64)[torch.randint(0, len(bounds), shape, generator=gen)]
        # float64: 1 ± 1e-9 in torch's default float32 is 1, which put the ratios exactly on the bounds
        side = torch.where(torch.rand(shape, generator=gen) < 0.5, -1e-9, 1e-9).to(torch.float64)
        log_target = torch.log(target * (1.0 + side))
        if which == "old":  # r = exp(lp − old)
            old = torch.where(pick & mask, lp - log_target, old)
            if cfg.rollout_correction.bypass:
                rollout = torch.where(pick & mask, lp - log_target, rollout)
        else:  # ρ = exp(trainer − rollout)
            trainer = lp if cfg.rollout_correction.bypass else old
            rollout = torch.where(pick & mask, trainer - log_target, rollout)
    return old, rollout


# ----------------------------------------------------------------------------------------------- splits
@dataclass
class MicroBatch:
    """One (rank, micro-batch) of a split: which rows, and how their tokens are laid out."""

    rows: list[int]
    packed: bool
    width: int = 0
    """Padded: the micro-batch's own width."""
    segments: list[int] = field(default_factory=list)
    """Packed: each row's segment length (≥ its needed width; 0 for a row without valid tokens allowed)."""
    trailing: int = 0
    """Packed: positions after the last segment (outside every sequence)."""
    flat: bool = True
    """Packed: tokens ``[T]`` (else ``[1, T]``) — where that is unambiguous (:attr:`flat_tokens`)."""

    @property
    def flat_tokens(self) -> bool:
        """Packed tokens given as ``[T]``: when drawn so and T ≠ S (with as many tokens as sequences a ``[T]``
        advantage is both per token and per sequence, which GRPOLoss refuses: tests/loss/test_sequence_ambiguity.py)."""
        return self.flat and sum(self.segments) + self.trailing != len(self.rows)


@st.composite
def splits(draw, step: Step, *, max_micro_batches: int = 4) -> list[MicroBatch]:
    """The step's rows over (rank, micro-batch) pairs (see the module docstring)."""
    order = draw(st.permutations(range(step.rows)))
    n = draw(st.integers(1, min(max_micro_batches, step.rows)))
    cuts = sorted(draw(st.lists(st.integers(0, step.rows), min_size=n - 1, max_size=n - 1)))
    bounds = [0, *cuts, step.rows]
    out = []
    for i in range(n):
        rows = list(order[bounds[i]:bounds[i + 1]])
        packed = draw(st.booleans()) if rows else True  # a micro-batch without a sequence: packed, cu_seqlens [0]
        if packed:
            segments = [draw(st.integers(step.needed_width(b), step.width)) for b in rows]
            out.append(MicroBatch(rows, True, segments=segments, trailing=draw(st.integers(0 if rows else 1, 3)),
                                  flat=draw(st.booleans())))
        else:
            need = max(step.needed_width(b) for b in rows)
            out.append(MicroBatch(rows, False, width=draw(st.integers(max(need, 1), step.width))))
    return out
