"""Per-token formulas of the GRPO loss, written once for the fused kernels and the torch path.

Each formula is a ``@triton.jit`` function in a restricted dialect, so that :mod:`mp_grpo.loss.dialect` can run
the very same source on torch tensors (it rebinds ``tl``, ``K``, the helpers below and the other formulas of
this module in the function's globals). The dialect: arithmetic and comparisons; ``tl.where``,
``tl.zeros_like``, ``tl.minimum`` / ``tl.maximum`` (on the torch path with ``torch.clamp``'s gradient: all of
it to the first operand at a tie, so a bound is inclusive like the kernels' masks), ``tl.exp``,
``tl.log``, ``tl.abs``, ``tl.sigmoid``, ``.to(tl.float64)``; compile-time branches on the codes of
:mod:`mp_grpo.kernels.grpo_loss_constants` (``K.*``) and on ``tl.constexpr`` flags; the helpers :func:`expm1`
(``torch.expm1`` on the torch path) and :func:`stop_gradient` (the identity here, ``detach`` there); calls to
the other formulas of this module.

Parameters come in as arguments: the kernels pass the values they load from the config-parameter vector (an
absent bound is ±inf there, ``mp_grpo.ops.grpo_loss_plan.config_parameters``), the torch path passes the
config's floats with the same ±inf for an absent bound; modes are ``tl.constexpr`` codes (``K.*``).

A differentiable formula returns its value and its derivative with respect to its first argument (or the
argument its docstring names): the kernels chain derivatives by hand, the torch path differentiates the value
with autograd, and ``tests/loss/test_dialect.py`` checks that the two agree. Masks (keep / clip flags) and
detached quantities come without a derivative.

All of the per-token maths the kernels and the torch path share is here: the symmetric and range clamps, the
objectives (ppo_clip / gspo surrogate, cispo, sapo, gmpo, reinforce), the rollout correction (level log-ratio,
truncated and normalized weight, rejection), the OPSM and top-entropy keeps, the trust regions' binary divergences and keep, M2PO's keep, the aggregation divisor, the KL
estimators and their ratio / score-function weights, and the mismatch metrics (k1 / k3 are the KL estimators of d; χ²). What only the torch path
implements (vespo, clip_cov, kl_cov, GSPO-token, the regularizer's own aggregation, adaptive entropy, NLL)
is written in ``mp_grpo/loss`` alone.
"""

import triton
import triton.language as tl

from mp_grpo.kernels import grpo_loss_constants as K

EXPM1_SERIES_BOUND = tl.constexpr(0.5)
"""Below this |x| expm1 sums its Taylor series; above, exp(x) - 1 loses at most ~2.5 ulp (e^x / (e^x - 1))."""
EXPM1_SERIES_TERMS = tl.constexpr(17)
"""x^17 / 17! < 1e-19 · |x| for |x| < 0.5: exact to float64 rounding."""


@triton.jit
def stop_gradient(x):
    """``x``; on the torch path ``x.detach()`` (the value counts, its gradient does not)."""
    return x


@triton.jit
def expm1(x):
    """``exp(x) - 1``, exact near 0 (k3 and χ² of small log-ratios cancel catastrophically as ``exp(x) - 1``):
    x·(1 + x/2·(1 + x/3·(…))) for |x| < 0.5, else exp(x) - 1 (the Triton interpreter has no libdevice, hence
    the short series); on the torch path ``torch.expm1``."""
    small = tl.abs(x) < EXPM1_SERIES_BOUND
    xs = tl.where(small, x, 0.0)
    q = tl.zeros_like(xs) + 1.0
    for k in tl.static_range(EXPM1_SERIES_TERMS, 1, -1):
        q = 1.0 + q * xs * (1.0 / k)
    return tl.where(small, xs * q, tl.exp(x) - 1.0)


