"""Typed schema of the GRPO-family loss: one dataclass per section, enums for every mode.

Loaded through :func:`mp_grpo.config.load_config` (``OmegaConf.structured``), so an unknown key, a wrong
type or a bad enum value fails at load time. Each section validates its own values in ``__post_init__``
and :class:`LossConfig` validates the combinations across sections; every error is a
:class:`ConfigError` that names the key and the allowed values. Constructing the dataclasses directly in
Python runs the same checks.

The meaning of every key, its default and the paper or framework it comes from are listed in
``docs/loss.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum


class ConfigError(ValueError):
    """An invalid configuration value or combination; the message names the key and the allowed values."""


class Objective(str, Enum):
    """The per-token policy-gradient surrogate (``policy.objective``)."""

    PPO_CLIP = "ppo_clip"
    """PPO / GRPO clipped ratio objective (with optional INTELLECT-2 ``delta`` and dual clip)."""
    CISPO = "cispo"
    """MiniMax-M1: stop-gradient of the clipped ratio times ``A · log π``."""
    SAPO = "sapo"
    """Soft Adaptive Policy Optimization: a sigmoid gate instead of a hard clip."""
    GSPO = "gspo"
    """Group Sequence Policy Optimization: the PPO clip on the per-sequence geometric-mean ratio."""
    GMPO = "gmpo"
    """Geometric-Mean Policy Optimization: the geometric mean of per-token clipped ratios."""
    REINFORCE = "reinforce"
    """Plain policy gradient ``−A · log π`` (no ratio)."""
    VESPO = "vespo"
    """VESPO (arXiv 2602.10693, TRL / Liger ``loss_type="vespo"``): ``−stopgrad(φ(w))·A·log π`` with the gamma
    weight φ(w) = e^λ·w^k·e^(−λw) of the sequence ratio w = Π π_θ/π_old (× token IS weights)."""
    CLIP_COV = "clip_cov"
    """Clip-Cov (arXiv 2505.22617, verl ``loss_mode="clip_cov"``): the PPO clip, and the policy term zeroed on a
    random ``clip_cov_ratio`` fraction of the micro-batch's tokens whose covariance (A − Ā)·(log π − mean log π)
    lies in (``clip_cov_lb``, ``clip_cov_ub``) (:mod:`mp_grpo.loss.covariance`)."""
    KL_COV = "kl_cov"
    """KL-Cov (arXiv 2505.22617, verl ``loss_mode="kl_cov"``): −A·r (no clip), plus ``ppo_kl_coef``·|log r| on the
    ``kl_cov_ratio`` fraction of the micro-batch's tokens with the largest covariance
    (:mod:`mp_grpo.loss.covariance`)."""


class GSPOGradient(str, Enum):
    """How the gspo sequence ratio carries the gradient (``policy.gspo_gradient``)."""

    SEQUENCE = "sequence"
    """GSPO paper: s = exp(mean ℓ), differentiated as a whole — every token's term reaches every token."""
    TOKEN = "token"
    """GSPO-token (verl ``compute_policy_loss_gspo``): s_t = stopgrad(s)·π_θ(y_t)/stopgrad(π_θ(y_t)) — the
    same value, but each token's term differentiates only its own log-prob, so a per-token IS weight or
    advantage scales only that token's gradient."""


class Aggregation(str, Enum):
    """How per-token terms become the step objective (``aggregation.mode``)."""

    TOKEN_MEAN = "token_mean"
    """Σ over valid tokens / global valid tokens (DAPO, TRL ``dapo``/``bnpo`` global, verl ``token-mean``)."""
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    """Σ over sequences of (Σ over its tokens / its length) / global sequences (GRPO paper, TRL ``grpo``)."""
    SEQ_MEAN_TOKEN_SUM = "seq_mean_token_sum"
    """Σ over valid tokens / global sequences (verl ``seq-mean-token-sum``)."""
    SEQ_MEAN_TOKEN_SUM_NORM = "seq_mean_token_sum_norm"
    """Σ over valid tokens / (global sequences · ``norm_constant``) (Dr. GRPO, TRL ``dr_grpo``)."""


class RatioLevel(str, Enum):
    """Where the rollout-correction ratio old/rollout is taken (``rollout_correction.*_level``)."""

    TOKEN = "token"
    """Per token: ``exp(d_t)``."""
    SEQUENCE = "sequence"
    """Per sequence: ``exp(Σ_t d_t)`` (the product of the token ratios), broadcast to its tokens."""
    GEOMETRIC = "geometric"
    """Per sequence: ``exp(mean_t d_t)`` (the geometric mean of the token ratios), broadcast."""


