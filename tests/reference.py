"""Plain float64 references, written for reading, not speed. Tests and benchmarks import them.

Nothing here calls mp_grpo: every formula is spelled out from its definition.
"""

from __future__ import annotations

import math

import torch


# --------------------------------------------------------------------------------------------
# Token log-probabilities and entropy over a full (unsharded) vocabulary
# --------------------------------------------------------------------------------------------
def logprobs_reference(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log softmax(logits / T)[target], entropy)`` in float64 over the last dimension.

    ``logits`` ``[..., V]`` is the *full* vocabulary. Rows whose target is ``ignore_index`` get
    log-prob 0 (their entropy is still computed). Entries at ``-inf`` have probability 0 and add
    nothing to the entropy (the limit p·log p → 0, not 0·inf).
    Differentiable w.r.t. ``logits`` (the result is float64; upcast happens inside).
    """
    z = logits.double() / temperature
    logz = torch.logsumexp(z, dim=-1, keepdim=True)
    logp = z - logz
    p = logp.exp()
    # p * log p -> 0 as p -> 0. Select before multiplying so that neither the value nor the
    # gradient sees 0 * (-inf).
    finite_logp = torch.where(p > 0, logp, torch.zeros_like(logp))
    entropy = -(p * finite_logp).sum(-1)
    valid = target != ignore_index
    safe_target = torch.where(valid, target, torch.zeros_like(target))
    picked = logp.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
    logprobs = torch.where(valid, picked, torch.zeros_like(picked))
    return logprobs, entropy


# --------------------------------------------------------------------------------------------
# The output layer and the log-probs together (mp_grpo.fused_linear_logprobs)
# --------------------------------------------------------------------------------------------
class _RoundTrip(torch.autograd.Function):
    """Identity in float64, except that the value and its gradient are rounded to ``dtype``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.dtype = dtype
        return x.to(dtype).double()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype).double(), None


class _RoundGradient(torch.autograd.Function):
    """Identity in float64, except that the gradient is rounded to ``dtype``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.dtype = dtype
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype).double(), None


def linear_logprobs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    logits_dtype: torch.dtype | None = None,
    logits_grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logprobs_reference(hidden @ weight.T, ...)`` in float64, differentiable w.r.t. both inputs.

    ``weight`` is the *full* ``[V, H]`` output layer. With ``logits_dtype``, the logits and the
    gradient w.r.t. them are rounded to that dtype — as any op that computes the logits in it must
    (``vocab_parallel_logprobs(hidden @ weight.T)`` does too); everything else stays exact. With
    ``logits_grad_dtype`` only the gradient w.r.t. the logits is rounded (fp32 logits whose gradient enters
    bf16 GEMMs: ``LogitDtype.FP32``).
    """
    logits = hidden.double() @ weight.double().T
    if logits_dtype is not None:
        logits = _RoundTrip.apply(logits, logits_dtype)
    if logits_grad_dtype is not None:
        logits = _RoundGradient.apply(logits, logits_grad_dtype)
    return logprobs_reference(logits, target, temperature=temperature, ignore_index=ignore_index)


def scale_reference(x: torch.Tensor, scale: torch.Tensor, base: torch.Tensor | None = None) -> torch.Tensor:
    """``scale · x`` (+ ``base``) in float64: the backward scaling of the with-loss op by the upstream gradient
    (mp_grpo.ops.scale); ``base`` is the ``main_grad`` it is added into."""
    out = scale.double().reshape(()) * x.double()
    return out if base is None else base.double() + out


# ============================================================================================
# GRPO-family loss (mp_grpo.loss) — float64 reference of the whole step's objective
# ============================================================================================
# Written row by row from the definitions in docs/loss.md, for padded [B, T] inputs. It reads the
# LossConfig's attributes (enum members are compared by their string value) and calls nothing of
# mp_grpo. Differentiable w.r.t. `logprobs` and `entropy`. At a tie the gradient follows the documented
# convention (docs/loss.md, mp_grpo/kernels/token_math.py): clamp bounds are inclusive, PPO's min takes the
# unclipped branch, the dual-clip cap only where the term lies strictly above it.
def _clamp_abs(x: torch.Tensor, bound: float | None) -> torch.Tensor:
    return x if bound is None else x.clamp(-bound, bound)