# ------------------------------------------------------------------------------------ clamps
@triton.jit
def log1mexp(x):
    """``log(1 − eˣ)`` for x ≤ 0 (−inf at x = 0): the log of a Bernoulli's other mass from the log of its one,
    accurate on both sides of ``K.LOG1MEXP_SPLIT``. Both branches see only finite arguments (the unused one gets −1)."""
    near = x > K.LOG1MEXP_SPLIT
    a = tl.where(near, x, -1.0)
    b = tl.where(near, -1.0, x)
    return tl.where(near, tl.log(-expm1(a)), tl.log(1.0 - tl.exp(b)))


@triton.jit
def clamp_sym(x, bound):
    """``clamp(x, -bound, bound)`` and whether ``x`` lies inside (inclusive: torch's clamp gradient mask, the
    derivative of the value); ``bound`` = inf: the identity."""
    inside = (x >= -bound) & (x <= bound)
    return tl.minimum(tl.maximum(x, -bound), bound), inside


@triton.jit
def clip_range(x, low, high):
    """``clamp(x, low, high)`` (−inf / inf: that side open); gradient 1 inside, bounds included."""
    return tl.minimum(tl.maximum(x, low), high)


@triton.jit
def floor_count(count):
    """A count used as a divisor, floored at ``K.COUNT_FLOOR`` (``grpo_loss_constants`` says why)."""
    return tl.maximum(count, K.COUNT_FLOOR)


# ------------------------------------------------------------------------------------ objectives
@triton.jit
def clipped_surrogate(ratio, adv, low_bound, high_bound, delta, dual_clip_c, DUAL_CLIP: tl.constexpr):
    """PPO's clipped surrogate (ppo_clip; gspo with the sequence ratio): ``(term, ∂term/∂ratio, lower clip
    active, upper clip active, dual clip active)``.

    r2 = clip(r, low_bound, high_bound), r1 = min(r, delta); term = −min(r1·A, r2·A) (ties: the unclipped
    branch); with ``DUAL_CLIP`` where A < 0 min(term, −A·c). ``delta`` = inf: none.
    """
    r2 = clip_range(ratio, low_bound, high_bound)
    r1 = tl.minimum(ratio, delta)
    u1 = r1 * adv
    u2 = r2 * adv
    first = u1 <= u2  # −min(u1, u2); ties take the unclipped branch
    term = -tl.where(first, u1, u2)
    passes = tl.where(first, ratio <= delta, (ratio >= low_bound) & (ratio <= high_bound))
    d_term = tl.where(passes, -adv, 0.0)
    dual = first != first  # all False
    if DUAL_CLIP:
        cap = -adv * dual_clip_c
        dual = (adv < 0) & (term > cap)
        term = tl.where(dual, cap, term)
        d_term = tl.where(dual, 0.0, d_term)
    clip_low = (ratio < low_bound) & (adv < 0)
    clip_high = (ratio > high_bound) & (adv > 0)
    return term, d_term, clip_low, clip_high, dual


@triton.jit
def cispo(lp, ratio, adv, low_bound, high_bound):
    """CISPO: ``(term, ∂term/∂lp, ratio below low_bound, ratio above high_bound)``;
    term = −stopgrad(clip(r, low_bound, high_bound))·A·lp."""
    weight = stop_gradient(clip_range(ratio, low_bound, high_bound))
    d_term = -weight * adv
    return d_term * lp, d_term, ratio < low_bound, ratio > high_bound


@triton.jit
def sapo(ratio, adv, tau_pos, tau_neg):
    """SAPO's soft gate: ``(term, ∂term/∂ratio)``; term = −(4/τ)·sigmoid(τ·(r − 1))·A, τ = tau_pos where A > 0,
    else tau_neg (0-dim tensors of the compute dtype on the torch path, as the kernel's loaded parameters)."""
    tau = tl.where(adv > 0, tau_pos, tau_neg)
    x = tau * (ratio - 1.0)
    # The gate sigmoid(x) from e = e^−|x| ∈ (0, 1]: 1/(1 + e) for x ≥ 0, e/(1 + e) below. Its derivative
    # e/(1 + e)² keeps the tails' e^−|x| — also autograd's on the torch path — where sigmoid's y·(1 − y) rounds to 0
    # once y rounds to 1 (x > 17 in float32); no exponent overflows on either side.
    e = tl.exp(tl.where(x >= 0, -x, x))
    gate = tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    term = -(4.0 / tau) * gate * adv
    d_term = -(4.0 / tau) * (e / ((1.0 + e) * (1.0 + e))) * tau * adv
    return term, d_term


