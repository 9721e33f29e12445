"""Fused GRPO loss, pass 2 of 2 (forward): every token's term, its gradient and the metrics' partials (Triton).

The per-token formulas are those of ``token_math.py``, which the torch path (``mp_grpo/loss/torch_path.py``
steps 5–6, ``docs/loss.md``) runs too; this kernel loads their inputs and chains their derivatives. Each
token's contribution to the share is c_t / D_t, and its gradient is written here already — every
sequence-level quantity it depends on is detached except the gspo / gmpo sequence mean m:

    grad_lp[t]   = ∂(c_t / D_t) / ∂ log π_θ[t] along the token's own path (ratio, log-prob, KL)
    grad_ent[t]  = −bonus / D_t
    seq_grad[s] += Σ_{t ∈ s} ∂(c_t / D_t) / ∂m_s          (gspo / gmpo; float64 atomics, see segment_add)
    seq_factor[t] = ∂m_s / ∂ log π_θ[t] = [ℓ_t unclamped (and, gmpo, unclipped)] / n_s

The backward kernel multiplies by the upstream gradient and adds seq_grad[s] · seq_factor[t].

Schedule (one program per BLOCK positions):
    1. positions, sequences, validity; inputs sanitized (masked positions read as 0, never loaded) — the
       log-probs and entropy loaded, or with FROM_STATS merged from the log-prob op's all-gathered statistics
       (and M, log S, entropy stored for its backward, its error counts added: the merge kernel's work,
       ``mp_grpo/ops/logits_grpo_loss.py``); a valid position with a NaN / ±inf input dropped as if masked
       (``grpo_loss_common.token_inputs``: no value, no gradient), flagged per input; the clamped log-ratio ℓ
       and the rollout log-ratio d.
    2. per-sequence values from the pass-1 sums: length n, gspo / gmpo mean, Σd, OPSM mean.
    3. the objective: term, ratio, clip flags; ∂term/∂log π along the token's path, ∂term/∂m.
    4. rollout correction (weight raw → truncated → applied) and the keep masks (rejection, OPSM,
       top-entropy, the trust region — its binary divergence here, a top-K one read per token —, M2PO's d² against
       the step's threshold, d in float64 from the old and rollout log-probs as given); the policy term.
    5. KL (+ its gradient) and entropy bonus; skip; the divisor D_t; the share and the gradients.
    6. partial sums and extremes of this block for the metrics (and the non-finite counts: dropped positions,
       and per input — the finalize kernel adds those into the deferred error ledger); with rollout log-probs,
       the per-sequence χ² of sequences [pid·BLOCK, (pid+1)·BLOCK) (counted on CP rank 0 only).
"""

import triton
import triton.language as tl

from mp_grpo.kernels import grpo_loss_constants as K
from mp_grpo.kernels.grpo_loss_common import (
    block_ends,
    gmpo_clip,
    masked_max,
    masked_min,
    masked_sum,
    param,
    segment_add,
    sequence_index,
    token_block,
    token_inputs,
)
from mp_grpo.kernels.token_math import (
    binary_divergence,
    chi2,
    cispo,
    clamp_sym,
    clipped_surrogate,
    floor_count,
    gmpo,
    high_entropy,
    kl_estimator,
    level_log_ratio,
    m2po_keep,
    normalized_weight,
    opsm_keep,
    reinforce,
    rejection_keep,
    sapo,
    score_function_gradient,
    token_divisor,
    truncated_weight,
    trust_region_keep,
    weighted_kl,
)