class KLEstimator(str, Enum):
    """Schulman's estimators of KL(π_θ ‖ π_ref) from ``x = log π_ref − log π_θ`` (``kl.estimator``)."""

    K1 = "k1"
    """``−x``."""
    K2 = "k2"
    """``x² / 2``."""
    K3 = "k3"
    """``eˣ − x − 1`` (GRPO, verl ``low_var_kl``, NeMo-RL ``k3``)."""


class TrustRegion(str, Enum):
    """The divergence trust region of DPPO (arXiv 2602.04879, "Rethinking the Trust Region in LLM RL";
    ``trust_region.mode``): the policy term of a token is dropped — not clipped — where a divergence between the
    trainer's policy π_θ and the rollout engine's μ leaves a threshold (:mod:`mp_grpo.loss.trust_region`)."""

    NONE = "none"
    """No divergence trust region."""
    BINARY_TV = "binary_tv"
    """|π_θ(y_t) − μ(y_t)| of the sampled token (the paper's binary TV, Eq. 13)."""
    BINARY_KL = "binary_kl"
    """KL(Bernoulli(μ(y_t)) ‖ Bernoulli(π_θ(y_t))) of the sampled token (the paper's binary KL, Eq. 14)."""
    TOPK_TV = "topk_tv"
    """½ (Σ_k |π_θ(k) − μ(k)| + |rest_π − rest_μ|) over the engine's top-K ids and the rest of the vocabulary
    (TRL's ``topk_tv``); needs ``topk_logprobs=``."""
    TOPK_KL = "topk_kl"
    """Σ_k μ(k)·log(μ(k)/π_θ(k)) + rest_μ·log(rest_μ/rest_π) over the same buckets (TRL's ``topk_kl``); needs
    ``topk_logprobs=``."""


class TrustRegionDirection(str, Enum):
    """Which moves of the sampled token's probability the trust region drops (``trust_region.direction``)."""

    DIRECTIONAL = "directional"
    """The paper's Eq. 12 (TRL, verl, NeMo-RL, open-instruct, prime-rl's default): where A > 0 drop a token whose
    π_θ(y_t) rose above μ(y_t) with the divergence beyond ``delta_high``; where A ≤ 0 one whose π_θ(y_t) fell below
    μ(y_t) beyond ``delta_low`` — only updates that would push the policy further out of the region."""
    SYMMETRIC = "symmetric"
    """prime-rl #2434: drop a token beyond ``delta_high`` above or ``delta_low`` below μ, whatever its advantage."""


class M2POScope(str, Enum):
    """Which tokens M2PO's second-moment mask may drop (``m2po.scope``)."""

    ALL = "all"
    """Every valid token (AReaL ``m2_threshold``)."""
    CLIP_QUADRANTS = "clip_quadrants"
    """Only tokens where PPO's clip could act: A > 0 with d > 0, or A < 0 with d < 0 (d = log π_old − log μ; ms-swift
    ``loss_type="m2po"``); the others are always kept and do not enter the second moment."""


def _allowed(enum: type[Enum], nullable: bool = False) -> str:
    values = [m.value for m in enum]  # type: ignore[attr-defined]
    return ("null | " if nullable else "") + " | ".join(values)


