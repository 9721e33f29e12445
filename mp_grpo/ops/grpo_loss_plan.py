"""What the fused GRPO loss kernels compute for one LossConfig and one set of inputs (host side, no tensors).

A :class:`FusedLossPlan` is built once per (config, which optional inputs are given, layout kind,
per-token or per-sequence advantages) and cached by :class:`mp_grpo.ops.grpo_loss.FusedGRPOLoss`: the
kernels' compile-time flags, the columns of the per-sequence sums, and the names of the metric entries
in the order the torch path reports them. :func:`config_parameters` gives the config's numbers for the
kernels' float64 parameter vector (absent bounds as ±inf).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mp_grpo.config.loss import (
    Aggregation, KLEstimator, LossConfig, M2POScope, Objective, RatioLevel, TrustRegion, TrustRegionDirection,
)
from mp_grpo.kernels import grpo_loss_constants as K

_OBJECTIVES = {
    Objective.PPO_CLIP: K.OBJ_PPO_CLIP, Objective.GSPO: K.OBJ_GSPO, Objective.CISPO: K.OBJ_CISPO,
    Objective.SAPO: K.OBJ_SAPO, Objective.GMPO: K.OBJ_GMPO, Objective.REINFORCE: K.OBJ_REINFORCE,
}
_AGGREGATIONS = {
    Aggregation.TOKEN_MEAN: K.AGG_TOKEN_MEAN, Aggregation.SEQ_MEAN_TOKEN_MEAN: K.AGG_SEQ_MEAN_TOKEN_MEAN,
    Aggregation.SEQ_MEAN_TOKEN_SUM: K.AGG_SEQ_MEAN_TOKEN_SUM,
    Aggregation.SEQ_MEAN_TOKEN_SUM_NORM: K.AGG_SEQ_MEAN_TOKEN_SUM_NORM,
}
_LEVELS = {None: K.LEVEL_NONE, RatioLevel.TOKEN: K.LEVEL_TOKEN, RatioLevel.SEQUENCE: K.LEVEL_SEQUENCE,
           RatioLevel.GEOMETRIC: K.LEVEL_GEOMETRIC}
_KL_ESTIMATORS = {KLEstimator.K1: K.KL_K1, KLEstimator.K2: K.KL_K2, KLEstimator.K3: K.KL_K3}
_TRUST_REGIONS = {TrustRegion.NONE: K.TR_NONE, TrustRegion.BINARY_TV: K.TR_BINARY_TV,
                  TrustRegion.BINARY_KL: K.TR_BINARY_KL, TrustRegion.TOPK_TV: K.TR_GIVEN, TrustRegion.TOPK_KL: K.TR_GIVEN}


def _code(value: Any) -> int:
    """A kernel code (a ``tl.constexpr``) as a plain int."""
    return int(value.value)


@dataclass(frozen=True)
class InputsKey:
    """Which of GRPOLoss's optional inputs a call gives, and how its tokens are laid out."""

    packed: bool
    has_old: bool
    has_rollout: bool
    has_ref: bool
    has_entropy: bool
    advantages_per_token: bool


@dataclass(frozen=True)
class FusedLossPlan:
    """Compile-time flags of the kernels and the metric names, for one config and one :class:`InputsKey`."""

    token_flags: dict[str, Any]
    """Constexpr keyword arguments of the token (pass-1) kernel, less COMPUTE and BLOCK."""
    combine_flags: dict[str, Any]
    """Constexpr keyword arguments of the combine (pass-2) kernel, less COMPUTE and BLOCK."""
    num_cols: int
    """Columns of the per-sequence sums (0: no pass 1)."""
    seq_grad: bool
    """gspo / gmpo: a gradient flows through the per-sequence mean."""
    entropy_grad: bool
    """The entropy bonus gives the entropy a gradient."""
    has_skip: bool
    """The config's mismatch monitor may skip the step."""
    metrics: tuple[tuple[str, bool, int], ...]
    """(name, is a [sum, count] pair (else a 0-dim extreme), slot) in the torch path's order."""
    launch_metas: dict = field(default_factory=dict, compare=False, repr=False)
    """The launches' keywords with their key part (``mp_grpo.ops.launcher.LaunchMeta``), built on first use per
    (kernel, compute dtype, call flags) by :mod:`mp_grpo.ops.grpo_loss`."""