@triton.jit
def gmpo_log_clip(log_ratio, adv, low_bound, high_bound):
    """GMPO's one-sided clip in log space: ``(clipped ℓ, ∂clipped/∂ℓ, lower clip active, upper clip active)``;
    ℓ ≤ high_bound where A > 0, ℓ ≥ low_bound where A < 0 (low_bound = −eps_low; ∓inf: none)."""
    high = (adv > 0) & (log_ratio > high_bound)
    low = (adv < 0) & (log_ratio < low_bound)
    clipped = tl.where(high, high_bound, tl.where(low, low_bound, log_ratio))
    d_clipped = tl.where(low | high, 0.0, tl.zeros_like(log_ratio) + 1.0)
    return clipped, d_clipped, low, high


@triton.jit
def gmpo(seq_mean, adv):
    """GMPO's term from the sequence mean m of the clipped ℓ: ``(term, ∂term/∂m, ratio)``; term = −A·eᵐ."""
    ratio = tl.exp(seq_mean)
    term = -adv * ratio
    return term, term, ratio


@triton.jit
def reinforce(lp, adv):
    """REINFORCE: ``(term, ∂term/∂lp)``; term = −A·lp."""
    d_term = -adv
    return d_term * lp, d_term


# ------------------------------------------------------------------------------------ rollout correction
@triton.jit
def level_log_ratio(d, sum_d, count_floor, clamp, LEVEL: tl.constexpr):
    """Rollout-correction log-ratio at LEVEL (token: d; sequence: clamp(Σd, ±clamp); geometric: Σd / n) from the
    token's d and its sequence's Σd and floored length."""
    if LEVEL == K.LEVEL_TOKEN:
        out = d
    elif LEVEL == K.LEVEL_SEQUENCE:
        out, _ = clamp_sym(sum_d, clamp)
    else:
        out = sum_d / count_floor
    return out


@triton.jit
def truncated_weight(log_ratio, weight_min, weight_max):
    """The IS weight: ``(raw e^log_ratio, truncated to [weight_min, weight_max])``, both detached."""
    raw = tl.exp(stop_gradient(log_ratio))
    return raw, clip_range(raw, weight_min, weight_max)


@triton.jit
def normalized_weight(weight, mean):
    """``weight / mean``, unless the mean is not above ``WEIGHT_MEAN_FLOOR`` (then ``weight`` unchanged)."""
    return weight / tl.where(mean > K.WEIGHT_MEAN_FLOOR, mean, 1.0)


@triton.jit
def rejection_keep(log_ratio, reject_min, reject_max):
    """Bool: the ratio e^log_ratio lies in ``[reject_min, reject_max]`` (∓inf: that side never rejects)."""
    ratio = tl.exp(log_ratio)
    return (ratio >= reject_min) & (ratio <= reject_max)