def _clamp_range(x: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """``clamp(x, low, high)`` (None: that side open), the gradient passing where low ≤ x ≤ high (bounds inclusive)."""
    return x if low is None and high is None else x.clamp(min=low, max=high)


def _clipped_surrogate_reference(p, r: torch.Tensor, adv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's −min(min(r, delta)·A, clip(r)·A) — at a tie the unclipped branch — and that term before the dual clip."""
    lo = None if p.eps_low is None else 1.0 - p.eps_low
    hi = None if p.eps_high is None else 1.0 + p.eps_high
    u1 = _clamp_range(r, None, p.delta) * adv
    u2 = _clamp_range(r, lo, hi) * adv
    term = -torch.where(u1 <= u2, u1, u2)
    if p.dual_clip_c is None:
        return term, term
    cap = -adv * p.dual_clip_c
    return torch.where((adv < 0) & (term > cap), cap, term), term


def _level_log_ratio(level: str, d: torch.Tensor, clamp: float | None) -> torch.Tensor:
    """Log IS ratio of one sequence's valid tokens `d` at `level` (token: per token; else one value)."""
    if level == "token":
        return d
    if level == "sequence":
        return _clamp_abs(d.sum(), clamp).expand_as(d)
    return d.mean().expand_as(d)  # geometric


def vespo_phi_reference(log_w: torch.Tensor, adv: torch.Tensor, k_pos, lam_pos, k_neg, lam_neg) -> torch.Tensor:
    """VESPO's φ(w) = e^λ·w^k·e^(−λw) per token (TRL ``get_gamma_weights``): (k, λ) by A ≥ 0, λ ≥ 1e-4,
    non-finite → 0; ``log_w`` is already clamped to [log 1e-8, 20]."""
    pos = adv >= 0
    k = torch.where(pos, torch.full_like(adv, k_pos), torch.full_like(adv, k_neg))
    lam = torch.where(pos, torch.full_like(adv, lam_pos), torch.full_like(adv, lam_neg)).clamp(min=1e-4)
    phi = torch.exp(lam) * torch.exp(log_w) ** k * torch.exp(-lam * torch.exp(log_w))
    return torch.where(torch.isfinite(phi), phi, torch.zeros_like(phi))


def _vespo_log_w(rc, lr: torch.Tensor, d: torch.Tensor | None) -> torch.Tensor:
    """log w of one sequence: Σ ℓ (+ Σ clamp(log ρ_t) of the token-level rollout correction), clamped."""
    floor = math.log(1e-8)
    total = lr.detach().clamp(-20.0, 20.0).sum()
    weight_token = rc.weight_level is not None and rc.weight_level.value == "token"
    reject_token = rc.reject_level is not None and rc.reject_level.value == "token"
    if d is not None and (weight_token or reject_token):
        rho = _clamp_range(torch.exp(d), rc.weight_min, rc.weight_max) if weight_token else torch.ones_like(d)
        if reject_token:
            ratio = torch.exp(d)
            keep = torch.ones_like(d, dtype=torch.bool)
            if rc.reject_min is not None:
                keep &= ratio >= rc.reject_min
            if rc.reject_max is not None:
                keep &= ratio <= rc.reject_max
            rho = torch.where(keep, rho, torch.zeros_like(rho))
        total = total + torch.log(rho).clamp(floor, 20.0).sum()
    return total.clamp(floor, 20.0).expand_as(lr)


def _policy_term_reference(p, lp: torch.Tensor, lr: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """Per-token surrogate of one sequence (its valid tokens only; vespo is handled by the caller)."""
    objective = p.objective.value
    lo = None if p.eps_low is None else 1.0 - p.eps_low
    hi = None if p.eps_high is None else 1.0 + p.eps_high
    if objective in ("ppo_clip", "gspo"):
        if objective == "ppo_clip":
            r = torch.exp(lr)
        elif p.gspo_gradient.value == "token":  # value of the sequence ratio, each token its own gradient
            r = torch.exp(lr.mean().detach() + lr - lr.detach())
        else:
            r = torch.exp(lr.mean()).expand_as(lr)
        return _clipped_surrogate_reference(p, r, adv)[0]
    if objective == "cispo":
        return -_clamp_range(torch.exp(lr), lo, hi).detach() * adv * lp
    if objective == "sapo":
        tau = torch.where(adv > 0, torch.full_like(adv, p.sapo_tau_pos), torch.full_like(adv, p.sapo_tau_neg))
        # sigmoid as exp(−softplus(−x)): its autograd derivative sigmoid(x)·sigmoid(−x) keeps the tail (e^−x) that
        # torch.sigmoid's y·(1 − y) loses to cancellation once y is near 1, even in float64
        return -(4.0 / tau) * torch.exp(-torch.nn.functional.softplus(-(tau * (torch.exp(lr) - 1.0)))) * adv
    if objective == "gmpo":
        upper = _clamp_range(lr, None, p.eps_high)
        lower = _clamp_range(lr, None if p.eps_low is None else -p.eps_low, None)
        clipped = torch.where(adv > 0, upper, torch.where(adv < 0, lower, lr))
        return -adv * torch.exp(clipped.mean())
    return -adv * lp  # reinforce


def _kl_reference(k, lp: torch.Tensor, ref: torch.Tensor, lr: torch.Tensor, clamp: float | None = None,
                  magnitude: bool = False) -> torch.Tensor:
    """The KL penalty per token; ``magnitude``: the size of the terms its estimator subtracts (k3: |eˣ − 1| + |x|),
    times the weight — the scale of its rounding error — or the output clamp where that binds."""
    x = _clamp_abs(ref - lp, k.input_clamp)
    k3 = torch.expm1(x) - x  # eˣ − x − 1, without the cancellation of exp(x) − 1 near 0
    k2 = 0.5 * x * x
    kl = {"k1": -x, "k2": k2, "k3": k3}[k.estimator.value]
    if k.straight_through:
        kl = k2 + (k3 - k2).detach()
    size = {"k1": x.abs(), "k2": k2, "k3": torch.expm1(x).abs() + x.abs()}[k.estimator.value]
    if k.bias_correction:
        level = k.bias_correction_level.value
        ratio_log = {"token": lr, "geometric": lr.mean().expand_as(lr),
                     "sequence": _clamp_abs(lr.sum(), clamp).expand_as(lr)}[level]
        kl = kl * torch.exp(ratio_log)
        size = size * torch.exp(ratio_log)
    if k.score_function:
        kl = kl * torch.exp(lp - lp.detach())
    if magnitude:
        return size if k.output_clamp is None else torch.where(kl.abs() > k.output_clamp, k.output_clamp, size)
    return _clamp_abs(kl, k.output_clamp)


def _one_minus_exp(x: torch.Tensor) -> torch.Tensor:
    """1 − eˣ for log-probs x ≤ 0, exact near 0 (the other mass of a Bernoulli)."""
    return -torch.expm1(x)


def binary_divergence_reference(mode: str, lp: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """DPPO's binary divergence of the sampled token (arXiv 2602.04879 Eqs. 13 / 14) between π = e^lp and μ = e^mu,
    log-probs capped at 0: ``binary_tv`` |π − μ|; ``binary_kl`` KL(Bern(μ) ‖ Bern(π)) with 0·log 0 = 0 (xlogy), +inf
    where π is 1 and μ not."""
    lp, mu = lp.clamp(max=0.0), mu.clamp(max=0.0)
    qc, pc = _one_minus_exp(mu), _one_minus_exp(lp)
    if mode == "binary_tv":  # π − μ = (1 − μ) − (1 − π) where one is near 1 (no rounding of 1 − ε), else e^lp − e^mu
        return torch.where(torch.maximum(lp, mu) > -math.log(2.0), pc - qc, torch.exp(lp) - torch.exp(mu)).abs()
    return torch.exp(mu) * (mu - lp) + torch.xlogy(qc, qc) - torch.xlogy(qc, pc)


def topk_divergence_reference(mode: str, count: torch.Tensor, rollout: torch.Tensor, trainer: torch.Tensor) -> torch.Tensor:
    """TRL's top-K divergence (``DPPOTrainer._compute_divergence_mask``, float64) of tokens ``[n]`` whose first
    ``count`` of K entries (``[n, K]`` log-probs of the engine's top-K ids: the engine's ``rollout``, the trainer's
    ``trainer``) are given: the K buckets and the rest, rest = max(1 − Σ, 1e-12); TV = ½ Σ|π − μ| over the buckets,
    KL(μ ‖ π) = Σ μ·log(μ/π) over them (0·log 0 = 0). NaN / +inf among a token's entries: +inf."""
    n, k = rollout.shape
    used = torch.arange(k).unsqueeze(0) < count.unsqueeze(1)
    bad = (used & (torch.isnan(rollout) | torch.isnan(trainer) | (rollout == math.inf) | (trainer == math.inf))).any(1)
    q = torch.where(used, torch.exp(rollout.clamp(max=0.0)), torch.zeros(()))
    p = torch.where(used, torch.exp(trainer.clamp(max=0.0)), torch.zeros(()))
    q, p = torch.where(torch.isnan(q), 0.0, q), torch.where(torch.isnan(p), 0.0, p)
    rest_q = (1.0 - q.sum(1)).clamp(min=1e-12)
    rest_p = (1.0 - p.sum(1)).clamp(min=1e-12)
    if mode == "topk_tv":
        out = 0.5 * ((p - q).abs().sum(1) + (rest_p - rest_q).abs())
    else:
        out = (torch.xlogy(q, q) - torch.xlogy(q, p)).sum(1) + rest_q * (rest_q.log() - rest_p.log())
    return torch.where(bad, math.inf, out)


def trust_region_keep_reference(tr, divergence: torch.Tensor, lp: torch.Tensor, mu: torch.Tensor,
                                adv: torch.Tensor) -> torch.Tensor:
    """DPPO's mask (Eq. 12; prime-rl's symmetric variant): drop where π rose above μ beyond delta_high (directional:
    only where A > 0) or fell below it beyond delta_low (directional: only where A ≤ 0); a null delta never drops."""
    lp, mu = lp.clamp(max=0.0), mu.clamp(max=0.0)
    hi = math.inf if tr.delta_high is None else tr.delta_high
    lo = math.inf if tr.delta_low is None else tr.delta_low
    up, down = (lp > mu) & (divergence > hi), (lp < mu) & (divergence > lo)
    if tr.direction.value == "directional":
        up, down = up & (adv > 0), down & (adv <= 0)
    return ~(up | down)


def m2po_dropped_reference(m2po, d: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """M2PO over the whole step (arXiv 2510.01161; ``d`` = clamp(old − rollout) of every valid token, ``adv`` their
    advantages): among the candidates (every token, or with ``clip_quadrants`` those with A > 0, d > 0 or A < 0,
    d < 0) remove the largest d² one at a time while the mean of the rest exceeds the bound; every candidate whose d²
    is at least the last removed one is dropped (ties go together)."""
    candidate = torch.ones_like(d, dtype=torch.bool)
    if m2po.scope.value == "clip_quadrants":
        candidate = ((adv > 0) & (d > 0)) | ((adv < 0) & (d < 0))
    remaining = sorted((d * d)[candidate].tolist(), reverse=True)
    last = None
    while remaining and sum(remaining) / len(remaining) > m2po.bound:
        last = remaining.pop(0)
    if last is None:
        return torch.zeros_like(candidate)
    return candidate & (d * d >= last)


def _zero_on_graph(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A float64 zero that depends on ``x`` (so it has a gradient, of 0), never reading masked entries."""
    return torch.where(valid, x, torch.zeros_like(x)).sum() * 0.0


class _ReferenceRow(dict):
    """One sequence's valid tokens (float64) and every per-token quantity of the step objective."""

    __getattr__ = dict.__getitem__


def _reference_rows(cfg, logprobs, old_logprobs, advantages, loss_mask, *, rollout_logprobs, ref_logprobs, entropy,
                    kl_logprobs, entropy_coef, topk=None):
    """The step-level quantities and, per non-empty row, the per-token quantities of the objective (float64,
    differentiable w.r.t. ``logprobs``, ``entropy`` and ``kl_logprobs``). Shared by the objective and the metrics."""
    lp_all = logprobs.double()
    valid = loss_mask != 0
    B = lp_all.shape[0]
    rc, clamp = cfg.rollout_correction, cfg.policy.log_ratio_clamp
    bypass = rc.bypass

    def rows(x):  # the valid tokens of every row, in float64
        return [None if x is None else x.double()[b][valid[b]] for b in range(B)]

    lps, rolls, refs, ents = rows(lp_all), rows(rollout_logprobs), rows(ref_logprobs), rows(entropy)
    kl_lps = lps if kl_logprobs is None else rows(kl_logprobs)
    bonus = cfg.entropy.bonus_coef if entropy_coef is None else entropy_coef
    vespo = cfg.policy.objective.value == "vespo"
    if bypass:
        olds = [r.detach() for r in rolls]
    elif old_logprobs is None:
        olds = [x.detach() for x in lps]
    else:
        olds = [x.detach() for x in rows(old_logprobs)]
    adv_full = advantages.double()
    advs = [(adv_full[b].expand(valid[b].sum()) if adv_full.dim() == 1 else adv_full[b][valid[b]]) for b in range(B)]
    # d = trainer - rollout per valid token (clamped)
    ds = [None] * B
    if rollout_logprobs is not None:
        ds = [_clamp_abs((lps[b].detach() if bypass else olds[b]) - rolls[b], clamp) for b in range(B)]

    # Step-level quantities over the whole batch.
    step = _ReferenceRow(valid=valid, lp_all=lp_all, bonus=bonus, skip=None, weight_mean=None, threshold=None)
    step["n_tokens"] = n_tokens = sum(int(valid[b].sum()) for b in range(B))
    step["nonempty"] = nonempty = [b for b in range(B) if valid[b].any()]
    step["n_seqs"] = B if cfg.aggregation.count_empty_sequences else len(nonempty)
    if cfg.mismatch.skip_threshold is not None:
        k3_sum = sum(float((torch.expm1(ds[b]) - ds[b]).sum()) for b in nonempty)
        step["skip"] = k3_sum / max(n_tokens, 1) > cfg.mismatch.skip_threshold
    raw_weights = weights = truncated = [None] * B
    if rc.weight_level is not None and not vespo:
        lvl = rc.weight_level.value
        raw_weights = [torch.exp(_level_log_ratio(lvl, ds[b], clamp)) if b in nonempty else None for b in range(B)]
        weights = truncated = [None if w is None else _clamp_range(w, rc.weight_min, rc.weight_max) for w in raw_weights]
        if rc.normalize_weights:
            if lvl == "token":
                mean = sum(float(weights[b].sum()) for b in nonempty) / max(n_tokens, 1)
            else:
                mean = sum(float(weights[b][0]) for b in nonempty) / max(len(nonempty), 1)
            step["weight_mean"] = mean
            if mean > 1e-8:
                weights = [None if w is None else w / mean for w in weights]
    threshold = None
    if cfg.entropy.top_quantile < 1.0 and nonempty:
        all_ent = torch.cat([ents[b].detach() for b in nonempty])
        step["threshold"] = threshold = torch.quantile(all_ent, 1.0 - cfg.entropy.top_quantile)
    m2po_drop = [None] * B
    if cfg.m2po.bound is not None and nonempty:  # over the whole step: d = old − rollout of every valid token
        d_all = torch.cat([_clamp_abs(olds[b] - rolls[b], clamp) for b in nonempty])
        dropped = m2po_dropped_reference(cfg.m2po, d_all, torch.cat([advs[b] for b in nonempty]))
        for b, part in zip(nonempty, dropped.split([lps[b].numel() for b in nonempty])):
            m2po_drop[b] = part
    tr_mode = cfg.trust_region.mode.value

    out = []
    for b in nonempty:
        lp, old, adv = lps[b], olds[b], advs[b]
        n = lp.numel()
        lr = _clamp_abs(lp - old, clamp)
        row = _ReferenceRow(b=b, n=n, lp=lp, adv=adv, lr=lr, d=ds[b], ent=ents[b], phi=None, kl=None,
                            raw_weight=raw_weights[b], truncated=truncated[b], weight=weights[b],
                            keep_rc=None, keep_opsm=None, keep_ent=None, keep_tr=None, keep_m2po=None)
        if vespo:
            p = cfg.policy
            log_w = _vespo_log_w(rc, lr, ds[b])
            row["phi"] = phi = vespo_phi_reference(log_w, adv, p.vespo_k_pos, p.vespo_lambda_pos, p.vespo_k_neg,
                                                   p.vespo_lambda_neg)
            row["ratio"] = torch.exp(log_w).detach()
            term = -phi.detach() * adv * lp
        else:
            term = _policy_term_reference(cfg.policy, lp, lr, adv)
            row.update(_policy_flags_reference(cfg.policy, lr, adv))
        if weights[b] is not None:
            term = term * weights[b]
        keep = torch.ones(n, dtype=torch.bool)
        if rc.reject_level is not None and not vespo:
            ratio = torch.exp(_level_log_ratio(rc.reject_level.value, ds[b], clamp))
            row["keep_rc"] = torch.ones(n, dtype=torch.bool)
            if rc.reject_min is not None:
                row["keep_rc"] &= ratio >= rc.reject_min
            if rc.reject_max is not None:
                row["keep_rc"] &= ratio <= rc.reject_max
            keep &= row.keep_rc
        if cfg.opsm.delta is not None:
            behaviour = rolls[b] if rollout_logprobs is not None else old
            drift = (behaviour - lp.detach()).mean()
            row["keep_opsm"] = ~((adv < 0) & (drift > cfg.opsm.delta))
            keep &= row.keep_opsm
        selected = torch.ones(n, dtype=torch.bool)
        if threshold is not None:
            row["keep_ent"] = selected = ents[b].detach() >= threshold
            keep &= selected
        row["keep_ent_or_all"] = selected
        if tr_mode != "none":  # π_θ (detached) against the rollout's μ
            if tr_mode.startswith("binary"):
                div = binary_divergence_reference(tr_mode, lp.detach(), rolls[b])
            else:
                counts, top_roll, top_train = topk
                v = valid[b]
                div = topk_divergence_reference(tr_mode, counts[b][v], top_roll[b][v].double(), top_train[b][v].double())
            row["keep_tr"] = trust_region_keep_reference(cfg.trust_region, div, lp.detach(), rolls[b], adv)
            keep &= row.keep_tr
        if m2po_drop[b] is not None:
            row["keep_m2po"] = ~m2po_drop[b]
            keep &= row.keep_m2po
        row["c"] = torch.where(keep, term, torch.zeros_like(term))
        reg = torch.zeros_like(row.c)
        row["reg_parts"] = []
        row["reg_sizes"] = []
        if refs[b] is not None:
            row["kl"] = _kl_reference(cfg.kl, kl_lps[b], refs[b], lr, clamp)
            row["kl_size"] = _kl_reference(cfg.kl, kl_lps[b].detach(), refs[b], lr.detach(), clamp, magnitude=True)
            if cfg.kl.coef != 0.0:
                row.reg_parts.append(cfg.kl.coef * row.kl)
                row.reg_sizes.append(cfg.kl.coef * row.kl_size)
                reg = reg + row.reg_parts[-1]
        if bonus != 0.0:
            ent = ents[b]
            if cfg.entropy.bonus_on_selected:
                ent = torch.where(selected, ent, torch.zeros_like(ent))
            row.reg_parts.append(-bonus * ent)
            row.reg_sizes.append(row.reg_parts[-1].detach().abs())
            reg = reg + row.reg_parts[-1]
        row["reg"] = reg
        out.append(row)
    return step, out


def _policy_flags_reference(p, lr: torch.Tensor, adv: torch.Tensor) -> dict:
    """The objective's ratio (the sequence ratio for gspo / gmpo) and which clips are active, per valid token."""
    objective = p.objective.value
    lo = -math.inf if p.eps_low is None else 1.0 - p.eps_low
    hi = math.inf if p.eps_high is None else 1.0 + p.eps_high
    lr = lr.detach()
    flags = {"ratio": torch.exp(lr), "clip_low": None, "clip_high": None, "clip_dual": None}
    if objective == "gmpo":
        flags["clip_low"] = (adv < 0) & (lr < (-math.inf if p.eps_low is None else -p.eps_low))
        flags["clip_high"] = (adv > 0) & (lr > (math.inf if p.eps_high is None else p.eps_high))
        upper = _clamp_range(lr, None, p.eps_high)
        lower = _clamp_range(lr, None if p.eps_low is None else -p.eps_low, None)
        flags["ratio"] = torch.exp(torch.where(adv > 0, upper, torch.where(adv < 0, lower, lr)).mean()).expand_as(lr)
    elif objective == "cispo":
        flags["clip_low"], flags["clip_high"] = flags["ratio"] < lo, flags["ratio"] > hi
    elif objective in ("ppo_clip", "gspo", "clip_cov"):
        r = flags["ratio"] if objective != "gspo" else torch.exp(lr.mean()).expand_as(lr)
        flags["ratio"] = r
        flags["clip_low"], flags["clip_high"] = (r < lo) & (adv < 0), (r > hi) & (adv > 0)
        if p.dual_clip_c is not None:
            term = _clipped_surrogate_reference(p, r, adv)[1]
            flags["clip_dual"] = (adv < 0) & (term > -adv * p.dual_clip_c)
    return flags


def grpo_objective_reference(
    cfg,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    kl_logprobs: torch.Tensor | None = None,
    entropy_coef: float | None = None,
    positive: torch.Tensor | None = None,
    magnitude: bool = False,
    topk: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The objective J of a whole step given as one padded batch ``[B, T]``, in float64.

    ``positive`` ``[B]``: positive examples for ``nll.positive_coef`` (VAPO: coef · mean over their valid tokens of
    −log π_θ).

    ``kl_logprobs``: the log-probs the KL is taken of (None: ``logprobs``); ``entropy_coef``: the bonus
    coefficient (None: ``entropy.bonus_coef``).

    ``magnitude``: return Σ |each per-token contribution| instead of their sum — the scale of the rounding
    error of any computation of J (a tolerance for inputs whose terms cancel).

    ``topk``: with a top-K trust region, ``(count [B, T], rollout [B, T, K], trainer [B, T, K])``: each position's
    first ``count`` entries are the engine's top-K log-probs and the trainer's at the same ids."""
    step, rows = _reference_rows(cfg, logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs=rollout_logprobs,
                                 ref_logprobs=ref_logprobs, entropy=entropy, kl_logprobs=kl_logprobs,
                                 entropy_coef=entropy_coef, topk=topk)
    return _objective_of_rows(cfg, step, rows, positive, magnitude)


def _objective_of_rows(cfg, step, rows, positive: torch.Tensor | None, magnitude: bool) -> torch.Tensor:
    """:func:`grpo_objective_reference` of the quantities :func:`_reference_rows` gave."""
    total = _zero_on_graph(step.lp_all, step.valid)
    if step.skip:
        return total
    n_tokens, n_seqs = step.n_tokens, step.n_seqs
    size = torch.abs if magnitude else (lambda x: x)
    nll_coef = cfg.nll.positive_coef
    if nll_coef != 0.0:
        pos_rows = [row for row in rows if bool(positive[row.b])]
        n_pos = sum(row.n for row in pos_rows)
        if n_pos:
            nll = sum(size(-row.lp).sum() for row in pos_rows) / n_pos
            total = total + (abs(nll_coef) if magnitude else nll_coef) * nll
    agg = cfg.aggregation
    reg_mode = agg.mode if agg.regularizer_mode is None else agg.regularizer_mode
    for row in rows:
        parts = [(row.c, agg.mode.value)] + [(x, reg_mode.value) for x in (row.reg_sizes if magnitude else [row.reg])]
        for x, mode in parts:
            x = size(x)
            if mode == "token_mean":
                total = total + x.sum() / n_tokens
            elif mode == "seq_mean_token_mean":
                total = total + x.sum() / row.n / n_seqs
            elif mode == "seq_mean_token_sum":
                total = total + x.sum() / n_seqs
            else:
                total = total + x.sum() / (n_seqs * agg.norm_constant)
    return total


def grpo_metrics_reference(
    cfg,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    kl_logprobs: torch.Tensor | None = None,
    entropy_coef: float | None = None,
    positive: torch.Tensor | None = None,
    topk: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> dict[str, tuple[float, float]]:
    """The step's metrics (docs/loss.md, "Metrics") of the inputs of :func:`grpo_objective_reference`, from their
    definitions in float64: name → (value, scale), ``scale`` the mean of |x| of a mean (the size of its rounding
    error; the value itself for the extremes and counts). Means over nothing are NaN, extremes over nothing ±inf.

    Not covered: clip_cov / kl_cov (``cov/selected_frac``)."""
    return grpo_reference(cfg, logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs=rollout_logprobs,
                          ref_logprobs=ref_logprobs, entropy=entropy, kl_logprobs=kl_logprobs,
                          entropy_coef=entropy_coef, positive=positive, topk=topk)[2]


def grpo_reference(
    cfg,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    kl_logprobs: torch.Tensor | None = None,
    entropy_coef: float | None = None,
    positive: torch.Tensor | None = None,
    topk: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, tuple[float, float]]]:
    """(:func:`grpo_objective_reference`, the same with ``magnitude=True``, :func:`grpo_metrics_reference`) of the
    same inputs, from one pass over the rows: J keeps its graph (differentiable as J alone is), the magnitude and
    the metrics have none. The same operations on the same values as the three calls: the same numbers."""
    args = dict(rollout_logprobs=rollout_logprobs, ref_logprobs=ref_logprobs, entropy=entropy,
                kl_logprobs=kl_logprobs, entropy_coef=entropy_coef, topk=topk)
    step, rows = _reference_rows(cfg, logprobs, old_logprobs, advantages, loss_mask, **args)
    j_graph = _objective_of_rows(cfg, step, rows, positive, False)
    with torch.no_grad():
        j = j_graph.detach()
        j_size = _objective_of_rows(cfg, step, rows, positive, True)
    out: dict[str, tuple[float, float]] = {"loss": (float(j), float(j_size)),
                                           "valid_tokens": (float(step.n_tokens), float(step.n_tokens))}
    # trained positions where any input is NaN / ±inf (the loss drops them; per-sequence advantages broadcast)
    bad = torch.zeros(loss_mask.shape, dtype=torch.bool, device=loss_mask.device)
    for x in (logprobs, old_logprobs, advantages, rollout_logprobs, ref_logprobs, entropy):
        if x is not None:
            bad = bad | ~torch.isfinite(x.detach() if x.shape == loss_mask.shape else x.detach()[:, None])
    dropped = float((bad & (loss_mask != 0)).sum())
    out["nonfinite_inputs"] = (dropped, dropped)

    def cat(name, where=None):
        values = [row[name].detach().double().expand(row.n) if where is None else
                  row[name].detach().double().expand(row.n)[row[where]] for row in rows]
        return torch.cat(values) if values else torch.zeros(0, dtype=torch.float64)

    def mean(name, values, sizes=None):
        values = values.double()
        if values.numel() == 0:
            out[name] = (math.nan, 0.0)
        else:
            out[name] = (float(values.mean()), float((values.abs() if sizes is None else sizes.double()).mean()))

    def stats(name, values):
        mean(f"{name}/mean", values)
        out[f"{name}/min"] = (float(values.min()) if values.numel() else math.inf,) * 2
        out[f"{name}/max"] = (float(values.max()) if values.numel() else -math.inf,) * 2

    def frac(name, keep_name):
        mean(name, (~cat(keep_name).bool()).double() if rows else torch.zeros(0))

    policy = [row.c.detach() for row in rows]
    mean("policy_loss", torch.cat(policy) if policy else torch.zeros(0))
    objective = cfg.policy.objective.value
    stats("ratio", cat("ratio"))
    if objective == "vespo":
        stats("vespo_phi", cat("phi"))
    else:
        for name in ("low", "high", "dual"):
            if rows and rows[0][f"clip_{name}"] is not None or not rows and _has_clip(cfg, name):
                mean(f"clip_frac/{name}", cat(f"clip_{name}").double() if rows else torch.zeros(0))
    rc = cfg.rollout_correction
    if rc.weight_level is not None and objective != "vespo":
        stats("is_weight/raw", cat("raw_weight"))
        stats("is_weight/truncated", cat("truncated"))
        if rc.normalize_weights:
            stats("is_weight/applied", cat("weight"))
    if rc.reject_level is not None and objective != "vespo":
        frac("rejected_frac/rollout", "keep_rc")
    if cfg.opsm.delta is not None:
        frac("rejected_frac/opsm", "keep_opsm")
    if cfg.entropy.top_quantile < 1.0:
        frac("rejected_frac/entropy", "keep_ent_or_all")
    if cfg.trust_region.mode.value != "none":
        frac("rejected_frac/trust_region", "keep_tr")
    if cfg.m2po.bound is not None:
        frac("rejected_frac/m2po", "keep_m2po")
    if rollout_logprobs is not None:
        d = cat("d")
        mean("mismatch/k1", -d)
        mean("mismatch/k3", torch.expm1(d) - d, torch.expm1(d).abs() + d.abs())
        mean("mismatch/chi2_token", torch.expm1(2.0 * d))
        seq_d = torch.stack([_clamp_abs(row.d.sum(), cfg.policy.log_ratio_clamp) for row in rows]) if rows \
            else torch.zeros(0, dtype=torch.float64)
        # Its size: 2 e^{2x} times the summed |d| — a sum of d's that cancels keeps their float32 rounding, which the
        # value's own (tiny) magnitude would not cover (the loss computes each d = log π − log μ in its dtype).
        seq_size = torch.stack([row.d.abs().sum() for row in rows]) if rows else torch.zeros(0, dtype=torch.float64)
        chi2_seq = torch.expm1(2.0 * seq_d)
        mean("mismatch/chi2_seq", chi2_seq, chi2_seq.abs() + 2.0 * (1.0 + chi2_seq) * seq_size)
    if cfg.mismatch.skip_threshold is not None:
        out["mismatch/skipped"] = (float(bool(step.skip)), 1.0)
    if ref_logprobs is not None:
        mean("kl", cat("kl"), cat("kl_size"))
    if cfg.nll.positive_coef != 0.0:
        mean("nll/positive", torch.cat([-row.lp.detach() for row in rows if bool(positive[row.b])] or
                                       [torch.zeros(0, dtype=torch.float64)]))
    if entropy is not None:
        mean("entropy", cat("ent"))
        if cfg.entropy.adaptive and cfg.entropy.top_quantile < 1.0:
            mean("entropy/selected", cat("ent", "keep_ent_or_all"))
    return j_graph, j_size, out


def _has_clip(cfg, name: str) -> bool:
    """Whether the objective reports ``clip_frac/<name>`` (for a step without a valid token)."""
    objective = cfg.policy.objective.value
    if name == "dual":
        return objective in ("ppo_clip", "gspo") and cfg.policy.dual_clip_c is not None
    return objective in ("ppo_clip", "gspo", "clip_cov", "cispo", "gmpo")


# ============================================================================================
# Peer references: the peers' loss code re-read and re-written in float64, one micro-batch = the whole step
# ============================================================================================
def trl_grpo_loss_reference(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    ref_per_token_logps: torch.Tensor | None = None,
    use_bias_correction_kl: bool = False,
    importance_sampling_level: str = "token",
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
    max_completion_length: int = 512,
    sampling_per_token_logps: torch.Tensor | None = None,
    vllm_importance_sampling_mode: str = "sequence_mask",
    vllm_importance_sampling_clip_min: float | None = None,
    vllm_importance_sampling_clip_max: float | None = 3.0,
    entropies: torch.Tensor | None = None,
    top_entropy_quantile: float = 1.0,
    entropy_coef: float = 0.0,
    off_policy_mask_threshold: float | None = None,
) -> torch.Tensor:
    """TRL ``GRPOTrainer._compute_loss`` (huggingface/trl f2cd577, trl/trainer/grpo_trainer.py; the vLLM IS
    ratio from ``_generate_and_score_completions``, VESPO's weight from ``get_gamma_weights``), one process, no
    gradient accumulation, in float64. ``sampling_per_token_logps`` given = vLLM with
    ``vllm_importance_sampling_correction``. Inputs must be finite everywhere (TRL multiplies by the mask).
    Differentiable w.r.t. ``per_token_logps`` and ``entropies``."""
    lp = per_token_logps.double()
    m = mask.double()
    adv = advantages.double().unsqueeze(1) if advantages.dim() == 1 else advantages.double()
    old = lp.detach() if old_per_token_logps is None else old_per_token_logps.double()
    eps_low, eps_high = epsilon, epsilon if epsilon_high is None else epsilon_high
    # vLLM importance sampling ratio (token_*: (B, T); sequence_*: (B, 1))
    is_ratio = None
    if sampling_per_token_logps is not None:
        diff = (old - sampling_per_token_logps.double()) * m
        if vllm_importance_sampling_mode.startswith("sequence"):
            diff = diff.sum(-1, keepdim=True)
        is_ratio = torch.exp(diff)
        lo = -math.inf if vllm_importance_sampling_clip_min is None else vllm_importance_sampling_clip_min
        hi = math.inf if vllm_importance_sampling_clip_max is None else vllm_importance_sampling_clip_max
        if vllm_importance_sampling_mode.endswith("truncate"):
            is_ratio = is_ratio.clamp(min=vllm_importance_sampling_clip_min, max=vllm_importance_sampling_clip_max)
        else:
            is_ratio = torch.where((is_ratio < lo) | (is_ratio > hi), torch.zeros_like(is_ratio), is_ratio)
    entropy_mask = None
    if top_entropy_quantile < 1.0:
        values = entropies.double()[mask.bool()].detach()
        threshold = torch.quantile(values, 1 - top_entropy_quantile)
        entropy_mask = ((entropies.double() * m) >= threshold) & mask.bool()
    off_policy_mask = None
    if off_policy_mask_threshold is not None:  # get_off_policy_mask: sampling log-probs, else old
        behaviour = old if sampling_per_token_logps is None else sampling_per_token_logps.double()
        seq_kl = ((behaviour - lp.detach()) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)
        off_policy_mask = ((adv >= 0) | (seq_kl <= off_policy_mask_threshold)).double()
    log_ratio = lp - old
    if importance_sampling_level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    if beta != 0.0:
        ref = ref_per_token_logps.double()
        per_token_kl = torch.exp(ref - lp) - (ref - lp) - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    if loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=eps_high).detach() * adv * lp
    elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    elif loss_type == "sapo":
        temps = torch.where(adv > 0, torch.full_like(adv, sapo_temperature_pos), torch.full_like(adv, sapo_temperature_neg))
        per_token_loss = -(torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps) * adv
    elif loss_type == "vespo":
        floor = math.log(1e-8)
        seq = (torch.clamp(log_ratio.detach(), -20.0, 20.0) * m).sum(-1, keepdim=True)
        if is_ratio is not None:
            seq = seq + torch.clamp(torch.log(is_ratio), floor, 20.0).sum(-1, keepdim=True)
        log_w_seq = torch.clamp(seq, floor, 20.0)
        phi = vespo_phi_reference(log_w_seq, adv.expand_as(log_w_seq) if adv.shape[1] == 1 else adv, *vespo)
        per_token_loss = -phi.detach() * adv * lp
    else:
        raise ValueError(loss_type)
    if off_policy_mask is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if is_ratio is not None and loss_type != "vespo":
        per_token_loss = per_token_loss * is_ratio
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * m).sum() / m.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * m).sum() / (per_token_loss.size(0) * max_completion_length)
    elif loss_type in ("cispo", "dapo", "vespo"):
        normalizer = m.sum().clamp(min=1.0)  # num_items_in_batch of one process, one micro-batch
        loss = (per_token_loss * m).sum() / normalizer
    else:  # luspo
        loss = (per_token_loss * m.sum(1, keepdim=True)).mean()
    if entropy_coef != 0.0:
        eff = m if entropy_mask is None else m * entropy_mask
        ent = entropies.double()
        if loss_type in ("cispo", "dapo", "vespo"):
            loss = loss - entropy_coef * (ent * eff).sum() / m.sum().clamp(min=1.0)
        else:
            loss = loss - entropy_coef * (ent * eff).sum() / eff.sum().clamp(min=1.0)
    return loss


def verl_actor_loss_reference(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_mode: str = "vanilla",
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    ref_log_prob: torch.Tensor | None = None,
    kl_loss_coef: float = 0.0,
    kl_loss_type: str = "low_var_kl",
    entropy: torch.Tensor | None = None,
    entropy_coeff: float = 0.0,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
    selection_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """verl's actor loss (volcengine/verl b178a3c, verl/trainer/ppo/core_algos.py ``compute_policy_loss_vanilla``
    / ``compute_policy_loss_gspo`` / ``compute_policy_loss_clip_cov`` / ``compute_policy_loss_kl_cov``,
    ``agg_loss``, ``kl_penalty_forward``; the engine path's global counts: every row of the batch counted, one
    mini-batch = the step): pg_loss − entropy_coeff·entropy + kl_coef·kl, each aggregated (gspo's policy term
    always with seq-mean-token-mean), in float64. ``advantages`` per token.

    clip_cov draws ``torch.randperm`` over its candidates; here that permutation is the candidates (in
    ``torch.nonzero`` order) sorted by ``selection_keys`` (one key per position, iid uniform: a uniform random
    permutation), so a test can replay the keys the code under test drew."""
    lp, old = log_prob.double(), old_log_prob.double()
    mask = response_mask.double()
    adv = advantages.double()
    n_tokens, n_rows = mask.sum(), mask.shape[0]

    def agg(mat: torch.Tensor, mode: str) -> torch.Tensor:
        if mode == "token-mean":
            return (mat * mask).sum() / n_tokens
        row_tokens = mask.sum(-1)
        if mode == "seq-mean-token-mean":
            seq = (mat * mask).sum(-1) / (row_tokens + 1e-8)
            return (seq * (row_tokens > 0)).sum() / n_rows
        if mode == "seq-mean-token-sum":
            return ((mat * mask).sum(-1) * (row_tokens > 0)).sum() / n_rows
        raise ValueError(mode)

    neg_kl = lp - old
    if loss_mode == "vanilla":
        ratio = torch.exp(torch.clamp(neg_kl, -20.0, 20.0))
        l1 = -adv * ratio
        l2 = -adv * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
        clip1 = torch.maximum(l1, l2)
        pg = torch.where(adv < 0, torch.min(-adv * clip_ratio_c, clip1), clip1)
        if rollout_is_weights is not None:
            pg = pg * rollout_is_weights.double()
        pg_loss = agg(pg, loss_agg_mode)
    elif loss_mode == "gspo":
        seq = (neg_kl * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        log_s = torch.clamp(lp - lp.detach() + seq.detach().unsqueeze(-1), max=10.0)
        s = torch.exp(log_s)
        pg = torch.maximum(-adv * s, -adv * torch.clamp(s, 1 - clip_ratio_low, 1 + clip_ratio_high))
        if rollout_is_weights is not None:
            pg = pg * rollout_is_weights.double()
        pg_loss = agg(pg, "seq-mean-token-mean")
    elif loss_mode == "clip_cov":
        valid = mask > 0
        ratio = torch.exp(neg_kl)
        l1 = -adv * ratio
        l2 = -adv * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
        clip_by_origin = (l2 > l1) & valid
        lp_d = lp.detach()
        cov = (adv - (adv * mask).sum() / (mask.sum() + 1e-8)) * (lp_d - (lp_d * mask).sum() / (mask.sum() + 1e-8))
        cov = torch.where(~valid | clip_by_origin, torch.full_like(cov, -math.inf), cov)
        clip_num = max(int(clip_cov_ratio * mask.sum().item()), 1)
        cand = (cov < clip_cov_ub) & (cov > clip_cov_lb) & valid
        idx = torch.nonzero(cand)
        perm = torch.argsort(selection_keys.double()[cand])  # verl: torch.randperm(len(idx))
        idx = idx[perm[: min(clip_num, len(idx))]]
        corr = torch.ones_like(adv)
        corr[idx[:, 0], idx[:, 1]] = 0
        pg = torch.maximum(l1, l2) * corr
        if rollout_is_weights is not None:
            pg = pg * rollout_is_weights.double()
        pg_loss = agg(pg, loss_agg_mode)
    elif loss_mode == "kl_cov":
        ratio = torch.exp(neg_kl)
        l1 = -adv * ratio
        l_kl = -adv * ratio + ppo_kl_coef * neg_kl.abs()
        valid = (mask > 0).reshape(-1)
        valid_idx = torch.nonzero(valid, as_tuple=True)[0]
        a_v, lp_v = adv.detach().reshape(-1)[valid], lp.detach().reshape(-1)[valid]
        selected = torch.zeros_like(valid)
        if len(a_v) > 0:
            cov = (a_v - a_v.mean()) * (lp_v - lp_v.mean())
            k = max(1, int(len(cov) * kl_cov_ratio))
            selected[valid_idx[torch.topk(cov, k, largest=True).indices]] = True
        pg = torch.where(selected.reshape(adv.shape), l_kl, l1)
        if rollout_is_weights is not None:
            pg = pg * rollout_is_weights.double()
        pg_loss = agg(pg, loss_agg_mode)
    else:
        raise ValueError(loss_mode)
    loss = pg_loss
    if entropy_coeff != 0.0:
        loss = loss - entropy_coeff * agg(entropy.double(), loss_agg_mode)
    if kl_loss_coef != 0.0:
        ref = ref_log_prob.double()
        if kl_loss_type in ("kl", "k1"):
            kld = lp - ref
        elif kl_loss_type in ("mse", "k2"):
            kld = 0.5 * (lp - ref).square()
        else:  # low_var_kl / k3
            x = torch.clamp(ref - lp, -20, 20)
            kld = torch.clamp(torch.exp(x) - x - 1, -10, 10)
        loss = loss + kl_loss_coef * agg(kld, loss_agg_mode)
    return loss


def nemo_rl_clipped_pg_loss_reference(
    curr_logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    reference_policy_logprobs: torch.Tensor | None = None,
    curr_logprobs_unfiltered: torch.Tensor | None = None,
    ratio_clip_min: float = 0.2,
    ratio_clip_max: float = 0.2,
    ratio_clip_c: float | None = None,
    reference_policy_kl_penalty: float = 0.0,
    reference_policy_kl_type: str = "k3",
    kl_input_clamp_value: float | None = 20.0,
    kl_output_clamp_value: float | None = 10.0,
    positive_example_nll_weight: float = 0.0,
    rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """NeMo-RL ``ClippedPGLossFn`` (NVIDIA-NeMo/RL 7ea279a, nemo_rl/algorithms/loss/loss_functions.py, and
    ``calculate_kl`` in nemo_rl/algorithms/utils.py) with ``use_on_policy_kl_approximation: false`` (the KL
    weighted by exp(lp − stopgrad lp), detached where the input clamp binds), ``token_level_loss: true``, no IS
    correction, one micro-batch = the step, in float64. ``advantages`` per token; ``mask`` = token_mask · sample_mask."""
    lp, prev = curr_logprobs.double(), prev_logprobs.double()
    m = mask.double()
    adv = advantages.double()
    n_tokens = m.sum()

    def reduce(x: torch.Tensor) -> torch.Tensor:  # masked_mean with global_normalization_factor = valid tokens
        return (x * m).sum() / n_tokens

    ratios = torch.exp(lp - prev)
    clipped = ratios.clamp(1.0 - ratio_clip_min, 1.0 + ratio_clip_max)
    clip_loss = torch.max(-adv * ratios, -adv * clipped)
    if ratio_clip_c is not None:
        clip_loss = torch.where(adv < 0, torch.min(clip_loss, -adv * ratio_clip_c), clip_loss)
    loss = reduce(clip_loss)
    if reference_policy_kl_penalty != 0.0:
        unf = lp if curr_logprobs_unfiltered is None else curr_logprobs_unfiltered.double()
        weights = torch.exp(unf - unf.detach())
        logr = reference_policy_logprobs.double() - unf
        if kl_input_clamp_value is not None:
            clamped = logr.clamp(-kl_input_clamp_value, kl_input_clamp_value)
            weights = torch.where(logr == clamped, weights, weights.detach())
            logr = clamped
        kl = {"k1": -logr, "k2": 0.5 * logr.square(), "k3": torch.exp(logr) - 1 - logr}[reference_policy_kl_type]
        kl = kl * weights
        if kl_output_clamp_value is not None:
            kl = kl.clamp(-kl_output_clamp_value, kl_output_clamp_value)
        loss = loss + reference_policy_kl_penalty * reduce(kl)
    if positive_example_nll_weight > 0 and rewards is not None:  # VAPO
        correct_mask = m * (rewards > 0).double().unsqueeze(-1)
        correct_valid_toks = correct_mask.sum()
        if correct_valid_toks > 0:
            loss = loss + positive_example_nll_weight * (-lp * correct_mask).sum() / correct_valid_toks
    return loss


# --------------------------------------------------------------------------------------------
# Peer references: DPPO's divergence trust regions and M2PO (one micro-batch = the whole step, float64)
# --------------------------------------------------------------------------------------------
def trl_dppo_loss_reference(
    per_token_logps: torch.Tensor,
    sampling_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    divergence_type: str = "binary_tv",
    epsilon: float = 0.15,
    epsilon_high: float = 0.15,
    clip_ratio_c: float = 20.0,
    current_topk_logps: torch.Tensor | None = None,
    sampling_topk_logps: torch.Tensor | None = None,
) -> torch.Tensor:
    """TRL's ``DPPOTrainer`` (huggingface/trl trl/experimental/dppo/dppo_trainer.py at ef1b500^:
    ``_compute_divergence_mask`` and ``_compute_loss`` with beta = 0, one process: ``num_items_in_batch`` = the
    completion tokens): −A · stopgrad(exp(min(log π − log μ, log C))) · M · log π, Σ over the mask / its count.
    ``advantages`` ``[B]`` or per token; top-K log-probs ``[B, T, K]`` (every position holds K)."""
    lp, mu = per_token_logps.double(), sampling_per_token_logps.double()
    adv = advantages.double()
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    mask = completion_mask.double()
    log_ratio = lp - mu
    ratio = torch.exp(log_ratio.clamp(max=math.log(clip_ratio_c))).detach()
    with torch.no_grad():
        prob, sampling_prob = torch.exp(lp), torch.exp(mu)
        if divergence_type == "binary_tv":
            divergence = (prob - sampling_prob).abs()
        elif divergence_type == "binary_kl":
            divergence = sampling_prob * (mu - lp) + (1 - sampling_prob) * (
                torch.log1p(-sampling_prob.clamp(max=1 - 1e-7)) - torch.log1p(-prob.clamp(max=1 - 1e-7)))
        else:
            cur, roll = current_topk_logps.double(), sampling_topk_logps.double()
            cur_p, roll_p = torch.exp(cur), torch.exp(roll)
            roll_rest = (1.0 - roll_p.sum(dim=-1)).clamp(min=1e-12)
            cur_rest = (1.0 - cur_p.sum(dim=-1)).clamp(min=1e-12)
            if divergence_type == "topk_tv":
                divergence = ((cur_p - roll_p).abs().sum(dim=-1) + (cur_rest - roll_rest).abs()) / 2.0
            else:
                divergence = (roll_p * (roll - cur)).sum(dim=-1) + roll_rest * (roll_rest.log() - cur_rest.log())
        invalid_pos = (divergence > epsilon_high) & (prob > sampling_prob)
        invalid_neg = (divergence > epsilon) & (prob < sampling_prob)
        keep = torch.where(adv > 0, ~invalid_pos, ~invalid_neg).double() * mask
    per_token_loss = -adv * ratio * keep * lp
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def verl_dppo_loss_reference(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_mode: str = "dppo_tv",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 20.0,
) -> torch.Tensor:
    """verl's ``compute_policy_loss_dppo_tv`` / ``_dppo_kl`` (verl-project/verl 1dda039
    verl/trainer/ppo/core_algos.py, loss_agg_mode token-mean, no rollout IS weights): −A · stopgrad(min(exp(clamp(ℓ,
    ±20)), C)) · log π · valid, ℓ = log π − old_log_prob (μ: verl's old log-probs; the rollout's in bypass mode)."""
    lp, old = log_prob.double(), old_log_prob.double()
    adv, mask = advantages.double(), response_mask.double()
    ratio = torch.exp((lp - old).clamp(-20.0, 20.0))
    truncated = ratio.clamp(max=clip_ratio_c).detach()
    prob, old_prob = torch.exp(lp), torch.exp(old)
    if loss_mode == "dppo_tv":
        valid_pos = (prob - old_prob) <= clip_ratio_high
        valid_neg = (prob - old_prob) >= -clip_ratio_low
    else:
        binary_kl = old_prob * (old - lp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        valid_pos = (binary_kl <= clip_ratio_high) | (prob <= old_prob)
        valid_neg = (binary_kl <= clip_ratio_low) | (prob >= old_prob)
    valid = torch.where(adv > 0, valid_pos, valid_neg).detach().double()
    pg_losses = -adv * truncated * lp * valid
    return (pg_losses * mask).sum() / mask.sum()


def prime_rl_default_loss_reference(
    trainer_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    dppo_mask_low: float = 0.2,
    dppo_mask_high: float = 0.2,
    kl_tau: float = 1e-3,
    adv_tau: float = 1.0,
    symmetric: bool = False,
) -> torch.Tensor:
    """prime-rl's ``default_loss_fn`` (PrimeIntellect-ai/prime-rl 559b447 src/prime_rl/trainer/rl/loss.py), Σ over the
    samples / the global loss-token count (``compute_loss``): −keep·A·e^ℓ + kl_tau·ℓ², ℓ = trainer − inference, keep
    DPPO's advantage-conditioned probability-difference mask. ``symmetric``: #2434's variant (refs/pull/2434/head):
    the mask whatever the advantage (π − μ outside [−low, high]), no KL term."""
    lp, mu = trainer_logprobs.double(), inference_logprobs.double()
    adv, mask = advantages.double(), loss_mask.bool()
    log_ratio = lp - mu
    ratio = torch.exp(log_ratio)
    diff = (torch.exp(lp) - torch.exp(mu)).detach()
    high, low = diff > dppo_mask_high, diff < -dppo_mask_low
    masked = (high | low) if symmetric else torch.where(adv > 0, high, low)
    keep = mask & ~masked
    per_token = -(keep * adv_tau * adv * ratio)
    if not symmetric:
        per_token = per_token + kl_tau * (mask * log_ratio**2)
    return per_token.sum() / mask.sum()


def open_instruct_dppo_mask_reference(
    new_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    divergence_type: str,
    divergence_threshold: float,
    *,
    variant: str = "1745",
) -> torch.Tensor:
    """open-instruct's DPPO mask M_t (paper Eq. 12), float 0 / 1: ``compute_binary_divergence`` and ``compute_dppo_mask``
    of allenai/open-instruct refs/pull/1745 (fp32, log-probs clamped to [−30, 0], probabilities to [1e-6, 1 − 1e-6] for
    the KL; drop where A > 0 and ρ > 1, or A < 0 and ρ < 1, with the divergence above δ); ``variant="1790"``: #1790's
    divergence (float64, probabilities clamped to [eps, 1 − eps], the KL clamped ≥ 0). #1755 moves by
    sign(log π − log μ)·A > 0: the same tokens."""
    mask = response_mask.bool()
    with torch.no_grad():
        if variant == "1745":
            b, p = behavior_logprobs.float(), new_logprobs.float()
            mu, pi = torch.exp(b.clamp(min=-30.0, max=0.0)), torch.exp(p.clamp(min=-30.0, max=0.0))
            eps = 1e-6
        else:
            b, p = behavior_logprobs.double().clamp(max=0.0), new_logprobs.double().clamp(max=0.0)
            eps = torch.finfo(torch.float64).eps
            mu, pi = torch.exp(b).clamp(eps, 1.0 - eps), torch.exp(p).clamp(eps, 1.0 - eps)
        if divergence_type == "tv":
            divergence = (mu - pi).abs()
        else:
            mc, pc = (mu.clamp(eps, 1.0 - eps), pi.clamp(eps, 1.0 - eps)) if variant == "1745" else (mu, pi)
            divergence = mc * (mc.log() - pc.log()) + (1.0 - mc) * (torch.log1p(-mc) - torch.log1p(-pc))
            if variant != "1745":
                divergence = divergence.clamp_min(0.0)
        divergence = torch.where(mask, divergence, torch.zeros_like(divergence)).double()
        ratio = torch.exp(new_logprobs.double() - behavior_logprobs.double())
        outside = divergence > divergence_threshold
        bad = ((advantages > 0) & (ratio > 1.0) & outside) | ((advantages < 0) & (ratio < 1.0) & outside)
        return (~bad & mask).double()


def areal_m2po_mask_reference(old_logp: torch.Tensor, prox_logp: torch.Tensor, loss_mask: torch.Tensor,
                              m2_threshold: float) -> torch.Tensor:
    """AReaL's ``_apply_m2po_masking`` / ``_get_m2po_loss_mask`` (inclusionAI/AReaL 4aef98d areal/trainer/ppo/actor.py):
    δ = old_logp (behaviour) − prox_logp over the loss mask; sorted descending, the first k masked, k the first index
    whose suffix mean is < the threshold (n − 1 when none is). Returns the new loss mask (bool)."""
    delta = old_logp.double() - prox_logp.double()
    m2 = delta * delta
    flat = loss_mask.bool().reshape(-1)
    selected = m2.reshape(-1)[flat]
    if selected.numel() == 0:
        return loss_mask.bool()
    sorted_m2, indices = torch.sort(selected, descending=True)
    n = sorted_m2.numel()
    suffix = sorted_m2.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=sorted_m2.dtype)
    below = torch.where(suffix < m2_threshold)[0]
    num_to_mask = int(below[0]) if len(below) > 0 else n - 1
    keep_sorted = torch.ones(n, dtype=torch.bool)
    keep_sorted[:num_to_mask] = False
    out = torch.zeros_like(flat)
    out[flat] = keep_sorted[torch.argsort(indices)]
    return out.view_as(loss_mask)


def areal_m2po_loss_reference(logprobs: torch.Tensor, prox_logp: torch.Tensor, old_logp: torch.Tensor,
                              advantages: torch.Tensor, loss_mask: torch.Tensor, *, m2_threshold: float = 0.04,
                              eps_clip: float = 1e9, rs_upper: float = 5.0) -> tuple[torch.Tensor, torch.Tensor]:
    """AReaL's ``grpo_loss_fn`` with M2PO and the decoupled ``ppo_actor_loss_fn`` (areal/utils/functional/functional.py
    at 4aef98d; rejection sampling: metric ratio, token level, mask above ``rs_upper``): the loss mask after M2PO
    (:func:`areal_m2po_mask_reference`; the denominator is its count), r = π_θ/π_prox clipped to 1 ± ``eps_clip``,
    the behaviour weight π_prox/π_behave (``old_logp``) on the tokens rejection sampling keeps. One micro-batch.
    Returns (loss, the mask after M2PO)."""
    mask = areal_m2po_mask_reference(old_logp, prox_logp, loss_mask, m2_threshold)
    count = mask.sum().clamp(min=1)
    lp, prox, adv = logprobs.double(), prox_logp.double(), advantages.double()
    log_behave = prox - old_logp.double()
    behave_weight = torch.exp(torch.where(torch.isfinite(log_behave), log_behave, 0.0))
    kept = mask & (behave_weight <= rs_upper)
    ratio = torch.where(kept, torch.exp(lp - prox), 0.0)
    pg = torch.max(-adv * ratio, -adv * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip)) * behave_weight
    return torch.where(kept, pg, 0.0).sum() / count, mask


def ms_swift_m2po_loss_reference(per_token_logps: torch.Tensor, rollout_per_token_logps: torch.Tensor,
                                 advantages: torch.Tensor, completion_mask: torch.Tensor,
                                 m2_threshold: float = 0.04) -> tuple[torch.Tensor, torch.Tensor]:
    """ms-swift's ``loss_type="m2po"`` (modelscope/ms-swift refs/pull/9965 swift/rl_core/m2po.py, one process; its
    GRPO trainer divides by ``num_items_in_batch``): ℓ = log π − log μ; candidates A > 0, ℓ > 0 or A < 0, ℓ < 0; the
    ascending prefix of their ℓ² with mean ≤ the threshold kept; loss −M · exp(ℓ) · A (the value of ℓ clamped to ±20),
    Σ over the completion mask / its count. Returns (loss, the M2PO mask)."""
    lp, mu = per_token_logps.double(), rollout_per_token_logps.double()
    adv, valid = advantages.double(), completion_mask.bool()
    log_ratio = lp - mu
    with torch.no_grad():
        lr = log_ratio.detach()
        trust = valid & (((adv > 0) & (lr > 0)) | ((adv < 0) & (lr < 0)))
        index = torch.nonzero(trust.reshape(-1), as_tuple=False).squeeze(-1)
        values = lr.square().reshape(-1)[index]
        keep = torch.ones(values.numel(), dtype=torch.bool)
        if values.numel():
            sorted_values, order = torch.sort(values)
            means = sorted_values.cumsum(0) / torch.arange(1, values.numel() + 1, dtype=sorted_values.dtype)
            keep_count = int((means <= m2_threshold).sum())
            keep.zero_()
            keep[order[:keep_count]] = True
        final = valid.clone()
        final.reshape(-1)[index] = keep
    stable = log_ratio + (log_ratio.clamp(-20, 20) - log_ratio).detach()
    per_token = torch.where(final, -torch.exp(stable) * adv, torch.zeros_like(adv))
    return (per_token * completion_mask.double()).sum() / completion_mask.double().sum(), final


# --------------------------------------------------------------------------------------------
# A rollout's sampling filter replayed (mp_grpo.ops.sampling_filter), vLLM's convention
# --------------------------------------------------------------------------------------------
def _per_row_param(value, rows: int, dtype: torch.dtype) -> torch.Tensor | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).to(dtype)
    return torch.full((rows,), value, dtype=dtype)


def sampling_filter_keep_reference(
    logits: torch.Tensor, *, top_k=None, top_p=None, min_p=None, temperature: float = 1.0
) -> torch.Tensor:
    """``[..., V]`` bool: the tokens vLLM's sampler may draw, in float64 from the definitions.

    Order temperature, min-p, top-k, top-p. min-p keeps z_j - max z >= log(min_p); top-k keeps
    z_j >= the k-th largest (ties kept; k <= 0 or k >= V: off); top-p, on the distribution left,
    keeps j iff the mass of tokens with a strictly larger logit is < p (a tie group is kept whole;
    p >= 1: off). Per-row parameters may be tensors of ``logits.shape[:-1]``.
    """
    shape = logits.shape
    z = logits.double().reshape(-1, shape[-1]) / temperature
    rows, vocab = z.shape
    keep = torch.ones_like(z, dtype=torch.bool)
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float64)
    z_max = z.max(dim=-1, keepdim=True).values
    if (mp := _per_row_param(min_p, rows, torch.float64)) is not None:
        keep &= (z - z_max) >= torch.log(mp).unsqueeze(1)
    if (k := _per_row_param(top_k, rows, torch.int64)) is not None:
        active = (k > 0) & (k < vocab)
        ordered = torch.where(keep, z, neg_inf).sort(dim=-1, descending=True).values
        kth = ordered.gather(1, (k.clamp(1, vocab) - 1).unsqueeze(1))
        keep &= ~active.unsqueeze(1) | (z >= kth)
    if (p := _per_row_param(top_p, rows, torch.float64)) is not None:
        zk = torch.where(keep, z, neg_inf)
        prob = torch.softmax(zk, dim=-1)
        # Mass of the tokens with a strictly larger logit: in descending order, the sum of the
        # probabilities before the first member of j's tie group (count of larger logits = V minus
        # the count of logits <= z_j).
        ascending = zk.sort(dim=-1).values
        n_larger = vocab - torch.searchsorted(ascending, zk, right=True)
        desc_prob = prob.gather(1, zk.sort(dim=-1, descending=True).indices)
        mass_before = torch.cat([torch.zeros(rows, 1, dtype=torch.float64), desc_prob.cumsum(-1)], dim=-1)
        mass_above = mass_before.gather(1, n_larger)
        keep &= ~(p < 1).unsqueeze(1) | (mass_above < p.unsqueeze(1))
    return keep.reshape(shape)


def filtered_logprobs_reference(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    top_k=None,
    top_p=None,
    min_p=None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logprobs_reference`` of the filtered, renormalized distribution (``sampling_filter_keep_reference``,
    or the given ``keep`` mask of ``logits.shape``: a kept set checked separately).

    A target outside the kept set gets log-prob -inf, detached (no gradient flows from it).
    """
    if keep is None:
        keep = sampling_filter_keep_reference(logits.detach(), top_k=top_k, top_p=top_p, min_p=min_p,
                                              temperature=temperature)
    masked = torch.where(keep, logits.double(), torch.tensor(float("-inf"), dtype=torch.float64))
    logprobs, entropy = logprobs_reference(masked, target, temperature=temperature, ignore_index=ignore_index)
    valid = target != ignore_index
    safe_target = torch.where(valid, target, torch.zeros_like(target))
    target_kept = keep.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1) | ~valid
    logprobs = torch.where(target_kept, logprobs, torch.tensor(float("-inf"), dtype=torch.float64))
    return logprobs, entropy


# --------------------------------------------------------------------------------------------
# MoE router losses (megatron-core's TopKRouter, softmax scores)
# --------------------------------------------------------------------------------------------
def switch_load_balancing_reference(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """Switch Transformer's load-balancing loss of one batch of router logits ``[T, E]``, coefficient-free:
    ``E · Σ_i f_i · P_i`` with ``f_i`` = (tokens whose top-k experts include i) / (T·k) — a count, no
    gradient — and ``P_i`` = the mean softmax score of expert i. Float64, differentiable through ``P``."""
    scores = torch.softmax(logits.double(), dim=-1)
    num_tokens, num_experts = scores.shape
    chosen = scores.detach().topk(topk, dim=-1).indices.reshape(-1)
    f = torch.zeros(num_experts, dtype=torch.float64).index_add_(0, chosen, torch.ones_like(chosen, dtype=torch.float64))
    f = f / (num_tokens * topk)
    return num_experts * (f * scores.mean(dim=0)).sum()


def router_z_loss_reference(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss of logits ``[T, E]``, coefficient-free: mean over tokens of logsumexp(logits)²."""
    return torch.logsumexp(logits.double(), dim=-1).square().mean()


# --------------------------------------------------------------------------------------------
# A captured support replayed (mp_grpo.ops.captured_support), the log-probs at top-K ids (mp_grpo.ops.top_k_logprobs)
# --------------------------------------------------------------------------------------------
def csr_lists(indptr: torch.Tensor, ids: torch.Tensor) -> list[list[int]]:
    """Each token's ids of a CSR (``indptr`` [T + 1], ``ids`` [nnz]) as a Python list."""
    bounds = indptr.tolist()
    values = ids.tolist()
    return [values[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]


def support_keep_reference(indptr: torch.Tensor, ids: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``shape`` (``[..., V]``) bool: token i keeps the ids of its support, every id where its support is empty."""
    vocab = shape[-1]
    rows = csr_lists(indptr, ids)
    keep = torch.zeros(len(rows), vocab, dtype=torch.bool)
    for i, row in enumerate(rows):
        if row:
            keep[i, row] = True
        else:
            keep[i] = True
    return keep.reshape(shape)


def support_logprobs_reference(
    logits: torch.Tensor, target: torch.Tensor, indptr: torch.Tensor, ids: torch.Tensor, *,
    temperature: float = 1.0, ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-prob, entropy)`` in float64 of each token's distribution renormalized over its captured support: the
    log-softmax of ``logits / T`` over the support's ids (the whole vocabulary for a token with none); a target outside
    its support gets -inf (no gradient). Differentiable w.r.t. ``logits``."""
    keep = support_keep_reference(indptr, ids, logits.shape)
    return filtered_logprobs_reference(logits, target, temperature=temperature, ignore_index=ignore_index, keep=keep)


def logprobs_at_ids_reference(
    logits: torch.Tensor, indptr: torch.Tensor, ids: torch.Tensor, *, temperature: float = 1.0,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[nnz]`` float64: each token's log-softmax of ``logits / T`` (``[..., V]``) at its ids (CSR ``indptr``,
    ``ids``), normalized over ``keep`` (``logits.shape`` bool; None: the whole vocabulary) and -inf outside it."""
    z = logits.detach().double().reshape(-1, logits.shape[-1]) / temperature
    if keep is not None:
        z = torch.where(keep.reshape(z.shape), z, torch.tensor(float("-inf"), dtype=torch.float64))
    logp = torch.log_softmax(z, dim=-1)
    out = [logp[i, row] for i, row in enumerate(csr_lists(indptr, ids))]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)
