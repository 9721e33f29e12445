"""Plain float64 references, written for reading, not speed. Tests and benchmarks import them.

Nothing here calls mp_grpo: every formula is spelled out from its definition.
"""

from __future__ import annotations

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


def linear_logprobs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    logits_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logprobs_reference(hidden @ weight.T, ...)`` in float64, differentiable w.r.t. both inputs.

    ``weight`` is the *full* ``[V, H]`` output layer. With ``logits_dtype``, the logits and the
    gradient w.r.t. them are rounded to that dtype — as any op that computes the logits in it must
    (``vocab_parallel_logprobs(hidden @ weight.T)`` does too); everything else stays exact.
    """
    logits = hidden.double() @ weight.double().T
    if logits_dtype is not None:
        logits = _RoundTrip.apply(logits, logits_dtype)
    return logprobs_reference(logits, target, temperature=temperature, ignore_index=ignore_index)


# ============================================================================================
# GRPO-family loss (mp_grpo.loss) — float64 reference of the whole step's objective
# ============================================================================================
# Written row by row from the definitions in docs/loss.md, for padded [B, T] inputs. It reads the
# LossConfig's attributes (enum members are compared by their string value) and calls nothing of
# mp_grpo. Differentiable w.r.t. `logprobs` and `entropy`.
def _clamp_abs(x: torch.Tensor, bound: float | None) -> torch.Tensor:
    return x if bound is None else x.clamp(-bound, bound)


def _clamp_range(x: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    if low is not None:
        x = torch.maximum(x, torch.full_like(x, low))
    if high is not None:
        x = torch.minimum(x, torch.full_like(x, high))
    return x


def _level_log_ratio(level: str, d: torch.Tensor, clamp: float | None) -> torch.Tensor:
    """Log IS ratio of one sequence's valid tokens `d` at `level` (token: per token; else one value)."""
    if level == "token":
        return d
    if level == "sequence":
        return _clamp_abs(d.sum(), clamp).expand_as(d)
    return d.mean().expand_as(d)  # geometric


