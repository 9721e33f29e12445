"""The torch path of :class:`~mp_grpo.loss.GRPOLoss`: steps 3–6 of its schedule in plain torch, the readable
specification the fused kernels (:mod:`mp_grpo.ops.grpo_loss`) are tested against.

:meth:`GRPOLoss.__call__ <mp_grpo.loss.grpo_loss.GRPOLoss.__call__>` checks the inputs and builds the step's
account (steps 1–2), then calls, with the inputs it checked:
    3. :func:`token_stage`: a valid position where an input is NaN or ±inf dropped as if masked (counted per
       input); masked positions replaced by 0 *before* any arithmetic (``torch.where``, so inf / NaN there never
       reach a value or a gradient); the clamped log-ratio ℓ = log π_θ − log π_old, the rollout-correction
       log-ratio d, the OPSM divergence, the trust region's divergence (binary; top-K given), M2PO's float64 d;
       the columns to sum per sequence.
    4. (in ``__call__``: the per-sequence sums of those columns, broadcast back to the tokens.)
    5. :func:`combine_stage`: 5a. the objective's term; 5b. × the IS weight (computed, or the caller's
       ``is_weights``), the rollout rejection; 5c. zeroed
       where rejected (OPSM, top-entropy, clip_cov's selection, the trust region, M2PO); 5d. + coef·KL and − bonus·entropy on every
       valid token; 5e. each divided by its aggregation's global divisor, + the VAPO NLL, zero when the step is
       skipped, summed → this micro-batch's share.
    6. Metrics (no gradient): ``[sum, count]`` means and min / max entries (see :mod:`.metrics`), and the count of
       dropped positions (``nonfinite_inputs``); ``__call__`` adds the per-input counts into the deferred error
       ledger (none when the step is skipped).

Both stages are pure functions of the config and tensors (no host synchronization, no collective), so that
``GRPOLoss(config, compile=True)`` can run them through ``torch.compile``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mp_grpo.config.loss import LossConfig, Objective, RatioLevel
from mp_grpo.loss import metrics as M
from mp_grpo.loss.aggregation import token_divisor
from mp_grpo.loss.clamps import COUNT_FLOOR, symmetric_clamp
from mp_grpo.loss.entropy import high_entropy
from mp_grpo.loss.kl import kl_penalty
from mp_grpo.loss.m2po import m2po_keep, m2po_log_ratio
from mp_grpo.loss.mismatch import chi2_sequence, chi2_token, k1, k3
from mp_grpo.loss.objectives import needs_sequence_sum, policy_term, sequence_input, sequence_value
from mp_grpo.loss.opsm import opsm_divergence, opsm_keep
from mp_grpo.loss.rollout_correction import kept, level_log_ratio, normalized_weight, token_log_ratio, weights
from mp_grpo.loss.trust_region import BINARY_CODES, binary_divergence, trust_region_keep
from mp_grpo.loss.vespo import vespo_token_input
from mp_grpo.ops.checks import (
    NONFINITE_INPUTS, CheckInputs, kernel_counters, nonfinite_input_kinds, raise_on_kernel_errors, record_errors,
)


class Tokens(NamedTuple):
    """Output of the token stage: sanitized per-token tensors (exactly 0 on masked positions)."""

    logprobs: torch.Tensor
    log_ratio: torch.Tensor
    advantages: torch.Tensor
    valid: torch.Tensor
    rollout_d: torch.Tensor | None
    ref: torch.Tensor | None
    entropy: torch.Tensor | None
    entropy_given: torch.Tensor | None
    """The entropy as given (its own dtype, detached): the top-entropy selection compares these values with the
    step's quantile of them, not their rounding to the compute dtype."""
    kl_logprobs: torch.Tensor
    """The log-probs the KL is taken of (``logprobs`` unless ``kl_logprobs`` was given)."""
    positive: torch.Tensor | None
    """Bool: valid tokens of positive examples (``nll.positive_coef`` only)."""
    is_weights: torch.Tensor | None
    """The caller's precomputed IS weight per token (``is_weights``), detached."""
    seq_columns: torch.Tensor
    """``[*tokens, k]``: valid count, then (per config) the objective's sequence input, d, the OPSM divergence,
    ℓ for a sequence-level KL bias correction."""
    nonfinite: torch.Tensor | None = None
    """int64 ``[len(NONFINITE_INPUTS)]``: per input, the valid positions where it is NaN or ±inf (dropped)."""
    dropped: torch.Tensor | None = None
    """0-dim: the valid positions dropped because an input is NaN or ±inf there (``valid`` excludes them)."""
    nonfinite_is_weights: torch.Tensor | None = None
    """0-dim int64: the valid positions where the caller's ``is_weights`` is NaN or ±inf (dropped); None without."""
    cov_selected: torch.Tensor | None = None
    """Bool: clip_cov / kl_cov's covariance selection of this call (set after the token stage)."""
    rollout: torch.Tensor | None = None
    """The rollout log-probs (compute dtype, detached): μ of the trust region."""
    divergence: torch.Tensor | None = None
    """The trust region's divergence D_t (binary: compute dtype, from logprobs and rollout; top-K: the given float64)."""
    m2po_d: torch.Tensor | None = None
    """M2PO's d = clamp(old − rollout) in float64 from the inputs as given (``m2po.bound`` only)."""
    advantages_given: torch.Tensor | None = None
    """The advantages as given (their dtype, detached): M2PO's clip quadrants read their sign (``clip_quadrants``)."""