def _require(ok: bool, key: str, problem: str, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {problem}; allowed: {allowed}")


def _check_float(key: str, value: float | None, *, nullable: bool, low: float | None = None,
                 low_inclusive: bool = True, high: float | None = None, high_inclusive: bool = True) -> None:
    """Range check of one float key; the error spells the allowed interval."""
    lo = "" if low is None else f"{low} {'≤' if low_inclusive else '<'} "
    hi = "" if high is None else f" {'≤' if high_inclusive else '<'} {high}"
    allowed = ("null or " if nullable else "") + (f"a float with {lo}x{hi}" if lo or hi else "a finite float")
    if value is None:
        _require(nullable, key, "must not be null", allowed)
        return
    ok = math.isfinite(value)
    if low is not None:
        ok = ok and (value >= low if low_inclusive else value > low)
    if high is not None:
        ok = ok and (value <= high if high_inclusive else value < high)
    _require(ok, key, f"got {value}", allowed)


# ---------------------------------------------------------------------------------------------------
@dataclass
class PolicyConfig:
    """``policy``: the surrogate objective and its clipping."""

    objective: Objective = Objective.PPO_CLIP
    """Per-token surrogate: ppo_clip | cispo | sapo | gspo | gmpo | reinforce | vespo | clip_cov | kl_cov."""
    eps_low: float | None = 0.2
    """Ratio lower bound is ``1 − eps_low`` (ppo_clip, gspo, cispo, clip_cov); for gmpo the log-ratio lower bound is
    ``−eps_low`` (GMPO clips in log space). null = unbounded below."""
    eps_high: float | None = 0.2
    """Ratio upper bound is ``1 + eps_high`` (ppo_clip, gspo, cispo, clip_cov); for gmpo the log-ratio upper bound is
    ``eps_high``. null = unbounded above. DAPO's clip-higher uses 0.28; TRL's CISPO cap 5.0 is eps_high = 4.0."""
    delta: float | None = None
    """INTELLECT-2 two-sided clipping: the unclipped ratio is capped at ``delta`` (> 1). ppo_clip and gspo only."""
    dual_clip_c: float | None = None
    """Dual clip (Ye et al. 2019): where A < 0 the term is at most ``−A · c`` (c > 1; verl uses 3.0).
    ppo_clip and gspo only."""
    sapo_tau_pos: float = 1.0
    """SAPO gate temperature for tokens with A > 0."""
    sapo_tau_neg: float = 1.05
    """SAPO gate temperature for tokens with A ≤ 0."""
    vespo_k_pos: float = 2.0
    """VESPO gamma shape k (power of w) where A ≥ 0 (TRL ``vespo_k_pos``)."""
    vespo_lambda_pos: float = 3.0
    """VESPO gamma rate λ where A ≥ 0 (TRL ``vespo_lambda_pos``); ≥ 0, floored at ``VESPO_LAMBDA_FLOOR``."""
    vespo_k_neg: float = 3.0
    """VESPO gamma shape k where A < 0 (TRL ``vespo_k_neg``)."""
    vespo_lambda_neg: float = 2.0
    """VESPO gamma rate λ where A < 0 (TRL ``vespo_lambda_neg``); ≥ 0, floored at ``VESPO_LAMBDA_FLOOR``."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: the fraction of the micro-batch's valid tokens whose policy term is zeroed — at most
    max(⌊clip_cov_ratio · n⌋, 1) of them, drawn at random among those with covariance in (clip_cov_lb,
    clip_cov_ub) and not clipped by the PPO clip (verl ``policy_loss.clip_cov_ratio``, default 0.0002). 0 < x ≤ 1."""
    clip_cov_lb: float = 1.0
    """clip_cov: exclusive lower bound of the covariance of a token that may be zeroed (verl
    ``policy_loss.clip_cov_lb``, default 1.0)."""
    clip_cov_ub: float = 5.0
    """clip_cov: exclusive upper bound of that covariance (verl ``policy_loss.clip_cov_ub``, default 5.0);
    > clip_cov_lb."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: the fraction of the micro-batch's valid tokens with the largest covariance that get the
    penalty — max(⌊kl_cov_ratio · n⌋, 1) of them (verl ``policy_loss.kl_cov_ratio``, default 0.0002).
    0 < x ≤ 1."""
    ppo_kl_coef: float = 0.1
    """kl_cov: coefficient of |log π_θ − log π_old| on the selected tokens (verl ``policy_loss.ppo_kl_coef``: 0.1
    in verl's config; ``compute_policy_loss_kl_cov`` falls back to 1.0 only when the key is null). ≥ 0."""
    gspo_gradient: GSPOGradient = GSPOGradient.SEQUENCE
    """gspo only: sequence (GSPO paper, TRL) | token (GSPO-token, verl: each token's term differentiates
    only its own log-prob)."""
    log_ratio_clamp: float | None = 20.0
    """Bound on |log-ratio| before every ``exp`` (policy ratio, rollout-correction ratios, mismatch
    metrics): e^20 ≈ 4.9e8 stays finite in fp32 even squared (χ²). 20 is verl's bound (vanilla PPO loss);
    TRL and NeMo-RL do not clamp the policy log-ratio (null reproduces them).
    null disables it (an overflow to inf then becomes possible)."""

    def __post_init__(self) -> None:
        gmpo = self.objective == Objective.GMPO
        _check_float("policy.eps_low", self.eps_low, nullable=True, low=0.0, high=None if gmpo else 1.0)
        _check_float("policy.eps_high", self.eps_high, nullable=True, low=0.0)
        clip_family = (Objective.PPO_CLIP, Objective.GSPO)
        names = "ppo_clip | gspo"
        if self.delta is not None:
            _require(self.objective in clip_family, "policy.delta",
                     f"is only used by objective {names}, not {self.objective.value}", f"null with {self.objective.value}")
            _check_float("policy.delta", self.delta, nullable=True, low=1.0, low_inclusive=False)
        if self.dual_clip_c is not None:
            _require(self.objective in clip_family, "policy.dual_clip_c",
                     f"is only used by objective {names}, not {self.objective.value}", f"null with {self.objective.value}")
            _check_float("policy.dual_clip_c", self.dual_clip_c, nullable=True, low=1.0, low_inclusive=False)
        _check_float("policy.sapo_tau_pos", self.sapo_tau_pos, nullable=False, low=0.0, low_inclusive=False)
        _check_float("policy.sapo_tau_neg", self.sapo_tau_neg, nullable=False, low=0.0, low_inclusive=False)
        _check_float("policy.log_ratio_clamp", self.log_ratio_clamp, nullable=True, low=0.0, low_inclusive=False)
        for sign in ("pos", "neg"):
            _check_float(f"policy.vespo_k_{sign}", getattr(self, f"vespo_k_{sign}"), nullable=False, low=0.0)
            _check_float(f"policy.vespo_lambda_{sign}", getattr(self, f"vespo_lambda_{sign}"), nullable=False, low=0.0)
        _check_float("policy.clip_cov_ratio", self.clip_cov_ratio, nullable=False, low=0.0, low_inclusive=False,
                     high=1.0)
        _check_float("policy.clip_cov_lb", self.clip_cov_lb, nullable=False)
        _check_float("policy.clip_cov_ub", self.clip_cov_ub, nullable=False, low=self.clip_cov_lb, low_inclusive=False)
        _check_float("policy.kl_cov_ratio", self.kl_cov_ratio, nullable=False, low=0.0, low_inclusive=False, high=1.0)
        _check_float("policy.ppo_kl_coef", self.ppo_kl_coef, nullable=False, low=0.0)
        if self.gspo_gradient != GSPOGradient.SEQUENCE:
            _require(self.objective == Objective.GSPO, "policy.gspo_gradient",
                     f"is only used by objective gspo, not {self.objective.value}", f"sequence with {self.objective.value}")


@dataclass
class AggregationConfig:
    """``aggregation``: how the per-token terms of the whole step become one number."""

    mode: Aggregation = Aggregation.TOKEN_MEAN
    """token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm."""
    norm_constant: float | None = None
    """Per-sequence divisor of seq_mean_token_sum_norm (Dr. GRPO: the maximum completion length); required by
    that mode and only allowed with it."""
    count_empty_sequences: bool = False
    """Count every sequence (row / packed segment) in the global sequence count, also those without a valid
    token, as TRL and verl do; by default only sequences with at least one valid token count."""
    regularizer_mode: Aggregation | None = None
    """Aggregation of the KL penalty and the entropy bonus when it differs from the policy term's ``mode``
    (verl aggregates gspo / sapo's policy term with seq_mean_token_mean whatever its ``loss_agg_mode``, and
    KL / entropy with ``loss_agg_mode``). null = ``mode``."""

    @property
    def regularizer(self) -> Aggregation:
        """The mode of the KL and entropy terms (``regularizer_mode``, or ``mode`` when null)."""
        return self.mode if self.regularizer_mode is None else self.regularizer_mode

    def __post_init__(self) -> None:
        norm = Aggregation.SEQ_MEAN_TOKEN_SUM_NORM
        if norm in (self.mode, self.regularizer_mode):
            _check_float("aggregation.norm_constant", self.norm_constant, nullable=False, low=0.0, low_inclusive=False)
        else:
            _require(self.norm_constant is None, "aggregation.norm_constant",
                     f"is only used by mode seq_mean_token_sum_norm, not {self.mode.value}",
                     f"null with mode {self.mode.value}")


@dataclass
class RolloutCorrectionConfig:
    """``rollout_correction``: importance sampling from the rollout engine's policy to the trainer's old policy.

    ``d = old − rollout`` per token (clamped by ``policy.log_ratio_clamp``); the ratio at a level is
    ``exp(d)`` (token), ``exp(Σ d)`` (sequence) or ``exp(mean d)`` (geometric).
    """

    weight_level: RatioLevel | None = None
    """Level of the IS weight that multiplies the policy term (TIS): null | token | sequence | geometric."""
    weight_min: float | None = None
    """Lower truncation of the weight; null = none."""
    weight_max: float | None = None
    """Upper truncation of the weight (TIS cap); null = none."""
    reject_level: RatioLevel | None = None
    """Level of the rejection mask (MIS / IcePop / geometric sequence masking): null | token | sequence | geometric."""
    reject_min: float | None = None
    """Reject where the ratio at ``reject_level`` is below this; null = no lower bound."""
    reject_max: float | None = None
    """Reject where the ratio at ``reject_level`` is above this; null = no upper bound."""
    normalize_weights: bool = False
    """Rescale the truncated weights to mean 1 over the global batch (valid tokens at token level, valid
    sequences at sequence / geometric level), as verl's ``rollout_is_batch_normalize``."""
    bypass: bool = False
    """Take the rollout log-probs as the old policy (no trainer recompute). The correction ratio then is
    stopgrad(log π_θ) − rollout (verl's bypass mode)."""

    def __post_init__(self) -> None:
        key = "rollout_correction"
        if self.weight_level is None:
            for name in ("weight_min", "weight_max"):
                _require(getattr(self, name) is None, f"{key}.{name}", "has no effect without weight_level",
                         "null, or set weight_level to " + _allowed(RatioLevel))
            _require(not self.normalize_weights, f"{key}.normalize_weights", "has no effect without weight_level",
                     "false, or set weight_level to " + _allowed(RatioLevel))
        _check_float(f"{key}.weight_min", self.weight_min, nullable=True, low=0.0)
        _check_float(f"{key}.weight_max", self.weight_max, nullable=True, low=0.0, low_inclusive=False)
        if self.weight_min is not None and self.weight_max is not None:
            _require(self.weight_min <= self.weight_max, f"{key}.weight_min",
                     f"{self.weight_min} exceeds weight_max {self.weight_max}", "weight_min ≤ weight_max")
        if self.reject_level is None:
            for name in ("reject_min", "reject_max"):
                _require(getattr(self, name) is None, f"{key}.{name}", "has no effect without reject_level",
                         "null, or set reject_level to " + _allowed(RatioLevel))
        else:
            _require(self.reject_min is not None or self.reject_max is not None, f"{key}.reject_level",
                     f"is {self.reject_level.value} but neither reject_min nor reject_max is set",
                     "at least one of reject_min / reject_max")
        _check_float(f"{key}.reject_min", self.reject_min, nullable=True, low=0.0)
        _check_float(f"{key}.reject_max", self.reject_max, nullable=True, low=0.0, low_inclusive=False)
        if self.reject_min is not None and self.reject_max is not None:
            _require(self.reject_min <= self.reject_max, f"{key}.reject_min",
                     f"{self.reject_min} exceeds reject_max {self.reject_max}", "reject_min ≤ reject_max")
        if self.bypass:
            _require(not self.normalize_weights, f"{key}.normalize_weights",
                     "needs the weights before the step, but with bypass they depend on the current policy",
                     "false with bypass = true")


@dataclass
class OPSMConfig:
    """``opsm``: DeepSeek-V3.2 off-policy sequence masking."""

    delta: float | None = None
    """Zero the policy term of a sequence with A < 0 whose mean over valid tokens of
    (rollout − stopgrad(log π_θ)) exceeds delta (old instead of rollout when no rollout log-probs are given).
    null = off. TRL suggests 0.5 as a starting point."""

    def __post_init__(self) -> None:
        _check_float("opsm.delta", self.delta, nullable=True, low=0.0)


@dataclass
class KLConfig:
    """``kl``: penalty towards the reference policy, added on every valid token."""

    coef: float = 0.0
    """β; 0 disables the penalty (the KL is still reported as a metric when ref log-probs are given)."""
    estimator: KLEstimator = KLEstimator.K3
    """k1 | k2 | k3, of x = ref − log π_θ."""
    input_clamp: float | None = 20.0
    """Bound on |x| before the estimator (NeMo-RL ``kl_input_clamp_value``: e^20 stays finite). null = off."""
    output_clamp: float | None = 10.0
    """Bound on |KL| per token after it (NeMo-RL ``kl_output_clamp_value``, verl ``low_var_kl``). null = off."""
    bias_correction: bool = False
    """DeepSeek-V3.2 / TRL ``use_bias_correction_kl``: multiply the KL by the ratio π_θ/π_old at
    ``bias_correction_level`` (with its gradient)."""
    bias_correction_level: RatioLevel = RatioLevel.TOKEN
    """Level of that ratio: token exp(ℓ_t) (DeepSeek-V3.2) | geometric exp(mean ℓ) (TRL / Liger under
    ``importance_sampling_level="sequence"``, whose ratio ``coef_1`` is the GSPO one) | sequence exp(Σ ℓ).
    Needs ``bias_correction``."""
    score_function: bool = False
    """NeMo-RL's default: multiply the KL by exp(log π_θ − stopgrad(log π_θ)) — value 1, adds the score-function
    gradient KL·∇log π_θ (arXiv 2506.09477). Equals bias_correction on-policy."""
    straight_through: bool = False
    """verl ``k3+``: the value of k3 with the gradient of k2 (needs estimator k3)."""

    def __post_init__(self) -> None:
        _check_float("kl.coef", self.coef, nullable=False, low=0.0)
        _check_float("kl.input_clamp", self.input_clamp, nullable=True, low=0.0, low_inclusive=False)
        _check_float("kl.output_clamp", self.output_clamp, nullable=True, low=0.0, low_inclusive=False)
        _require(not (self.bias_correction and self.score_function), "kl.score_function",
                 "and kl.bias_correction both multiply the KL by a ratio", "at most one of them true")
        if self.bias_correction_level != RatioLevel.TOKEN:
            _require(self.bias_correction, "kl.bias_correction_level", "has no effect without kl.bias_correction",
                     "token, or set kl.bias_correction to true")
        if self.straight_through:
            _require(self.estimator == KLEstimator.K3, "kl.straight_through",
                     f"takes the value of k3 but estimator is {self.estimator.value}", "true only with estimator k3")


@dataclass
class EntropyConfig:
    """``entropy``: entropy bonus and top-entropy token selection."""

    bonus_coef: float = 0.0
    """Subtract bonus_coef · entropy on every valid token (aggregated like the policy term)."""
    top_quantile: float = 1.0
    """Keep the policy term only on valid tokens whose entropy is at least the (1 − top_quantile) quantile
    (linear interpolation) of the entropies of all valid tokens of the step, on all DP ranks ("Beyond the
    80/20 rule": 0.2). 1.0 keeps every token."""
    bonus_on_selected: bool = False
    """Apply the entropy bonus only on the tokens the top-entropy selection keeps (TRL: the bonus uses the
    same ``mask * entropy_mask`` as the policy term). Needs ``top_quantile`` < 1."""
    adaptive: bool = False
    """TRL ``use_adaptive_entropy`` (Skywork-OR1): the bonus coefficient is a per-step value held by a
    :class:`~mp_grpo.loss.AdaptiveEntropyCoefficient` (its initial value is ``bonus_coef``) and passed to
    every call as ``entropy_coef=``; it applies only while the last step's mean entropy is ≤ ``target``."""
    target: float = 0.2
    """TRL ``entropy_target`` (nats): the bonus applies, and the coefficient grows, while the step's mean
    entropy is at most this; above it the coefficient shrinks."""
    coef_min: float = 0.0
    """TRL ``entropy_coef_min``: lower bound of the adaptive coefficient."""
    coef_max: float = 1.0
    """TRL ``entropy_coef_max``: upper bound of the adaptive coefficient."""
    coef_delta: float = 0.005
    """TRL ``entropy_coef_delta``: the adaptive coefficient's step per optimizer step."""

    def __post_init__(self) -> None:
        _check_float("entropy.bonus_coef", self.bonus_coef, nullable=False)
        _check_float("entropy.top_quantile", self.top_quantile, nullable=False, low=0.0, high=1.0)
        if self.bonus_on_selected:
            _require(self.top_quantile < 1.0, "entropy.bonus_on_selected",
                     "restricts the bonus to the top-entropy selection, but top_quantile is 1 (no selection)",
                     "false, or top_quantile < 1")
        _check_float("entropy.target", self.target, nullable=False)
        _check_float("entropy.coef_min", self.coef_min, nullable=False)
        _check_float("entropy.coef_max", self.coef_max, nullable=False, low=self.coef_min)
        _check_float("entropy.coef_delta", self.coef_delta, nullable=False, low=0.0)
        if self.adaptive:
            _check_float("entropy.bonus_coef", self.bonus_coef, nullable=False, low=self.coef_min, high=self.coef_max)


@dataclass
class NLLConfig:
    """``nll``: supervised term on positive examples (VAPO)."""

    positive_coef: float = 0.0
    """NeMo-RL ``positive_example_nll_weight`` (VAPO, arXiv 2504.05118): add positive_coef × the mean of
    −log π_θ over the step's valid tokens of positive sequences (reward > 0; the ``positive=`` input). 0 = off."""

    def __post_init__(self) -> None:
        _check_float("nll.positive_coef", self.positive_coef, nullable=False, low=0.0)


@dataclass
class MismatchConfig:
    """``mismatch``: training–inference mismatch monitor."""

    skip_threshold: float | None = None
    """Skip the whole step (loss 0, zero gradient, identical on every rank) when the global mean over valid
    tokens of k3(old ‖ rollout) = e^d − d − 1 exceeds it. null = never skip."""

    def __post_init__(self) -> None:
        _check_float("mismatch.skip_threshold", self.skip_threshold, nullable=True, low=0.0, low_inclusive=False)


@dataclass
class NonFiniteConfig:
    """``nonfinite``: what a NaN or ±inf input at a trained position does to the step."""

    skip_step: bool = False
    """false: GRPOLoss drops the position (no value, no gradient), counts it in the metric ``nonfinite_inputs``
    and ``mp_grpo.check_errors()`` (which ``reduce_metrics`` and ``GlobalBatch.skip_step`` call) raises a
    ValueError naming the input. true: ``GlobalBatch.from_rollouts`` also counts the non-finite old / rollout /
    reference log-probs, advantages and entropies it is given (at trained positions, every rank) in its one
    all-reduce, and a step with any is skipped on every rank alike (loss 0, zero gradient, ``skip_step()``
    true) instead of raising. The trained policy's own log-probs (its logits) come from the step itself, after
    that all-reduce: a non-finite one still raises."""


@dataclass
class TrustRegionConfig:
    """``trust_region``: DPPO's divergence trust region between the trainer's π_θ and the rollout engine's μ.

    The decision is taken per token on stop-gradient values: π_θ = the trainer's log-probs (``logprobs``), μ = the
    rollout log-probs (``rollout_logprobs``, required), top-K modes the ``topk_logprobs`` input; a dropped token's
    policy term is 0 (value and gradient), its KL and entropy terms stay, and it stays in every denominator, as the
    rollout rejection. Formulas and each peer's variant: ``docs/loss.md``, "Divergence trust regions"."""

    mode: TrustRegion = TrustRegion.NONE
    """none | binary_tv | binary_kl | topk_tv | topk_kl."""
    direction: TrustRegionDirection = TrustRegionDirection.DIRECTIONAL
    """directional (the paper's Eq. 12: only moves in the advantage's direction) | symmetric (prime-rl #2434)."""
    delta_low: float | None = None
    """Threshold of the divergence where π_θ(y_t) < μ(y_t) (TRL ``epsilon``, verl ``clip_ratio_low``, prime-rl
    ``dppo_mask_low``); null: that side never drops. ≥ 0. The paper suggests 0.15 (TV) / 0.05 (KL)."""
    delta_high: float | None = None
    """Threshold of the divergence where π_θ(y_t) > μ(y_t) (TRL ``epsilon_high``, verl ``clip_ratio_high``, prime-rl
    ``dppo_mask_high``); null: that side never drops. ≥ 0."""

    def __post_init__(self) -> None:
        key = "trust_region"
        if self.mode == TrustRegion.NONE:
            for name in ("delta_low", "delta_high"):
                _require(getattr(self, name) is None, f"{key}.{name}", "has no effect with mode none",
                         "null, or set mode to " + " | ".join(m.value for m in TrustRegion if m != TrustRegion.NONE))
            _require(self.direction == TrustRegionDirection.DIRECTIONAL, f"{key}.direction",
                     "has no effect with mode none", "directional (the default), or set mode")
            return
        _require(self.delta_low is not None or self.delta_high is not None, f"{key}.mode",
                 f"is {self.mode.value} but neither delta_low nor delta_high is set", "at least one of them")
        for name in ("delta_low", "delta_high"):
            _check_float(f"{key}.{name}", getattr(self, name), nullable=True, low=0.0)


@dataclass
class M2POConfig:
    """``m2po``: M2PO (arXiv 2510.01161), the second moment of the rollout log-ratio over the whole step bounded.

    With d = log π_old − log μ per token (clamped by ``policy.log_ratio_clamp``), the tokens of the step with the
    largest d² are dropped until the mean d² of the others is at most ``bound`` — decided once per step over all
    micro-batches and data-parallel ranks by the :class:`~mp_grpo.GlobalBatch` (:mod:`mp_grpo.loss.m2po`). A
    dropped token's policy term is 0, and it stays in every denominator."""

    bound: float | None = None
    """The bound on the mean d² of the kept tokens (AReaL / ms-swift ``m2_threshold``, 0.04 in both); null = off. ≥ 0."""
    scope: M2POScope = M2POScope.ALL
    """all (AReaL) | clip_quadrants (ms-swift: only tokens with A > 0, d > 0 or A < 0, d < 0 are candidates)."""

    def __post_init__(self) -> None:
        _check_float("m2po.bound", self.bound, nullable=True, low=0.0)
        if self.scope != M2POScope.ALL:
            _require(self.bound is not None, "m2po.scope", "has no effect without m2po.bound",
                     "all, or set m2po.bound")


@dataclass
class LossConfig:
    """The whole GRPO-family loss: one field per section."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """Surrogate objective and clipping."""
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    """Token → step aggregation."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance sampling from the rollout engine to the trainer."""
    opsm: OPSMConfig = field(default_factory=OPSMConfig)
    """Off-policy sequence masking."""
    kl: KLConfig = field(default_factory=KLConfig)
    """Reference-policy KL penalty."""
    entropy: EntropyConfig = field(default_factory=EntropyConfig)
    """Entropy bonus and top-entropy selection."""
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    """Training–inference mismatch monitor."""
    nll: NLLConfig = field(default_factory=NLLConfig)
    """Positive-example NLL (VAPO)."""
    nonfinite: NonFiniteConfig = field(default_factory=NonFiniteConfig)
    """NaN / ±inf inputs: raise (default) or skip the step on every rank."""
    trust_region: TrustRegionConfig = field(default_factory=TrustRegionConfig)
    """DPPO's divergence trust region (binary / top-K TV or KL against the rollout policy)."""
    m2po: M2POConfig = field(default_factory=M2POConfig)
    """M2PO's step-level second-moment mask."""

    def __post_init__(self) -> None:
        rc = self.rollout_correction
        if rc.bypass and rc.weight_level is not None:
            _require(self.policy.objective == Objective.REINFORCE, "rollout_correction.weight_level",
                     f"with bypass = true the policy ratio of {self.policy.objective.value} already is π_θ/π_rollout, "
                     "so an IS weight would count it twice",
                     "null with bypass, or policy.objective reinforce")
        if self.policy.objective == Objective.VESPO:
            token_only = (None, RatioLevel.TOKEN)
            for name in ("weight_level", "reject_level"):
                level = getattr(rc, name)
                _require(level in token_only, f"rollout_correction.{name}",
                         f"is {level.value if level else None}, but vespo folds the rollout correction into its "
                         "sequence weight token by token (TRL allows token_truncate / token_mask only)", "null | token")
            _require(not rc.normalize_weights, "rollout_correction.normalize_weights",
                     "is not defined for vespo (the token IS weights enter its sequence weight)", "false with vespo")
        if rc.bypass:
            _require(self.mismatch.skip_threshold is None, "mismatch.skip_threshold",
                     "compares old with rollout log-probs, which bypass makes equal", "null with bypass = true")
            _require(self.m2po.bound is None, "m2po.bound",
                     "bounds the second moment of old − rollout log-probs, which bypass makes equal",
                     "null with bypass = true")

    @property
    def needs_rollout_logprobs(self) -> bool:
        """Whether :class:`~mp_grpo.GRPOLoss` must be given ``rollout_logprobs``."""
        rc = self.rollout_correction
        return rc.weight_level is not None or rc.reject_level is not None or rc.bypass \
            or self.mismatch.skip_threshold is not None or self.trust_region.mode != TrustRegion.NONE \
            or self.m2po.bound is not None

    @property
    def needs_topk_logprobs(self) -> bool:
        """Whether :class:`~mp_grpo.GRPOLoss` must be given ``topk_logprobs`` (a top-K trust region)."""
        return self.trust_region.mode in (TrustRegion.TOPK_TV, TrustRegion.TOPK_KL)

    @property
    def needs_entropy(self) -> bool:
        """Whether :class:`~mp_grpo.GRPOLoss` must be given ``entropy``."""
        return self.entropy.bonus_coef != 0.0 or self.entropy.top_quantile < 1.0 or self.entropy.adaptive