# ------------------------------------------------------------------------------------ trust regions
@triton.jit
def binary_divergence(lp, mu, TRUST_REGION: tl.constexpr):
    """DPPO's binary divergence of the sampled token between the trainer's π = e^lp and the rollout's μ = e^mu,
    from their log-probs (stop-gradient values; each capped at ``K.LOGPROB_MAX``), without exponentiating a
    positive number:

    * binary TV (``K.TR_BINARY_TV``): |π − μ| = e^max(lp, mu) · (1 − e^−|lp − mu|), exact near a tie;
    * binary KL (``K.TR_BINARY_KL``): KL(Bernoulli(μ) ‖ Bernoulli(π)) = μ·(mu − lp) + (1 − μ)·(log(1 − μ) −
      log(1 − π)), with 1 − μ = −expm1(mu) and the logs by :func:`log1mexp` (no cancellation at π or μ near 1);
      the second term is 0 where μ = 1 (0·log 0 = 0), +inf where π = 1 > μ (the true value).

    Never NaN for finite inputs (a −inf log-prob is a non-finite input the loss drops before)."""
    lp = tl.minimum(lp, K.LOGPROB_MAX)
    mu = tl.minimum(mu, K.LOGPROB_MAX)
    if TRUST_REGION == K.TR_BINARY_TV:
        out = -tl.exp(tl.maximum(lp, mu)) * expm1(-tl.abs(lp - mu))
    else:
        rest_mu = -expm1(mu)
        other = tl.where(rest_mu > 0.0, rest_mu * (log1mexp(mu) - log1mexp(lp)), 0.0)
        out = tl.exp(mu) * (mu - lp) + other
    return out


@triton.jit
def trust_region_keep(divergence, lp, mu, adv, delta_low, delta_high, DIRECTIONAL: tl.constexpr):
    """Bool: the token's policy term is kept by the trust region. Dropped where the trainer's probability rose above
    the rollout's (lp > mu, both capped at ``K.LOGPROB_MAX``) with ``divergence`` > ``delta_high``, or fell below it
    with ``divergence`` > ``delta_low`` (inf: that side never drops); with ``DIRECTIONAL`` (the paper's Eq. 12) the
    first only where A > 0 and the second only where A ≤ 0 — the moves the advantage pushes further."""
    lp = tl.minimum(lp, K.LOGPROB_MAX)
    mu = tl.minimum(mu, K.LOGPROB_MAX)
    drop_high = (lp > mu) & (divergence > delta_high)
    drop_low = (lp < mu) & (divergence > delta_low)
    if DIRECTIONAL:
        positive = adv > 0
        drop_high = drop_high & positive
        drop_low = drop_low & ~positive
    return ~(drop_high | drop_low)


@triton.jit
def m2po_keep(d, threshold, adv, CLIP_QUADRANTS: tl.constexpr):
    """Bool: M2PO keeps the token unless d² ≥ ``threshold`` (float64 ``d`` = clamp(old − rollout), the step's
    threshold from the GlobalBatch; inf: none dropped); with ``CLIP_QUADRANTS`` only a token with A > 0, d > 0 or
    A < 0, d < 0 can be dropped."""
    drop = d * d >= threshold
    if CLIP_QUADRANTS:
        drop = drop & (((adv > 0) & (d > 0)) | ((adv < 0) & (d < 0)))
    return ~drop


# ------------------------------------------------------------------------------------ keeps, divisor
@triton.jit
def opsm_keep(adv, sum_divergence, count_floor, delta):
    """OPSM: bool, keep unless A < 0 and the sequence's mean divergence Σ / n exceeds ``delta``."""
    drift = sum_divergence / count_floor
    return ~((adv < 0) & (drift > delta))


@triton.jit
def high_entropy(entropy, threshold):
    """Top-entropy selection: bool, the entropy is at least ``threshold`` (compared in float64)."""
    return entropy.to(tl.float64) >= threshold


@triton.jit
def token_divisor(tokens, sequences, count_floor, norm_constant, AGGREGATION: tl.constexpr):
    """The aggregation's divisor D_t from the step's valid tokens and sequences and the token's floored
    sequence length (``mp_grpo.loss.aggregation``); every count floored at ``COUNT_FLOOR``."""
    sequences = floor_count(sequences)
    if AGGREGATION == K.AGG_TOKEN_MEAN:
        divisor = floor_count(tokens)
    elif AGGREGATION == K.AGG_SEQ_MEAN_TOKEN_MEAN:
        divisor = count_floor * sequences
    elif AGGREGATION == K.AGG_SEQ_MEAN_TOKEN_SUM_NORM:
        divisor = sequences * norm_constant
    else:
        divisor = sequences
    return divisor