@triton.jit
def grpo_loss_combine_kernel(
    # token inputs, flat [N]; div_ptr: the top-K trust region's divergence (float64, TRUST_REGION == TR_GIVEN only)
    lp_ptr, old_ptr, rollout_ptr, ref_ptr, ent_ptr, adv_ptr, mask_ptr, div_ptr,
    # FROM_STATS: statistics [TP, N + 1, 4] fp32, targets [N] int64, out (M, log S, H, 1 - p_t, log p_t + H) [5, N],
    # error counters [3] int64 (lp_ptr / ent_ptr unused)
    stats_ptr, target_ptr, row_out_ptr, errors_ptr,
    # sequences: cu_seqlens [S + 1] (packed only), pass-1 sums [S, NUM_COLS] (float64), seq_grad [S] (float64, zeroed)
    cu_ptr, seq_sums_ptr, seq_grad_ptr,
    # step values (0-dim: float64 counts, weight mean, entropy and M2PO thresholds; bool skip) and config parameters
    tokens_ptr, sequences_ptr, weight_mean_ptr, threshold_ptr, skip_ptr, m2po_threshold_ptr, params_ptr,
    # outputs: grad_lp, grad_ent, seq_factor [N] (compute dtype), partials [programs, PARTIAL_COLS] (float64)
    grad_lp_ptr, grad_ent_ptr, seq_factor_ptr, partial_ptr,
    # sizes
    N, T, S, search_steps,
    # FROM_STATS: sizes and strides of the statistics, 1 / temperature
    TP, V_global, ignore_index, stride_stats_rank, stride_stats_row, inv_temperature,
    # meta-parameters: inputs and layout
    FROM_STATS: tl.constexpr, PACKED: tl.constexpr, HAS_OLD: tl.constexpr, HAS_ROLLOUT: tl.constexpr, BYPASS: tl.constexpr,
    HAS_REF: tl.constexpr, HAS_ENTROPY: tl.constexpr, ADV_PER_TOKEN: tl.constexpr, OWNS_SEQUENCES: tl.constexpr,
    # meta-parameters: the config
    OBJECTIVE: tl.constexpr, DUAL_CLIP: tl.constexpr, AGGREGATION: tl.constexpr,
    WEIGHT_LEVEL: tl.constexpr, NORMALIZE_WEIGHTS: tl.constexpr, REJECT_LEVEL: tl.constexpr,
    OPSM: tl.constexpr, TOP_ENTROPY: tl.constexpr, KL_IN_LOSS: tl.constexpr, KL_ESTIMATOR: tl.constexpr,
    KL_STRAIGHT_THROUGH: tl.constexpr, KL_RATIO: tl.constexpr, ENTROPY_BONUS: tl.constexpr, SKIP: tl.constexpr,
    TRUST_REGION: tl.constexpr, TR_DIRECTIONAL: tl.constexpr, M2PO: tl.constexpr,
    # meta-parameters: pass-1 columns, dtype, block
    NUM_COLS: tl.constexpr, COL_SEQ_IN: tl.constexpr, COL_D: tl.constexpr, COL_OPSM: tl.constexpr,
    COMPUTE: tl.constexpr, BLOCK: tl.constexpr,
    CONSTANTS_KEY: tl.constexpr,  # grpo_loss_constants.CONSTANTS_KEY: its constants' values in Triton's cache key
):
    pid = tl.program_id(0)
    # --- 1. positions, validity, sanitized inputs, log-ratios ---
    offs, seq, masked_in = token_block(pid, mask_ptr, cu_ptr, N, T, S, search_steps, PACKED, BLOCK)
    (valid, lp, ent, old, rollout, ref, adv, log_ratio, log_ratio_inside, d,
     bad_lp, bad_old, bad_rollout, bad_ref, bad_adv, bad_ent) = token_inputs(
        lp_ptr, ent_ptr, old_ptr, rollout_ptr, ref_ptr, adv_ptr, stats_ptr, target_ptr, row_out_ptr, errors_ptr,
        offs, seq, masked_in, params_ptr, N, TP, V_global, ignore_index, stride_stats_rank, stride_stats_row,
        inv_temperature, HAS_ENTROPY, FROM_STATS, True, HAS_OLD, HAS_ROLLOUT, HAS_REF, BYPASS, ADV_PER_TOKEN, COMPUTE,
    )
    clamp = param(params_ptr, K.P_LOG_RATIO_CLAMP, COMPUTE)
    zero = tl.zeros_like(lp)
    no = offs < 0  # all False

    # --- 2. per-sequence values (whole sequences, all CP ranks) ---
    count_floor = zero + K.COUNT_FLOOR
    row = seq_sums_ptr + seq * NUM_COLS
    if NUM_COLS > 0:
        count = tl.load(row, mask=valid, other=0.0).to(COMPUTE)
        count_floor = floor_count(count)
    sum_d = zero
    if COL_D >= 0:
        sum_d = tl.load(row + COL_D, mask=valid, other=0.0).to(COMPUTE)

    # --- 3. the objective ---
    ratio_token = tl.exp(log_ratio)
    direct = zero  # ∂term/∂log π_θ[t] along the token's own path
    along_mean = zero  # ∂term/∂m (gspo / gmpo)
    seq_input_grad = zero  # ∂(sequence input)/∂ℓ (gspo / gmpo)
    clip_low = no
    clip_high = no
    dual = no
    if OBJECTIVE == K.OBJ_PPO_CLIP or OBJECTIVE == K.OBJ_GSPO:
        ratio = ratio_token
        if OBJECTIVE == K.OBJ_GSPO:
            seq_mean = tl.load(row + COL_SEQ_IN, mask=valid, other=0.0).to(COMPUTE) / count_floor
            ratio = tl.exp(seq_mean)
            seq_input_grad = tl.where(log_ratio_inside, 1.0, 0.0).to(COMPUTE)
        term, d_term_d_ratio, clip_low, clip_high, dual = clipped_surrogate(
            ratio, adv, param(params_ptr, K.P_CLIP_LOW, COMPUTE), param(params_ptr, K.P_CLIP_HIGH, COMPUTE),
            param(params_ptr, K.P_DELTA, COMPUTE), param(params_ptr, K.P_DUAL_CLIP_C, COMPUTE), DUAL_CLIP,
        )
        if OBJECTIVE == K.OBJ_GSPO:
            along_mean = d_term_d_ratio * ratio
        else:
            direct = tl.where(log_ratio_inside, d_term_d_ratio * ratio, 0.0)
    elif OBJECTIVE == K.OBJ_CISPO:
        ratio = ratio_token
        term, direct, clip_low, clip_high = cispo(
            lp, ratio, adv, param(params_ptr, K.P_CLIP_LOW, COMPUTE), param(params_ptr, K.P_CLIP_HIGH, COMPUTE)
        )
    elif OBJECTIVE == K.OBJ_SAPO:
        ratio = ratio_token
        term, d_term_d_ratio = sapo(
            ratio, adv, param(params_ptr, K.P_TAU_POS, COMPUTE), param(params_ptr, K.P_TAU_NEG, COMPUTE)
        )
        direct = tl.where(log_ratio_inside, d_term_d_ratio * ratio, 0.0)
    elif OBJECTIVE == K.OBJ_GMPO:
        clipped, clip_low, clip_high = gmpo_clip(log_ratio, adv, params_ptr, COMPUTE)
        seq_mean = tl.load(row + COL_SEQ_IN, mask=valid, other=0.0).to(COMPUTE) / count_floor
        term, along_mean, ratio = gmpo(seq_mean, adv)
        seq_input_grad = tl.where(log_ratio_inside & ~clip_low & ~clip_high, 1.0, 0.0).to(COMPUTE)
    else:  # reinforce
        ratio = ratio_token
        term, direct = reinforce(lp, adv)

    # --- 4. rollout correction weight, keep masks, the policy term ---
    applied = zero + 1.0
    raw_weight = applied
    truncated = applied
    if WEIGHT_LEVEL != K.LEVEL_NONE:
        weight_log = level_log_ratio(d, sum_d, count_floor, clamp, WEIGHT_LEVEL)
        raw_weight, truncated = truncated_weight(
            weight_log, param(params_ptr, K.P_WEIGHT_MIN, COMPUTE), param(params_ptr, K.P_WEIGHT_MAX, COMPUTE)
        )
        applied = truncated
        if NORMALIZE_WEIGHTS:
            applied = normalized_weight(truncated, tl.load(weight_mean_ptr).to(COMPUTE))
        term = term * applied
    keep_rollout = valid
    keep_opsm = valid
    keep_entropy = valid
    if REJECT_LEVEL != K.LEVEL_NONE:
        keep_rollout = rejection_keep(
            level_log_ratio(d, sum_d, count_floor, clamp, REJECT_LEVEL),
            param(params_ptr, K.P_REJECT_MIN, COMPUTE), param(params_ptr, K.P_REJECT_MAX, COMPUTE),
        )
    if OPSM:
        sum_divergence = tl.load(row + COL_OPSM, mask=valid, other=0.0).to(COMPUTE)
        keep_opsm = opsm_keep(adv, sum_divergence, count_floor, param(params_ptr, K.P_OPSM_DELTA, COMPUTE))
    if TOP_ENTROPY:
        # The entropies as given (the step's quantile is one of their values), not rounded to COMPUTE.
        given = ent
        if not FROM_STATS:
            given = tl.load(ent_ptr + offs, mask=valid, other=0.0)
        keep_entropy = high_entropy(given, tl.load(threshold_ptr).to(tl.float64))
    keep_trust = valid
    if TRUST_REGION != K.TR_NONE:  # π_θ (this pass's log-probs, stop-gradient: the keep has no derivative) vs μ
        if TRUST_REGION == K.TR_GIVEN:  # top-K: the float64 divergence and bounds, as the torch path compares them
            divergence = tl.load(div_ptr + offs, mask=valid, other=0.0)
            delta_low = tl.load(params_ptr + K.P_TR_DELTA_LOW)
            delta_high = tl.load(params_ptr + K.P_TR_DELTA_HIGH)
        else:
            divergence = binary_divergence(lp, rollout, TRUST_REGION)
            delta_low = param(params_ptr, K.P_TR_DELTA_LOW, COMPUTE)
            delta_high = param(params_ptr, K.P_TR_DELTA_HIGH, COMPUTE)
        keep_trust = trust_region_keep(divergence, lp, rollout, adv, delta_low, delta_high, TR_DIRECTIONAL)
    keep_m2po = valid
    if M2PO != K.M2PO_NONE:
        # d in float64 from the inputs as given: the GlobalBatch sorted these very numbers for its threshold
        if HAS_OLD:
            old_given = tl.load(old_ptr + offs, mask=valid, other=0.0).to(tl.float64)
        elif FROM_STATS:
            old_given = lp.to(tl.float64)  # on-policy: the merged log-probs (float32) themselves
        else:
            old_given = tl.load(lp_ptr + offs, mask=valid, other=0.0).to(tl.float64)
        rollout_given = tl.load(rollout_ptr + offs, mask=valid, other=0.0).to(tl.float64)
        d_given, _ = clamp_sym(tl.where(valid, old_given - rollout_given, 0.0), tl.load(params_ptr + K.P_LOG_RATIO_CLAMP))
        # The advantage's sign in float64 (exact for every input dtype): Triton's interpreter compares a loaded bf16
        # value as its raw 16 bits, so that a negative bf16 advantage would not be < 0 there.
        if ADV_PER_TOKEN:
            adv_given = tl.load(adv_ptr + offs, mask=valid, other=0.0).to(tl.float64)
        else:
            adv_given = tl.load(adv_ptr + seq, mask=valid, other=0.0).to(tl.float64)
        keep_m2po = m2po_keep(d_given, tl.load(m2po_threshold_ptr), adv_given, M2PO == K.M2PO_CLIP_QUADRANTS)
    keep = valid & keep_rollout & keep_opsm & keep_entropy & keep_trust & keep_m2po
    policy = tl.where(keep, term, 0.0)
    policy_scale = tl.where(keep, applied, 0.0)  # ∂policy/∂term

    # --- 5. KL, entropy bonus, skip, divisor; share and gradients ---
    contribution = policy
    d_contribution = policy_scale * direct
    kl = zero
    if HAS_REF:
        x, x_inside = clamp_sym(ref - lp, param(params_ptr, K.P_KL_INPUT_CLAMP, COMPUTE))
        # token_math (written once); the score log π_θ − stopgrad(log π_θ) is 0 in value
        before_clamp, d_estimator, weight, d_log_ratio, d_score = weighted_kl(
            x, log_ratio, zero, KL_ESTIMATOR, KL_STRAIGHT_THROUGH, KL_RATIO
        )
        # chained to ∂/∂log π_θ: ∂x = −1 inside the input clamp, ∂ℓ = 1 inside the log-ratio clamp, ∂score = 1
        d_before_clamp = tl.where(x_inside, -d_estimator, 0.0) * weight
        if KL_RATIO == K.KL_RATIO_BIAS_CORRECTION:
            d_before_clamp = d_before_clamp + tl.where(log_ratio_inside, d_log_ratio, 0.0)
        elif KL_RATIO == K.KL_RATIO_SCORE_FUNCTION:  # inside the input clamp both paths in one exact expression
            d_before_clamp = tl.where(
                x_inside, score_function_gradient(x, before_clamp, d_estimator, KL_ESTIMATOR, KL_STRAIGHT_THROUGH),
                d_score,
            )
        kl, kl_inside = clamp_sym(before_clamp, param(params_ptr, K.P_KL_OUTPUT_CLAMP, COMPUTE))
        if KL_IN_LOSS:
            kl_coef = param(params_ptr, K.P_KL_COEF, COMPUTE)
            contribution = contribution + kl_coef * kl
            d_contribution = d_contribution + kl_coef * tl.where(kl_inside, d_before_clamp, 0.0)
    d_entropy = zero
    if ENTROPY_BONUS:
        bonus = param(params_ptr, K.P_ENTROPY_BONUS, COMPUTE)
        contribution = contribution - bonus * ent
        d_entropy = zero - bonus
    live = valid
    if SKIP:
        live = valid & (tl.load(skip_ptr) == 0)
    divisor = zero + token_divisor(  # the loads it does not use are compiled away
        tl.load(tokens_ptr).to(COMPUTE), tl.load(sequences_ptr).to(COMPUTE), count_floor,
        param(params_ptr, K.P_NORM_CONSTANT, COMPUTE), AGGREGATION,
    )
    share = tl.where(live, contribution / divisor, 0.0)
    tl.store(grad_lp_ptr + offs, tl.where(live, d_contribution / divisor, 0.0), mask=offs < N)
    if ENTROPY_BONUS:
        tl.store(grad_ent_ptr + offs, tl.where(live, d_entropy / divisor, 0.0), mask=offs < N)
    if OBJECTIVE == K.OBJ_GSPO or OBJECTIVE == K.OBJ_GMPO:
        tl.store(seq_factor_ptr + offs, tl.where(valid, seq_input_grad / count_floor, 0.0), mask=offs < N)
        to_mean = tl.where(live, policy_scale * along_mean / divisor, 0.0)
        seq_next = sequence_index(offs + 1, cu_ptr, T, S, search_steps, PACKED)
        end, _ = block_ends(offs, seq_next, seq, N, BLOCK)
        segment_add(seq_grad_ptr, to_mean.to(tl.float64), seq, end, S, 1, 0)

    # --- 6. metric partials of this block ---
    out = partial_ptr + pid * K.PARTIAL_COLS
    none = tl.zeros([], dtype=tl.float64)
    tl.store(out + K.SUM_SHARE, masked_sum(share, valid))
    tl.store(out + K.SUM_VALID, masked_sum(valid, valid))
    tl.store(out + K.SUM_POLICY, masked_sum(policy, valid))
    tl.store(out + K.SUM_RATIO, masked_sum(ratio, valid))
    tl.store(out + K.EXT_RATIO_MIN, masked_min(ratio, valid))
    tl.store(out + K.EXT_RATIO_MAX, masked_max(ratio, valid))
    tl.store(out + K.SUM_CLIP_LOW, masked_sum(clip_low, valid))
    tl.store(out + K.SUM_CLIP_HIGH, masked_sum(clip_high, valid))
    tl.store(out + K.SUM_CLIP_DUAL, masked_sum(dual, valid))
    tl.store(out + K.SUM_WEIGHT_RAW, masked_sum(raw_weight, valid))
    tl.store(out + K.SUM_WEIGHT_TRUNCATED, masked_sum(truncated, valid))
    tl.store(out + K.SUM_WEIGHT_APPLIED, masked_sum(applied, valid))
    tl.store(out + K.EXT_WEIGHT_RAW_MIN, masked_min(raw_weight, valid))
    tl.store(out + K.EXT_WEIGHT_RAW_MAX, masked_max(raw_weight, valid))
    tl.store(out + K.EXT_WEIGHT_TRUNCATED_MIN, masked_min(truncated, valid))
    tl.store(out + K.EXT_WEIGHT_TRUNCATED_MAX, masked_max(truncated, valid))
    tl.store(out + K.EXT_WEIGHT_APPLIED_MIN, masked_min(applied, valid))
    tl.store(out + K.EXT_WEIGHT_APPLIED_MAX, masked_max(applied, valid))
    tl.store(out + K.SUM_REJECTED_ROLLOUT, masked_sum(~keep_rollout, valid))
    tl.store(out + K.SUM_REJECTED_OPSM, masked_sum(~keep_opsm, valid))
    tl.store(out + K.SUM_REJECTED_ENTROPY, masked_sum(~keep_entropy, valid))
    tl.store(out + K.SUM_REJECTED_TRUST_REGION, masked_sum(~keep_trust, valid))
    tl.store(out + K.SUM_REJECTED_M2PO, masked_sum(~keep_m2po, valid))
    tl.store(out + K.SUM_KL, masked_sum(kl, valid))
    tl.store(out + K.SUM_ENTROPY, masked_sum(ent, valid))
    # the positions dropped for a non-finite input (metric), and per input where it is not finite (the ledger)
    tl.store(out + K.SUM_NONFINITE, masked_sum(masked_in & ~valid, masked_in))
    tl.store(out + K.SUM_NONFINITE_LOGPROBS, masked_sum(bad_lp, bad_lp))
    tl.store(out + K.SUM_NONFINITE_OLD, masked_sum(bad_old, bad_old))
    tl.store(out + K.SUM_NONFINITE_ROLLOUT, masked_sum(bad_rollout, bad_rollout))
    tl.store(out + K.SUM_NONFINITE_REF, masked_sum(bad_ref, bad_ref))
    tl.store(out + K.SUM_NONFINITE_ADVANTAGES, masked_sum(bad_adv, bad_adv))
    tl.store(out + K.SUM_NONFINITE_ENTROPY, masked_sum(bad_ent, bad_ent))
    chi2_seq = none
    chi2_seq_count = none
    mismatch_k1 = none
    mismatch_k3 = none
    chi2_token = none
    if HAS_ROLLOUT:
        k1_d, _ = kl_estimator(d, K.KL_K1, False)  # token_math: the mismatch metrics are the KL estimators of d
        k3_d, _ = kl_estimator(d, K.KL_K3, False)
        chi2_d, _ = chi2(d)
        mismatch_k1 = masked_sum(k1_d, valid)
        mismatch_k3 = masked_sum(k3_d, valid)
        chi2_token = masked_sum(chi2_d, valid)
        if OWNS_SEQUENCES:  # each sequence counted once: on CP rank 0
            seqs = pid * BLOCK + tl.arange(0, BLOCK)
            in_seqs = seqs < S
            seq_count = tl.load(seq_sums_ptr + seqs * NUM_COLS, mask=in_seqs, other=0.0).to(COMPUTE)
            has_token = in_seqs & (seq_count > 0)
            seq_sum_d = tl.load(seq_sums_ptr + seqs * NUM_COLS + COL_D, mask=has_token, other=0.0).to(COMPUTE)
            seq_log_ratio, _ = clamp_sym(seq_sum_d, clamp)
            chi2_seq_values, _ = chi2(seq_log_ratio)
            chi2_seq = masked_sum(chi2_seq_values, has_token)
            chi2_seq_count = masked_sum(has_token, has_token)
    tl.store(out + K.SUM_MISMATCH_K1, mismatch_k1)
    tl.store(out + K.SUM_MISMATCH_K3, mismatch_k3)
    tl.store(out + K.SUM_CHI2_TOKEN, chi2_token)
    tl.store(out + K.SUM_CHI2_SEQ, chi2_seq)
    tl.store(out + K.SUM_CHI2_SEQ_COUNT, chi2_seq_count)