def build_plan(cfg: LossConfig, key: InputsKey) -> FusedLossPlan:
    """The plan of ``cfg`` for calls shaped like ``key`` (pure function of its arguments)."""
    p, rc = cfg.policy, cfg.rollout_correction
    objective = p.objective
    seq_objective = objective in (Objective.GSPO, Objective.GMPO)
    # --- per-sequence sums: which columns, in the torch path's order ---
    cols = {"seq_in": -1, "d": -1, "opsm": -1}
    needs_sums = (
        seq_objective or key.has_rollout or cfg.opsm.delta is not None
        or cfg.aggregation.mode == Aggregation.SEQ_MEAN_TOKEN_MEAN
        or rc.weight_level in (RatioLevel.SEQUENCE, RatioLevel.GEOMETRIC)
        or rc.reject_level in (RatioLevel.SEQUENCE, RatioLevel.GEOMETRIC)
    )
    num_cols = 0
    if needs_sums:
        num_cols = 1  # valid tokens
        for name, present in (("seq_in", seq_objective), ("d", key.has_rollout), ("opsm", cfg.opsm.delta is not None)):
            if present:
                cols[name] = num_cols
                num_cols += 1
    common = dict(
        PACKED=key.packed, HAS_OLD=key.has_old, HAS_ROLLOUT=key.has_rollout, BYPASS=rc.bypass,
        HAS_REF=key.has_ref, HAS_ENTROPY=key.has_entropy,  # both kernels drop the same non-finite positions
        ADV_PER_TOKEN=key.advantages_per_token, NUM_COLS=num_cols, COL_SEQ_IN=cols["seq_in"], COL_D=cols["d"],
        COL_OPSM=cols["opsm"],
    )
    token_flags = dict(common, OBJECTIVE=_code(_OBJECTIVES[objective]))
    kl = cfg.kl
    kl_ratio = K.KL_RATIO_BIAS_CORRECTION if kl.bias_correction else (
        K.KL_RATIO_SCORE_FUNCTION if kl.score_function else K.KL_RATIO_NONE)
    entropy_bonus = cfg.entropy.bonus_coef != 0.0
    has_skip = cfg.mismatch.skip_threshold is not None or cfg.nonfinite.skip_step
    combine_flags = dict(
        common,
        OBJECTIVE=_code(_OBJECTIVES[objective]), DUAL_CLIP=p.dual_clip_c is not None,
        AGGREGATION=_code(_AGGREGATIONS[cfg.aggregation.mode]), WEIGHT_LEVEL=_code(_LEVELS[rc.weight_level]),
        NORMALIZE_WEIGHTS=rc.normalize_weights, REJECT_LEVEL=_code(_LEVELS[rc.reject_level]),
        OPSM=cfg.opsm.delta is not None, TOP_ENTROPY=cfg.entropy.top_quantile < 1.0,
        KL_IN_LOSS=key.has_ref and kl.coef != 0.0, KL_ESTIMATOR=_code(_KL_ESTIMATORS[kl.estimator]),
        KL_STRAIGHT_THROUGH=kl.straight_through, KL_RATIO=_code(kl_ratio), ENTROPY_BONUS=entropy_bonus,
        SKIP=has_skip, TRUST_REGION=_code(_TRUST_REGIONS[cfg.trust_region.mode]),
        TR_DIRECTIONAL=cfg.trust_region.direction == TrustRegionDirection.DIRECTIONAL,
        M2PO=_code(K.M2PO_NONE if cfg.m2po.bound is None else
                   K.M2PO_ALL if cfg.m2po.scope == M2POScope.ALL else K.M2PO_CLIP_QUADRANTS),
    )
    return FusedLossPlan(
        token_flags=token_flags, combine_flags=combine_flags, num_cols=num_cols, seq_grad=seq_objective,
        entropy_grad=entropy_bonus, has_skip=has_skip, metrics=_metric_names(cfg, key),
    )