class StepValues(NamedTuple):
    """What the combine stage reads from the GlobalBatch."""

    tokens: torch.Tensor
    sequences: torch.Tensor
    micro_batches: torch.Tensor
    weight_mean: torch.Tensor | None
    entropy_threshold: torch.Tensor | None
    skip: torch.Tensor | None
    entropy_coef: float | torch.Tensor
    """The entropy-bonus coefficient of this step (``bonus_coef``, or the adaptive one)."""
    positive_tokens: torch.Tensor | None
    """The step's valid tokens of positive examples (``nll.positive_coef`` only)."""
    m2po_threshold: torch.Tensor | None = None
    """M2PO's threshold on d² (``m2po.bound`` only)."""


def token_stage(
    cfg: LossConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    kl_logprobs: torch.Tensor | None,
    positive: torch.Tensor | None,
    is_weights: torch.Tensor | None = None,
    topk_divergence: torch.Tensor | None = None,
) -> Tokens:
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    # a valid position with a NaN / ±inf input is dropped, as if masked (kl_logprobs count as logprobs)
    inputs = dict(logprobs=logprobs, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs,
                  ref_logprobs=ref_logprobs, advantages=advantages, entropy=entropy)
    bad = [None if x is None else valid & ~torch.isfinite(x) for x in (inputs[name] for name in NONFINITE_INPUTS)]
    if kl_logprobs is not None:
        bad[0] = bad[0] | (valid & ~torch.isfinite(kl_logprobs))  # type: ignore[operator]
    bad_weights = None if is_weights is None else valid & ~torch.isfinite(is_weights)
    given = [b for b in bad + [bad_weights] if b is not None]
    nonfinite = torch.stack([valid.new_zeros((), dtype=torch.int64) if b is None else b.sum() for b in bad])
    dropped_at = torch.stack(given).any(dim=0)
    dropped = dropped_at.sum()
    valid = valid & ~dropped_at

    def clean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x.to(dtype), zero)

    lp = clean(logprobs)
    rollout = None if rollout_logprobs is None else clean(rollout_logprobs).detach()
    if cfg.rollout_correction.bypass:
        old = rollout
    elif old_logprobs is None:
        old = lp.detach()
    else:
        old = clean(old_logprobs).detach()
    adv = clean(advantages).detach()
    log_ratio = symmetric_clamp(lp - old, cfg.policy.log_ratio_clamp)  # type: ignore[operator]
    d = None
    if rollout is not None:
        trainer = lp.detach() if cfg.rollout_correction.bypass else old
        d = token_log_ratio(trainer, rollout, valid, cfg.policy.log_ratio_clamp)  # type: ignore[arg-type]
    columns = [valid.to(dtype)]
    if cfg.policy.objective == Objective.VESPO:
        columns.append(vespo_token_input(log_ratio, d, valid, cfg.rollout_correction))
    else:
        seq_in = sequence_input(cfg.policy, log_ratio, adv)
        if seq_in is not None:
            columns.append(seq_in)
    if d is not None:
        columns.append(d)
    if cfg.opsm.delta is not None:
        behaviour = rollout if rollout is not None else old
        columns.append(opsm_divergence(behaviour, lp, valid))  # type: ignore[arg-type]
    if sequence_bias_correction(cfg):
        columns.append(log_ratio)
    divergence = m2po_d = None
    mode = cfg.trust_region.mode
    if mode in BINARY_CODES:
        divergence = binary_divergence(mode, lp, rollout)  # type: ignore[arg-type]
    elif topk_divergence is not None:
        divergence = torch.where(valid, topk_divergence, torch.zeros((), dtype=topk_divergence.dtype,
                                                                     device=topk_divergence.device))
    if cfg.m2po.bound is not None:  # from the inputs as given, as the GlobalBatch took its threshold (float64)
        m2po_d = m2po_log_ratio(logprobs if old_logprobs is None else old_logprobs, rollout_logprobs, valid,  # type: ignore[arg-type]
                                cfg.policy.log_ratio_clamp)
    return Tokens(
        logprobs=lp, log_ratio=log_ratio, advantages=adv, valid=valid, rollout_d=d,
        ref=None if ref_logprobs is None else clean(ref_logprobs).detach(),
        entropy=None if entropy is None else clean(entropy),
        entropy_given=None if entropy is None else torch.where(valid, entropy.detach(), zero.to(entropy.dtype)),
        kl_logprobs=lp if kl_logprobs is None else clean(kl_logprobs),
        positive=None if positive is None else valid & positive,
        is_weights=None if is_weights is None else clean(is_weights).detach(),
        seq_columns=torch.stack(columns, dim=-1), nonfinite=nonfinite, dropped=dropped,
        nonfinite_is_weights=None if bad_weights is None else bad_weights.sum(), rollout=rollout,
        divergence=divergence, m2po_d=m2po_d,
        advantages_given=torch.where(valid, advantages.detach(), torch.zeros((), dtype=advantages.dtype,
                                                                           device=advantages.device)),
    )