# ------------------------------------------------------------------------------------ KL, mismatch
@triton.jit
def kl_estimator(x, ESTIMATOR: tl.constexpr, STRAIGHT_THROUGH: tl.constexpr):
    """Schulman's estimator of KL(π_θ ‖ π_ref) from ``x = log π_ref − log π_θ`` (http://joschu.net/blog/kl-approx.html):
    ``(value, ∂value/∂x)``. k1 = −x; k2 = x²/2; k3 = eˣ − x − 1 (as expm1(x) − x: exact near 0); with
    ``STRAIGHT_THROUGH`` (k3 only) the value of k3 with the gradient of k2 (verl's ``k3+``).

    Also the mismatch metrics k1 / k3 of the rollout log-ratio d (the same estimators, of KL(μ ‖ π_trainer))."""
    if ESTIMATOR == K.KL_K1:
        value = -x
        d_value = tl.zeros_like(x) - 1.0
    elif ESTIMATOR == K.KL_K2:
        value = 0.5 * (x * x)
        d_value = x
    else:
        x_expm1 = expm1(x)
        k3 = x_expm1 - x
        if STRAIGHT_THROUGH:
            k2 = 0.5 * (x * x)
            value = k2 + stop_gradient(k3 - k2)
            d_value = x
        else:
            value = k3
            d_value = x_expm1
    return value, d_value


@triton.jit
def weighted_kl(x, log_ratio, score, ESTIMATOR: tl.constexpr, STRAIGHT_THROUGH: tl.constexpr, KL_RATIO: tl.constexpr):
    """The KL penalty before its output clamp: the estimator of x (:func:`kl_estimator`) times a weight — with
    ``KL_RATIO`` = bias correction the ratio e^ℓ to the sampling policy (``log_ratio`` ℓ), with score function
    e^score where ``score`` = log π_θ − stopgrad(log π_θ) (value 1: only the score-function gradient), else 1.

    ``(value, ∂estimator/∂x, weight, ∂value/∂ℓ, ∂value/∂score)``: ∂value/∂x = weight·∂estimator/∂x, returned as
    its two factors so that the kernel masks the input clamp's gradient before the product (and keeps its
    fused multiply-add). ``log_ratio`` / ``score`` are read only in their mode."""
    value, d_estimator = kl_estimator(x, ESTIMATOR, STRAIGHT_THROUGH)
    weight = tl.zeros_like(x) + 1.0
    d_log_ratio = tl.zeros_like(x)
    d_score = tl.zeros_like(x)
    if KL_RATIO == K.KL_RATIO_BIAS_CORRECTION:
        weight = tl.exp(log_ratio)
        value = value * weight
        d_log_ratio = value
    elif KL_RATIO == K.KL_RATIO_SCORE_FUNCTION:
        weight = tl.exp(score)
        value = value * weight
        d_score = value
    return value, d_estimator, weight, d_log_ratio, d_score


@triton.jit
def score_function_gradient(x, value, d_estimator, ESTIMATOR: tl.constexpr, STRAIGHT_THROUGH: tl.constexpr):
    """∂/∂log π_θ of the score-function KL ``k(x)·e^score`` inside the input clamp (``x = log π_ref − log π_θ``,
    ``value`` = k(x), ``d_estimator`` = ∂k/∂x; the score is 0 in value): k(x) − ∂k/∂x, the score's path plus
    x's. For k3 that is (eˣ − x − 1) − (eˣ − 1) = −x, taken as such: the two terms are ~eˣ (1e8 at x = 18.5), and
    their float32 difference keeps only multiples of their ulp (8) of −x."""
    grad = value - d_estimator
    if ESTIMATOR == K.KL_K3:
        if not STRAIGHT_THROUGH:
            grad = -x
    return grad


@triton.jit
def chi2(log_ratio):
    """χ² estimate ρ² − 1 = e^{2x} − 1 of a log-ratio x (exact near 0): ``(value, ∂value/∂x)``."""
    value = expm1(2.0 * log_ratio)
    return value, 2.0 * (value + 1.0)