def _metric_names(cfg: LossConfig, key: InputsKey) -> tuple[tuple[str, bool, int], ...]:
    """The torch path's metric names (mp_grpo/loss/torch_path.py step 6), in its order, with their slots."""
    out: list[tuple[str, bool, int]] = []

    def pair(name: str, slot: Any) -> None:
        out.append((name, True, _code(slot)))

    def stats(name: str, sum_slot: Any, min_slot: Any) -> None:
        pair(f"{name}/mean", sum_slot)
        out.append((f"{name}/min", False, _code(min_slot) - _code(K.NUM_SUMS)))
        out.append((f"{name}/max", False, _code(min_slot) - _code(K.NUM_SUMS) + 1))

    pair("loss", K.PAIR_LOSS)
    pair("valid_tokens", K.PAIR_VALID_TOKENS)
    pair("policy_loss", K.SUM_POLICY)
    stats("ratio", K.SUM_RATIO, K.EXT_RATIO_MIN)
    objective, rc = cfg.policy.objective, cfg.rollout_correction
    if objective != Objective.SAPO and objective != Objective.REINFORCE:
        pair("clip_frac/low", K.SUM_CLIP_LOW)
        pair("clip_frac/high", K.SUM_CLIP_HIGH)
        if cfg.policy.dual_clip_c is not None:
            pair("clip_frac/dual", K.SUM_CLIP_DUAL)
    if rc.weight_level is not None:
        stats("is_weight/raw", K.SUM_WEIGHT_RAW, K.EXT_WEIGHT_RAW_MIN)
        stats("is_weight/truncated", K.SUM_WEIGHT_TRUNCATED, K.EXT_WEIGHT_TRUNCATED_MIN)
        if rc.normalize_weights:
            stats("is_weight/applied", K.SUM_WEIGHT_APPLIED, K.EXT_WEIGHT_APPLIED_MIN)
    if rc.reject_level is not None:
        pair("rejected_frac/rollout", K.SUM_REJECTED_ROLLOUT)
    if cfg.opsm.delta is not None:
        pair("rejected_frac/opsm", K.SUM_REJECTED_OPSM)
    if cfg.entropy.top_quantile < 1.0:
        pair("rejected_frac/entropy", K.SUM_REJECTED_ENTROPY)
    if cfg.trust_region.mode != TrustRegion.NONE:
        pair("rejected_frac/trust_region", K.SUM_REJECTED_TRUST_REGION)
    if cfg.m2po.bound is not None:
        pair("rejected_frac/m2po", K.SUM_REJECTED_M2PO)
    if key.has_rollout:
        pair("mismatch/k1", K.SUM_MISMATCH_K1)
        pair("mismatch/k3", K.SUM_MISMATCH_K3)
        pair("mismatch/chi2_token", K.SUM_CHI2_TOKEN)
        pair("mismatch/chi2_seq", K.PAIR_CHI2_SEQ)
    if cfg.mismatch.skip_threshold is not None or cfg.nonfinite.skip_step:
        pair("mismatch/skipped", K.PAIR_SKIPPED)
    if key.has_ref:
        pair("kl", K.SUM_KL)
    if key.has_entropy:
        pair("entropy", K.SUM_ENTROPY)
    pair("nonfinite_inputs", K.PAIR_NONFINITE)
    return tuple(out)


def config_parameters(cfg: LossConfig) -> list[float]:
    """The kernels' parameter vector (slots ``P_*`` of ``grpo_loss_constants``); an absent bound is ±inf,
    which makes its clamp and its test the identity, as ``None`` does in the torch path."""
    inf = math.inf
    p, rc, kl = cfg.policy, cfg.rollout_correction, cfg.kl

    def opt(value: float | None, absent: float) -> float:
        return absent if value is None else float(value)

    values = [
        (K.P_LOG_RATIO_CLAMP, opt(p.log_ratio_clamp, inf)),
        (K.P_CLIP_LOW, -inf if p.eps_low is None else 1.0 - p.eps_low),
        (K.P_CLIP_HIGH, inf if p.eps_high is None else 1.0 + p.eps_high),
        (K.P_GMPO_LOW, -inf if p.eps_low is None else -p.eps_low),
        (K.P_GMPO_HIGH, opt(p.eps_high, inf)),
        (K.P_DELTA, opt(p.delta, inf)),
        (K.P_DUAL_CLIP_C, opt(p.dual_clip_c, 0.0)),
        (K.P_TAU_POS, float(p.sapo_tau_pos)),
        (K.P_TAU_NEG, float(p.sapo_tau_neg)),
        (K.P_WEIGHT_MIN, opt(rc.weight_min, -inf)),
        (K.P_WEIGHT_MAX, opt(rc.weight_max, inf)),
        (K.P_REJECT_MIN, opt(rc.reject_min, -inf)),
        (K.P_REJECT_MAX, opt(rc.reject_max, inf)),
        (K.P_OPSM_DELTA, opt(cfg.opsm.delta, 0.0)),
        (K.P_KL_COEF, float(kl.coef)),
        (K.P_KL_INPUT_CLAMP, opt(kl.input_clamp, inf)),
        (K.P_KL_OUTPUT_CLAMP, opt(kl.output_clamp, inf)),
        (K.P_ENTROPY_BONUS, float(cfg.entropy.bonus_coef)),
        (K.P_NORM_CONSTANT, opt(cfg.aggregation.norm_constant, 1.0)),
        (K.P_TR_DELTA_LOW, opt(cfg.trust_region.delta_low, inf)),
        (K.P_TR_DELTA_HIGH, opt(cfg.trust_region.delta_high, inf)),
    ]
    out = [0.0] * _code(K.NUM_PARAMS)
    for slot, value in values:
        out[_code(slot)] = value
    return out