def _policy_term_reference(p, lp: torch.Tensor, lr: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """Per-token surrogate of one sequence (its valid tokens only)."""
    objective = p.objective.value
    lo = None if p.eps_low is None else 1.0 - p.eps_low
    hi = None if p.eps_high is None else 1.0 + p.eps_high
    if objective in ("ppo_clip", "gspo"):
        r = torch.exp(lr) if objective == "ppo_clip" else torch.exp(lr.mean()).expand_as(lr)
        r1 = r if p.delta is None else torch.minimum(r, torch.full_like(r, p.delta))
        term = -torch.min(r1 * adv, _clamp_range(r, lo, hi) * adv)
        if p.dual_clip_c is not None:
            term = torch.where(adv < 0, torch.min(term, -adv * p.dual_clip_c), term)
        return term
    if objective == "cispo":
        return -_clamp_range(torch.exp(lr), lo, hi).detach() * adv * lp
    if objective == "sapo":
        tau = torch.where(adv > 0, torch.full_like(adv, p.sapo_tau_pos), torch.full_like(adv, p.sapo_tau_neg))
        return -(4.0 / tau) * torch.sigmoid(tau * (torch.exp(lr) - 1.0)) * adv
    if objective == "gmpo":
        upper = lr if p.eps_high is None else torch.minimum(lr, torch.full_like(lr, p.eps_high))
        lower = lr if p.eps_low is None else torch.maximum(lr, torch.full_like(lr, -p.eps_low))
        clipped = torch.where(adv > 0, upper, torch.where(adv < 0, lower, lr))
        return -adv * torch.exp(clipped.mean())
    return -adv * lp  # reinforce


def _kl_reference(k, lp: torch.Tensor, ref: torch.Tensor, lr: torch.Tensor) -> torch.Tensor:
    x = _clamp_abs(ref - lp, k.input_clamp)
    k3 = torch.exp(x) - x - 1.0
    k2 = 0.5 * x * x
    kl = {"k1": -x, "k2": k2, "k3": k3}[k.estimator.value]
    if k.straight_through:
        kl = k2 + (k3 - k2).detach()
    if k.bias_correction:
        kl = kl * torch.exp(lr)
    if k.score_function:
        kl = kl * torch.exp(lp - lp.detach())
    return _clamp_abs(kl, k.output_clamp)


def _zero_on_graph(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A float64 zero that depends on ``x`` (so it has a gradient, of 0), never reading masked entries."""
    return torch.where(valid, x, torch.zeros_like(x)).sum() * 0.0


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
) -> torch.Tensor:
    """The objective J of a whole step given as one padded batch ``[B, T]``, in float64."""
    lp_all = logprobs.double()
    valid = loss_mask != 0
    B = lp_all.shape[0]
    rc, clamp = cfg.rollout_correction, cfg.policy.log_ratio_clamp
    bypass = rc.bypass

    def rows(x):  # the valid tokens of every row, in float64
        return [None if x is None else x.double()[b][valid[b]] for b in range(B)]

    lps, rolls, refs, ents = rows(lp_all), rows(rollout_logprobs), rows(ref_logprobs), rows(entropy)
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
    n_tokens = sum(int(valid[b].sum()) for b in range(B))
    nonempty = [b for b in range(B) if valid[b].any()]
    n_seqs = B if cfg.aggregation.count_empty_sequences else len(nonempty)
    if cfg.mismatch.skip_threshold is not None:
        k3_sum = sum(float((torch.exp(ds[b]) - ds[b] - 1.0).sum()) for b in nonempty)
        if k3_sum / max(n_tokens, 1) > cfg.mismatch.skip_threshold:
            return _zero_on_graph(lp_all, valid)
    weights = [None] * B
    if rc.weight_level is not None:
        lvl = rc.weight_level.value
        weights = [_clamp_range(torch.exp(_level_log_ratio(lvl, ds[b], clamp)), rc.weight_min, rc.weight_max)
                   if b in nonempty else None for b in range(B)]
        if rc.normalize_weights:
            if lvl == "token":
                mean = sum(float(weights[b].sum()) for b in nonempty) / max(n_tokens, 1)
            else:
                mean = sum(float(weights[b][0]) for b in nonempty) / max(len(nonempty), 1)
            if mean > 1e-8:
                weights = [None if w is None else w / mean for w in weights]
    threshold = None
    if cfg.entropy.top_quantile < 1.0 and nonempty:
        all_ent = torch.cat([ents[b].detach() for b in nonempty])
        threshold = torch.quantile(all_ent, 1.0 - cfg.entropy.top_quantile)

    total = _zero_on_graph(lp_all, valid)
    for b in nonempty:
        lp, old, adv = lps[b], olds[b], advs[b]
        n = lp.numel()
        lr = _clamp_abs(lp - old, clamp)
        term = _policy_term_reference(cfg.policy, lp, lr, adv)
        if weights[b] is not None:
            term = term * weights[b]
        keep = torch.ones(n, dtype=torch.bool)
        if rc.reject_level is not None:
            ratio = torch.exp(_level_log_ratio(rc.reject_level.value, ds[b], clamp))
            if rc.reject_min is not None:
                keep &= ratio >= rc.reject_min
            if rc.reject_max is not None:
                keep &= ratio <= rc.reject_max
        if cfg.opsm.delta is not None:
            behaviour = rolls[b] if rollout_logprobs is not None else old
            drift = (behaviour - lp.detach()).mean()
            keep &= ~((adv < 0) & (drift > cfg.opsm.delta))
        if threshold is not None:
            keep &= ents[b].detach() >= threshold
        c = torch.where(keep, term, torch.zeros_like(term))
        if cfg.kl.coef != 0.0:
            c = c + cfg.kl.coef * _kl_reference(cfg.kl, lp, refs[b], lr)
        if cfg.entropy.bonus_coef != 0.0:
            c = c - cfg.entropy.bonus_coef * ents[b]
        mode = cfg.aggregation.mode.value
        if mode == "token_mean":
            total = total + c.sum() / n_tokens
        elif mode == "seq_mean_token_mean":
            total = total + c.sum() / n / n_seqs
        elif mode == "seq_mean_token_sum":
            total = total + c.sum() / n_seqs
        else:
            total = total + c.sum() / (n_seqs * cfg.aggregation.norm_constant)
    return total


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logprobs_reference`` of the filtered, renormalized distribution (``sampling_filter_keep_reference``).

    A target outside the kept set gets log-prob -inf, detached (no gradient flows from it).
    """
    keep = sampling_filter_keep_reference(logits.detach(), top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature)
    masked = torch.where(keep, logits.double(), torch.tensor(float("-inf"), dtype=torch.float64))
    logprobs, entropy = logprobs_reference(masked, target, temperature=temperature, ignore_index=ignore_index)
    valid = target != ignore_index
    safe_target = torch.where(valid, target, torch.zeros_like(target))
    target_kept = keep.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1) | ~valid
    logprobs = torch.where(target_kept, logprobs, torch.tensor(float("-inf"), dtype=torch.float64))
    return logprobs, entropy