def sequence_bias_correction(cfg: LossConfig) -> bool:
    """Whether the KL's bias correction needs the per-sequence Σℓ (geometric / sequence level)."""
    return cfg.kl.bias_correction and cfg.kl.bias_correction_level != RatioLevel.TOKEN


def combine_stage(
    cfg: LossConfig,
    t: Tokens,
    seq_sums: torch.Tensor,
    seq_tokens: torch.Tensor,
    step: StepValues,
    owns_sequences: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    valid, lp, adv = t.valid, t.logprobs, t.advantages
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    clamp = cfg.policy.log_ratio_clamp
    rc = cfg.rollout_correction
    # Columns of the per-sequence sums, in the order of the token stage.
    column = iter(range(1, seq_tokens.shape[-1]))
    seq_count = seq_tokens[..., 0]
    seq_in_col = next(column) if needs_sequence_sum(cfg.policy) else None
    d_col = next(column) if t.rollout_d is not None else None
    opsm_col = next(column) if cfg.opsm.delta is not None else None
    kl_col = next(column) if sequence_bias_correction(cfg) else None

    # --- 5a. the objective ---
    seq_value = None if seq_in_col is None else sequence_value(cfg.policy, seq_tokens[..., seq_in_col], seq_count)
    pt = policy_term(cfg.policy, lp, t.log_ratio, adv, seq_value, t.cov_selected)
    policy = pt.term
    # --- 5b. rollout correction: weight and rejection (vespo folds them into φ in the token stage) ---
    raw_weight = weight = truncated = None
    keep_rc = keep_opsm = keep_ent = keep_tr = keep_m2po = None
    folded = cfg.policy.objective == Objective.VESPO
    if rc.weight_level is not None and not folded:
        w_log = level_log_ratio(rc.weight_level, t.rollout_d, seq_tokens[..., d_col], seq_count, clamp)  # type: ignore[arg-type,index]
        raw_weight, truncated = weights(w_log, rc)
        weight = truncated
        if rc.normalize_weights:
            weight = normalized_weight(truncated, step.weight_mean)  # type: ignore[arg-type]
        policy = policy * weight
    if t.is_weights is not None:  # the caller's weight in place of the computed one (never both)
        policy = policy * t.is_weights
    if rc.reject_level is not None and not folded:
        r_log = level_log_ratio(rc.reject_level, t.rollout_d, seq_tokens[..., d_col], seq_count, clamp)  # type: ignore[arg-type,index]
        keep_rc = kept(r_log, rc)
    # --- 5c. OPSM, top-entropy selection and clip_cov's selection ---
    keep_cov = ~t.cov_selected if cfg.policy.objective == Objective.CLIP_COV else None  # type: ignore[operator]
    if cfg.opsm.delta is not None:
        keep_opsm = opsm_keep(adv, seq_tokens[..., opsm_col], seq_count, cfg.opsm.delta)  # type: ignore[index]
    if cfg.entropy.top_quantile < 1.0:
        keep_ent = high_entropy(t.entropy_given, step.entropy_threshold)  # type: ignore[arg-type]
    if t.divergence is not None:  # the trust region: π_θ (detached) against the rollout's μ
        keep_tr = trust_region_keep(cfg.trust_region, t.divergence, lp, t.rollout, adv)  # type: ignore[arg-type]
    if t.m2po_d is not None:
        keep_m2po = m2po_keep(cfg.m2po, t.m2po_d, step.m2po_threshold, t.advantages_given)  # type: ignore[arg-type]
    keep = valid
    for mask in (keep_rc, keep_opsm, keep_ent, keep_cov, keep_tr, keep_m2po):
        if mask is not None:
            keep = keep & mask
    policy = torch.where(keep, policy, zero)
    # --- 5d. KL and entropy bonus on every valid token (the bonus only on kept ones with bonus_on_selected) ---
    regularizer = torch.zeros_like(policy)
    kl = None
    if t.ref is not None:
        kl_log_ratio = t.log_ratio
        if kl_col is not None:
            kl_log_ratio = level_log_ratio(cfg.kl.bias_correction_level, t.log_ratio, seq_tokens[..., kl_col],
                                           seq_count, clamp)
        kl = kl_penalty(t.kl_logprobs, t.ref, kl_log_ratio, cfg.kl)
        if cfg.kl.coef != 0.0:
            regularizer = regularizer + cfg.kl.coef * kl
    bonus_entropy = None
    if cfg.entropy.bonus_coef != 0.0 or cfg.entropy.adaptive:
        bonus_entropy = t.entropy
        if cfg.entropy.bonus_on_selected:
            bonus_entropy = torch.where(keep_ent, t.entropy, zero)  # type: ignore[arg-type]
        regularizer = regularizer - step.entropy_coef * bonus_entropy  # type: ignore[operator]
    # --- 5e. aggregation: this micro-batch's share (KL / entropy with aggregation.regularizer) ---
    agg = cfg.aggregation
    tokens_, sequences_ = step.tokens.to(lp.dtype), step.sequences.to(lp.dtype)
    divisor = token_divisor(agg.mode, agg.norm_constant, tokens_, sequences_, seq_count)
    if agg.regularizer == agg.mode:
        contribution = (policy + regularizer) / divisor
    else:
        reg_divisor = token_divisor(agg.regularizer, agg.norm_constant, tokens_, sequences_, seq_count)
        contribution = policy / divisor + regularizer / reg_divisor
    if t.positive is not None:  # VAPO: coef · mean over the step's positive tokens of −log π_θ
        nll_divisor = step.positive_tokens.to(lp.dtype).clamp(min=COUNT_FLOOR)  # type: ignore[union-attr]
        contribution = contribution + cfg.nll.positive_coef * torch.where(t.positive, -lp, zero) / nll_divisor
    if step.skip is not None:
        contribution = torch.where(step.skip, zero, contribution)
    share = torch.where(valid, contribution, zero).sum()

    # --- 6. metrics ---
    with torch.no_grad():
        out: dict[str, torch.Tensor] = {
            "loss": M.total_entry(share, step.micro_batches),
            "valid_tokens": M.total_entry(valid.sum(), step.micro_batches),
            "policy_loss": M.mean_entry(policy, valid),
        }
        out.update(M.stats_entries("ratio", pt.ratio, valid))
        if pt.coefficient is not None:
            out.update(M.stats_entries("vespo_phi", pt.coefficient, valid))
        if t.cov_selected is not None:
            out["cov/selected_frac"] = M.mean_entry(t.cov_selected.to(lp.dtype), valid)
        for name, flag in (("low", pt.clipped_low), ("high", pt.clipped_high), ("dual", pt.dual_clipped)):
            if flag is not None:
                out[f"clip_frac/{name}"] = M.mean_entry(flag.to(lp.dtype), valid)
        if weight is not None:
            out.update(M.stats_entries("is_weight/raw", raw_weight, valid))  # type: ignore[arg-type]
            out.update(M.stats_entries("is_weight/truncated", truncated, valid))  # type: ignore[arg-type]
            if rc.normalize_weights:
                out.update(M.stats_entries("is_weight/applied", weight, valid))
        if t.is_weights is not None:
            out.update(M.stats_entries("is_weight/given", t.is_weights, valid))
        for name, mask in (("rollout", keep_rc), ("opsm", keep_opsm), ("entropy", keep_ent),
                           ("trust_region", keep_tr), ("m2po", keep_m2po)):
            if mask is not None:
                out[f"rejected_frac/{name}"] = M.mean_entry((~mask).to(lp.dtype), valid)
        if t.rollout_d is not None:
            d = t.rollout_d
            out["mismatch/k1"] = M.mean_entry(k1(d), valid)
            out["mismatch/k3"] = M.mean_entry(k3(d), valid)
            out["mismatch/chi2_token"] = M.mean_entry(chi2_token(d), valid)
            seq_has = (seq_sums[:, 0] > 0) & owns_sequences
            out["mismatch/chi2_seq"] = M.mean_entry(chi2_sequence(seq_sums[:, d_col], clamp), seq_has)  # type: ignore[index]
        if step.skip is not None:
            out["mismatch/skipped"] = torch.stack([step.skip.to(torch.float64), torch.ones_like(step.tokens)])
        if kl is not None:
            out["kl"] = M.mean_entry(kl, valid)
        if t.positive is not None:
            out["nll/positive"] = M.mean_entry(-lp, t.positive)
        if t.entropy is not None:
            out["entropy"] = M.mean_entry(t.entropy, valid)
            if cfg.entropy.adaptive and keep_ent is not None:  # what the controller reads (TRL's measure)
                out["entropy/selected"] = M.mean_entry(t.entropy, valid & keep_ent)
        out["nonfinite_inputs"] = M.total_entry(t.dropped, step.micro_batches)  # type: ignore[arg-type]
    return share, out


def record_nonfinite(counts: torch.Tensor, skip: torch.Tensor | None, mode: CheckInputs) -> None:
    """The token stage's per-input counts of dropped non-finite inputs into the deferred error ledger (on the CPU
    and with SYNC read at once; nothing with OFF), as the fused path's finalize kernel adds them: none when the
    step is skipped."""
    if mode is CheckInputs.OFF:
        return
    kinds = nonfinite_input_kinds()
    if skip is not None:
        counts = torch.where(skip, torch.zeros_like(counts), counts)
    counters, deferred = kernel_counters(kinds, counts.device, mode)
    if deferred:
        counters.add_(counts)
    else:
        raise_on_kernel_errors(counts, kinds, mode)


def record_nonfinite_is_weights(count: torch.Tensor, skip: torch.Tensor | None, mode: CheckInputs) -> None:
    """The caller's ``is_weights`` that were NaN or ±inf at trained positions (dropped) into the deferred error
    ledger, as :func:`record_nonfinite` does for the other inputs (none when the step is skipped)."""
    if skip is not None:
        count = torch.where(skip, torch.zeros_like(count), count)
    record_errors(
        "non-finite is_weights", count,
        lambda n: (f"is_weights is NaN or ±inf at {n} trained position(s): they were dropped from the loss (as if "
                   "masked); the caller's IS weights must be finite"),
        ValueError, mode,
    )
