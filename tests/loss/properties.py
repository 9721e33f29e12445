"""Run a drawn step (tests/loss/strategies.py) through GRPOLoss — as one call, or split over (rank, micro-batch)
pairs — and through the float64 reference, and compare: the checks of the property tests.

Tolerances scale with the size of what is summed (a sum of terms of ±1e20 that cancel to 1 is accurate to
1e20 · eps, not to 1 · eps): the loss with Σ|each per-token contribution| (``grpo_objective_reference(...,
magnitude=True)``), a gradient with its largest entry, a metric mean with the mean of |x| — each times the
relative tolerance of the dtype it is computed in (tests/tolerances.py), plus that dtype's smallest normal number
(below it float32 keeps no relative precision: a VESPO weight of 1e-48 is 0 there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mp_grpo.loss import GlobalBatch, GRPOLoss, LossBackend, PackedSequences, PaddedSequences, reduce_metrics
from mp_grpo.loss.trust_region import TopKLogprobs
from tests.loss.strategies import MicroBatch, Step
from tests.reference import grpo_objective_reference, grpo_reference
from tests.tolerances import tolerance

LEAVES = ("logprobs", "entropy", "kl_logprobs")
"""The differentiable inputs."""
TOKEN_INPUTS = ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs", "entropy", "kl_logprobs", "loss_mask")

RTOL_SPLIT = {torch.float64: 1e-9, torch.float32: 1e-5}
"""One call vs the same tokens split: float64 differs only in summation order (the existing layout tests use
1e-6 / 1e-12 for a whole step; relative to the magnitude 1e-9 holds); float32 in the order of its sums."""


@dataclass
class Result:
    """What a call (or the sum of a split's calls) gives: loss, gradients on the step's ``[B, W]`` positions
    (``None`` where an input was absent), reduced metrics."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    metrics: dict[str, float]


def topk_for(step: Step, flat_positions: torch.Tensor, device: torch.device | None = None) -> TopKLogprobs | None:
    """The step's top-K input (``step.topk``) as a CSR over ``flat_positions`` (the micro-batch's tokens as ``b · W + t``
    of the step, row-major; a position outside the step — ``< 0`` or ``≥ B · W`` — has no entry); None without one."""
    if step.topk is None:
        return None
    count, rollout, trainer = step.topk
    numel = count.numel()
    flat = flat_positions.reshape(-1)
    inside = (flat >= 0) & (flat < numel)
    where = torch.where(inside, flat, 0)
    counts = torch.where(inside, count.reshape(-1)[where], 0)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    take = torch.arange(rollout.shape[-1]).unsqueeze(0) < counts.unsqueeze(1)
    r = rollout.reshape(numel, -1)[where][take]
    t = trainer.reshape(numel, -1)[where][take]
    device = torch.device("cpu") if device is None else device
    return TopKLogprobs(indptr.to(device), r.to(device), t.to(device))


def _m2po_advantages(step: Step, advantages: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """What GlobalBatch.from_rollouts needs as ``advantages`` (M2PO's clip quadrants only)."""
    m2po = step.cfg.m2po
    return advantages if m2po.bound is not None and m2po.scope.value != "all" else None


def run_single(step: Step, backend: LossBackend, device: torch.device | None = None) -> Result:
    """One GRPOLoss call on the whole padded step (``batch=None``), backward through ``step.upstream``; on
    ``device`` (default cpu), the result on the CPU."""
    device = torch.device("cpu") if device is None else device
    d = {k: v.to(device) for k, v in step.data.items()}
    leaves = {n: d[n].clone().requires_grad_() for n in LEAVES if n in d}
    kwargs = {name: d.get(name) for name in ("old_logprobs", "rollout_logprobs", "ref_logprobs", "entropy",
                                              "kl_logprobs")}
    kwargs.update({n: leaves[n] for n in leaves if n != "logprobs"})
    old = kwargs.pop("old_logprobs")
    extra = {}
    if step.positive is not None:
        extra["positive"] = step.positive.to(device)
    if step.entropy_coef is not None:
        extra["entropy_coef"] = step.entropy_coef
    if step.topk is not None:
        extra["topk_logprobs"] = topk_for(step, torch.arange(step.rows * step.width), device)
    loss, metrics = GRPOLoss(step.cfg, backend=backend)(leaves["logprobs"], old, d["advantages"], d["loss_mask"],
                                                        **kwargs, **extra)
    (loss * step.upstream).backward()
    grads = {n: (leaves[n].grad if leaves[n].grad is not None else torch.zeros_like(leaves[n])).cpu() if n in leaves
             else None for n in LEAVES}
    return Result(loss.detach().cpu(), grads, reduce_metrics([metrics]))


def _gather(x: torch.Tensor, mb: MicroBatch, junk: torch.Tensor | None) -> torch.Tensor:
    """The micro-batch's view of a ``[B, W]`` token tensor: padded rows, or segments packed back to back plus
    ``mb.trailing`` positions outside every segment (``junk``)."""
    if not mb.packed:
        return x[mb.rows][:, :mb.width]
    parts = [x[b, :seg] for b, seg in zip(mb.rows, mb.segments)]
    parts.append(junk)
    flat = torch.cat(parts)
    return flat if mb.flat_tokens else flat.unsqueeze(0)


def positions(mb: MicroBatch, width: int) -> torch.Tensor:
    """Flat ``b · W + t`` of the micro-batch's tokens in the step (−1 for trailing positions)."""
    if not mb.packed:
        return (torch.tensor(mb.rows, dtype=torch.int64).unsqueeze(1) * width + torch.arange(mb.width)).reshape(-1)
    parts = [b * width + torch.arange(seg) for b, seg in zip(mb.rows, mb.segments)]
    parts.append(torch.full((mb.trailing,), -1, dtype=torch.int64))
    return torch.cat(parts)


def micro_batch_inputs(step: Step, split: list[MicroBatch], gen: torch.Generator) -> list[dict]:
    """Per micro-batch: its token tensors, advantages, positive flags, layout and step positions."""
    d = step.data
    out = []
    for mb in split:
        junk = {}
        for name in TOKEN_INPUTS:
            if name not in d:
                continue
            if name == "loss_mask":
                junk[name] = torch.rand(mb.trailing, generator=gen) < 0.5  # outside every segment: never valid
            else:
                big = torch.finfo(d[name].dtype).max
                junk[name] = torch.tensor([big, -big, 1e4])[torch.randint(0, 3, (mb.trailing,), generator=gen)] \
                    .to(d[name].dtype)
        tensors = {name: _gather(d[name], mb, junk.get(name)) for name in TOKEN_INPUTS if name in d}
        if step.per_token_advantages:
            adv_junk = torch.zeros(mb.trailing, dtype=d["advantages"].dtype) + 1e4
            tensors["advantages"] = _gather(d["advantages"], mb, adv_junk)
        else:
            tensors["advantages"] = d["advantages"][mb.rows]
        if mb.packed:
            cu = torch.tensor([0, *torch.tensor(mb.segments, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)
            layout = PackedSequences(cu)
        else:
            layout = PaddedSequences()
        positive = None if step.positive is None else step.positive[mb.rows]
        out.append({"tensors": tensors, "layout": layout, "positive": positive,
                    "positions": positions(mb, step.width)})
    return out


def run_split(step: Step, split: list[MicroBatch], backend: LossBackend, seed: int = 0,
              device: torch.device | None = None) -> Result:
    """The step as the micro-batches of ``split`` (all (rank, micro-batch) pairs of the data-parallel group in
    one process: one GlobalBatch over all of them, as the all-reduce of a real group would sum them); on
    ``device`` (default cpu), the result on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    mbs = micro_batch_inputs(step, split, gen)
    if device is not None and device.type != "cpu":
        for m in mbs:
            m["tensors"] = {k: v.to(device) for k, v in m["tensors"].items()}
            if m["positive"] is not None:
                m["positive"] = m["positive"].to(device)
            if isinstance(m["layout"], PackedSequences):
                m["layout"] = PackedSequences(m["layout"].cu_seqlens.to(device))
    cfg = step.cfg
    masks = [m["tensors"]["loss_mask"] for m in mbs]
    layouts = [m["layout"] for m in mbs]
    old = [m["tensors"].get("old_logprobs", m["tensors"]["logprobs"]) for m in mbs]
    roll = [m["tensors"]["rollout_logprobs"] for m in mbs] if "rollout_logprobs" in step.data else None
    ents = [m["tensors"]["entropy"] for m in mbs] if "entropy" in step.data else None
    gb = GlobalBatch.from_rollouts(cfg, masks, old_logprobs=old, rollout_logprobs=roll, entropies=ents,
                                   layouts=layouts,
                                   advantages=_m2po_advantages(step, [m["tensors"]["advantages"] for m in mbs]))
    positive_tokens = None
    if step.positive is not None:
        pos_masks = []
        for m in mbs:
            per_token = m["layout"].broadcast(m["positive"].to(torch.float64), m["tensors"]["loss_mask"].shape) != 0
            pos_masks.append(m["tensors"]["loss_mask"] & per_token)
        positive_tokens = GlobalBatch.from_masks(pos_masks, layouts=layouts).valid_tokens
    loss_fn = GRPOLoss(cfg, backend=backend)
    total = None
    numel = step.rows * step.width
    grads = {n: torch.zeros(numel + 1, dtype=step.data[n].dtype) if n in step.data else None for n in LEAVES}
    metrics = []
    for m in mbs:
        t = m["tensors"]
        leaves = {n: t[n].clone().requires_grad_() for n in LEAVES if n in t}
        kwargs = {n: t.get(n) for n in ("old_logprobs", "rollout_logprobs", "ref_logprobs")}
        kwargs.update({n: leaves[n] for n in leaves if n != "logprobs"})
        old_lp = kwargs.pop("old_logprobs")
        extra = {}
        if step.positive is not None:
            extra.update(positive=m["positive"], positive_tokens=positive_tokens)
        if step.entropy_coef is not None:
            extra["entropy_coef"] = step.entropy_coef
        if step.topk is not None:
            extra["topk_logprobs"] = topk_for(step, m["positions"], device)
        loss, mets = loss_fn(leaves["logprobs"], old_lp, t["advantages"], t["loss_mask"], batch=gb,
                             layout=m["layout"], **kwargs, **extra)
        (loss * step.upstream).backward()
        metrics.append(mets)
        total = loss.detach().cpu() if total is None else total + loss.detach().cpu()
        index = m["positions"].clone()
        index[index < 0] = numel  # trailing positions land in the extra slot (must stay 0)
        for n, leaf in leaves.items():
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            grads[n].index_add_(0, index, g.reshape(-1).cpu())
    for n in LEAVES:
        if grads[n] is not None:
            assert grads[n][numel] == 0, f"d/d{n} is nonzero outside every packed segment"
            grads[n] = grads[n][:numel].view(step.rows, step.width)
    return Result(total, grads, reduce_metrics(metrics))


def as_computed(step: Step) -> dict[str, torch.Tensor]:
    """The inputs as the loss computes with them, in float64: each rounded to its dtype and then to the compute
    dtype where that is narrower (GRPOLoss computes in float32 unless the log-probs are float64) — except the
    entropy, whose given values decide the top-entropy selection."""
    compute = step.compute_dtype()
    out = {}
    for name, x in step.data.items():
        if x.is_floating_point() and name != "entropy" and torch.finfo(x.dtype).eps < torch.finfo(compute).eps:
            x = x.to(compute)
        out[name] = x.double() if x.is_floating_point() else x
    return out


def reference(step: Step) -> tuple[Result, float, dict]:
    """The float64 reference of the step on the inputs as computed (:func:`as_computed`): (result, loss magnitude,
    metrics (value, scale))."""
    d = as_computed(step)
    leaves = {n: d[n].clone().requires_grad_() for n in LEAVES if n in d}
    args = dict(rollout_logprobs=d.get("rollout_logprobs"), ref_logprobs=d.get("ref_logprobs"),
                entropy=leaves.get("entropy"), kl_logprobs=leaves.get("kl_logprobs"),
                entropy_coef=step.entropy_coef, positive=step.positive, topk=step.topk)
    args = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in args.items()}
    args["entropy"], args["kl_logprobs"] = leaves.get("entropy"), leaves.get("kl_logprobs")
    old = d.get("old_logprobs")
    old = None if old is None else old.double()
    adv = d["advantages"].double()
    # J (differentiated below), its magnitude and the metrics from one pass over the rows (grpo_reference: the same
    # numbers as grpo_objective_reference, its magnitude=True and grpo_metrics_reference of the detached inputs)
    j, size, metrics = grpo_reference(step.cfg, leaves["logprobs"], old, adv, d["loss_mask"], **args)
    (j * step.upstream).backward()
    grads = {n: (leaves[n].grad if leaves[n].grad is not None else torch.zeros_like(leaves[n])) if n in leaves
             else None for n in LEAVES}
    return Result(j.detach(), grads, {}), float(size), metrics


def representable(step: Step, ref: tuple[Result, float, dict]) -> bool:
    """Whether the reference's loss terms and gradients fit the dtypes the loss computes and returns them in with
    room to spare (else the step is out of the range of its dtypes: overflow to inf there is no bug), and no trained
    token's KL input sits within the compute dtype's rounding of ``kl.input_clamp`` (a knife edge: the compute dtype's
    rounding of ref − log π decides which side of the clamp it falls, e.g. 20.0 − (−5.8e-7) is 20 in float32), nor
    a ratio the loss compares with a bound (:func:`_ratio_at_a_bound`); and every metric fits the compute dtype
    (χ² of an unclamped sequence log-ratio of 45 is 1.5e39: inf in float32, on both backends); nor normalized
    weights from old / rollout log-probs wider than the compute dtype (below)."""
    compute = step.compute_dtype()
    if not ref[1] < torch.finfo(compute).max * 1e-6:
        return False
    metric_limit = torch.finfo(compute).max * 1e-3  # a metric's sum beyond it overflows the compute dtype: inf there
    if any(math.isfinite(scale) and not scale < metric_limit for _, scale in ref[2].values()):
        return False
    if _kl_input_at_its_clamp(step) or _ratio_at_a_bound(step):
        return False
    if _trust_region_at_a_bound(step) or _m2po_ill_posed(step):
        return False
    if _vespo_weight_ill_conditioned(step):
        return False
    if step.cfg.rollout_correction.normalize_weights and any(
            torch.finfo(step.data[n].dtype).eps < torch.finfo(compute).eps
            for n in ("old_logprobs", "rollout_logprobs") if n in step.data):
        # The GlobalBatch takes the step's weight mean from the log-probs as given (float64), the loss its weights
        # from their rounding to the compute dtype (float32): a sequence-level weight then carries the inputs'
        # rounding summed over the sequence (4e-5 relative at log-probs ~ −500), which the reference — both from
        # the rounded inputs — does not. Not a property of the loss: of feeding a float32 loss float64 rollouts.
        return False
    for n, g in ref[0].grads.items():
        if g is not None:
            dtype = step.data[n].dtype
            limit = torch.finfo(dtype).max * 1e-3
            if not float(g.abs().max()) < limit:
                return False
    return True


VESPO_ROUNDING = 1.0
"""Multiples of the compute dtype's eps times √(Σ x_t²) (a sequence's VESPO inputs, each rounded once: their errors
add like a random walk) its log w is taken to be off by."""


def _vespo_weight_ill_conditioned(step: Step) -> bool:
    """Whether VESPO's φ(w) = exp(λ + k·log w − λ·w) cannot be computed to the compute dtype's tolerance from the
    sequence's log w = Σ x_t: each x_t (the token's clamped log π_θ − log π_old, plus its log IS weight) is rounded
    to the compute dtype, so log w carries ~eps · √(Σ x_t²), which φ multiplies by |k − λ·w| — at λ = 2, w = 12
    (φ ~ 1e-9) by 25: 4e-5 of φ in float32 for 113 tokens of |x| ~ 4, twice the tolerance (found on a GPU, whose
    profile draws such sequences). The reference takes the x_t exactly; a third of the tolerance is left."""
    from mp_grpo.loss.clamps import VESPO_LAMBDA_FLOOR, VESPO_LOG_RATIO_BOUND, VESPO_LOG_W_MAX, VESPO_LOG_W_MIN

    cfg, d = step.cfg, as_computed(step)
    p, rc = cfg.policy, cfg.rollout_correction
    if p.objective.value != "vespo":
        return False
    valid = d["loss_mask"] != 0
    lp, rollout = d["logprobs"], d.get("rollout_logprobs")
    old = d.get("old_logprobs", lp)
    x = (lp - old).clamp(-VESPO_LOG_RATIO_BOUND, VESPO_LOG_RATIO_BOUND)
    size = x.abs()
    if rollout is not None and rc.weight_level is not None and rc.weight_level.value == "token":
        dr = (old - rollout).clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
        x, size = x + dr, size + dr.abs()
    log_w = torch.where(valid, x, 0.0).sum(-1).clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
    error = VESPO_ROUNDING * torch.finfo(step.compute_dtype()).eps * (
        torch.where(valid, size * size, 0.0).sum(-1).sqrt() + log_w.abs() + 1.0)
    w = log_w.exp()
    gain = torch.zeros_like(w)
    for k, lam in ((p.vespo_k_pos, p.vespo_lambda_pos), (p.vespo_k_neg, p.vespo_lambda_neg)):
        gain = torch.maximum(gain, (k - max(lam, VESPO_LAMBDA_FLOOR) * w).abs())
    return bool((valid.any(-1) & (gain * error > _rtol(step.compute_dtype()) / 3.0)).any())


DIVERGENCE_ROUNDING = 16.0
"""Multiples of the compute dtype's eps (relative to the sizes of the divergence's terms, plus 1) within which a
trust region's divergence and its threshold are a knife edge."""


def _trust_region_at_a_bound(step: Step) -> bool:
    """Whether a trained token's trust-region divergence lies within the compute dtype's rounding of its threshold
    (:func:`trust_region_at_a_bound` on the inputs as computed)."""
    d = as_computed(step)
    if step.cfg.trust_region.mode.value == "none":
        return False
    return trust_region_at_a_bound(step.cfg, d["logprobs"], d["rollout_logprobs"], d["loss_mask"] != 0,
                                   torch.finfo(step.compute_dtype()).eps, step.topk)


def trust_region_at_a_bound(cfg, logprobs: torch.Tensor, rollout: torch.Tensor, valid: torch.Tensor, eps: float,
                            topk=None) -> bool:
    """Whether a trained token's trust-region divergence (float64, of ``logprobs`` — the compute dtype's, with rounding
    ``eps`` — against ``rollout``) lies within that rounding of ``delta_low`` / ``delta_high`` (the loss computes a binary
    divergence in its compute dtype, the reference in float64: |π − μ| = 0.15 ± 1e-8 falls either side), or its
    log-prob ties the rollout's within that rounding (which side π lies decides which threshold applies). The top-K
    divergence is float64 on both sides: only its own summation order (a few ulps) matters there."""
    from tests.reference import binary_divergence_reference, topk_divergence_reference

    tr = cfg.trust_region
    if tr.mode.value == "none" or not bool(valid.any()):
        return False
    lp, mu = logprobs.double()[valid].clamp(max=0.0), rollout.double()[valid].clamp(max=0.0)
    if tr.mode.value.startswith("binary"):
        div = binary_divergence_reference(tr.mode.value, lp, mu)
        size = lp.exp() + mu.exp() + (mu - lp).abs() + 1.0  # the sizes the KL's terms cancel from (TV: its inputs)
    else:
        count, top_roll, top_train = topk
        div = topk_divergence_reference(tr.mode.value, count[valid], top_roll[valid].double(), top_train[valid].double())
        eps, size = torch.finfo(torch.float64).eps, torch.ones_like(lp) * 4.0
    if bool((((lp - mu).abs() <= DIVERGENCE_ROUNDING * eps * (lp.abs() + mu.abs())) & (lp != mu)).any()):
        return True
    for bound in (tr.delta_low, tr.delta_high):
        if bound is not None and bool(((div - bound).abs() <= DIVERGENCE_ROUNDING * eps * size).any()):
            return True
    return False


def _m2po_ill_posed(step: Step) -> bool:
    """M2PO: the loss takes d from the old and rollout log-probs as given (float64, the GlobalBatch's numbers), the
    reference from their rounding to the compute dtype (:func:`as_computed`): they differ where an input is wider than
    the compute dtype (as with normalize_weights). And a mean of the kept values within float64 rounding of the bound
    is a knife edge between the batch's cumulative sums and the reference's sums."""
    cfg = step.cfg
    if cfg.m2po.bound is None:
        return False
    compute = step.compute_dtype()
    if any(torch.finfo(step.data[n].dtype).eps < torch.finfo(compute).eps
           for n in ("old_logprobs", "rollout_logprobs") if n in step.data):
        return True
    d = as_computed(step)
    valid = d["loss_mask"] != 0
    clamp = cfg.policy.log_ratio_clamp
    x = d.get("old_logprobs", d["logprobs"]) - d["rollout_logprobs"]
    x = x if clamp is None else x.clamp(-clamp, clamp)
    adv = d["advantages"] if d["advantages"].dim() == 2 else d["advantages"].unsqueeze(1).expand_as(x)
    if cfg.m2po.scope.value == "clip_quadrants":
        valid = valid & (((adv > 0) & (x > 0)) | ((adv < 0) & (x < 0)))
    values = torch.sort((x * x)[valid]).values
    if values.numel() == 0:
        return False
    means = values.cumsum(0) / torch.arange(1, values.numel() + 1, dtype=torch.float64)
    scale = values.abs().cumsum(0) / torch.arange(1, values.numel() + 1, dtype=torch.float64) + cfg.m2po.bound
    return bool(((means - cfg.m2po.bound).abs() <= 64 * torch.finfo(torch.float64).eps * scale).any())


RATIO_ROUNDING = 4.0
"""Multiples of the compute dtype's eps (relative to a log-ratio, plus 1 for exp's and the bound's own rounding) within
which a log-ratio and a bound are a knife edge."""


def _ratio_at_a_bound(step: Step) -> bool:
    """Whether a trained token's log-ratio, or its sequence's mean or sum, lies within the compute dtype's rounding of
    a bound the loss compares it with (in log space: the clip range, dual clip, delta, the log-ratio clamp, GMPO's
    range; the rollout-correction weight and rejection bounds; OPSM's δ on the mean drift). The loss takes
    r = exp(lp − old) in its compute dtype, the reference in float64: with eps_low = 0 a log-ratio of −1e-8 is a
    ratio 1 in float32 (not clipped) and 0.99999999 in float64 (clipped). An exact tie at ratio 1 (lp = old) is the
    same in both and stays."""
    cfg, d = step.cfg, as_computed(step)
    eps = torch.finfo(step.compute_dtype()).eps
    valid = d["loss_mask"] != 0
    if not bool(valid.any()):
        return False
    p, rc = cfg.policy, cfg.rollout_correction
    lp, rollout = d["logprobs"], d.get("rollout_logprobs")
    old = rollout if rc.bypass and rollout is not None else d.get("old_logprobs", lp)
    clamp = [] if p.log_ratio_clamp is None else [-p.log_ratio_clamp, p.log_ratio_clamp]

    def logs(*bounds):
        return [math.log(b) for b in bounds if b is not None and b > 0]

    policy = logs(None if p.eps_low is None else 1.0 - p.eps_low, None if p.eps_high is None else 1.0 + p.eps_high,
                  p.dual_clip_c, p.delta) + clamp
    if p.objective.value == "gmpo":
        policy += [b for b in (p.eps_high, None if p.eps_low is None else -p.eps_low) if b is not None]
    n = valid.sum(-1).clamp(min=1).double()
    spread = 1.0 + torch.log2(n)  # the summation order of a sequence's mean or sum

    def near(q: torch.Tensor, scale: torch.Tensor, bounds: list[float], rows: bool = False) -> bool:
        where = valid.any(-1) if rows else valid
        for b in bounds:
            tie = (q == b) & (b == 0.0)
            if bool((where & ~tie & ((q - b).abs() <= RATIO_ROUNDING * eps * (scale + 1.0))).any()):
                return True
        return False

    def row_mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x, 0.0).sum(-1) / n

    x = lp - old
    if near(x, x.abs(), policy) or near(row_mean(x), row_mean(x.abs()) * spread, policy, rows=True):
        return True
    if rollout is not None:
        dr = (lp if rc.bypass else old) - rollout
        bounds = logs(rc.weight_min, rc.weight_max, rc.reject_min, rc.reject_max) + clamp
        if near(dr, dr.abs(), bounds) or near(row_mean(dr), row_mean(dr.abs()) * spread, bounds, rows=True) or \
                near(row_mean(dr) * n, row_mean(dr.abs()) * n * spread, bounds, rows=True):
            return True
    if cfg.opsm.delta is not None:
        drift = (rollout if rollout is not None else old) - lp
        if near(row_mean(drift), row_mean(drift.abs()) * spread, [cfg.opsm.delta], rows=True):
            return True
    return False


def _kl_input_at_its_clamp(step: Step) -> bool:
    cfg, d = step.cfg, step.data
    if cfg.kl.coef == 0 or cfg.kl.input_clamp is None or "ref_logprobs" not in d:
        return False
    lp, ref = d["logprobs"].double(), d["ref_logprobs"].double()
    x, bound = (ref - lp).abs(), float(cfg.kl.input_clamp)
    eps = torch.finfo(step.compute_dtype()).eps
    near = ((x - bound).abs() <= 4 * eps * (ref.abs() + lp.abs() + bound)) & (x != bound)  # exact ties: inclusive
    return bool((near & (d["loss_mask"] != 0)).any())


# ----------------------------------------------------------------------------------------------- checks
def _rtol(dtype: torch.dtype) -> float:
    return tolerance(dtype)["rtol"]


def assert_loss_close(got: torch.Tensor, want: torch.Tensor, scale: float, dtype: torch.dtype, what: str,
                      rtol: float | None = None) -> None:
    """|got − want| ≤ rtol · (|want| + scale)."""
    rtol = _rtol(dtype) if rtol is None else rtol
    g, w = float(got), float(want)
    assert math.isfinite(g), f"{what}: loss {g} is not finite (want {w})"
    allowed = rtol * (abs(w) + scale) + torch.finfo(dtype).tiny
    assert abs(g - w) <= allowed, \
        f"{what}: loss {g!r} vs {w!r} (|Δ| = {abs(g - w):.3g}, allowed {allowed:.3g}; magnitude {scale:.3g})"


def assert_grad_close(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype, what: str,
                      rtol: float | None = None, atol: torch.Tensor | float = 0.0) -> None:
    """Element-wise |got − want| ≤ rtol · (|want| + max |want|) + atol; exactly 0 at masked positions; all finite."""
    rtol = _rtol(dtype) if rtol is None else rtol
    g, w = got.detach().double(), want.detach().double()
    assert torch.isfinite(g).all(), f"{what}: non-finite gradient {g}"
    assert (g[~mask] == 0).all(), f"{what}: nonzero gradient at a masked position: {g[~mask][g[~mask] != 0]}"
    top = float(w.abs().max()) if w.numel() else 0.0
    err = (g - w).abs()
    allowed = rtol * (w.abs() + top) + torch.finfo(got.dtype).tiny + atol
    if not bool((err <= allowed).all()):
        i = int(torch.argmax(err - allowed))
        raise AssertionError(f"{what}: gradient differs at flat index {i}: {g.reshape(-1)[i].item()!r} vs "
                             f"{w.reshape(-1)[i].item()!r} (max |want| {top:.3g}, rtol {rtol:g})\ngot\n{g}\nwant\n{w}")


def _same_float(a: float, b: float, scale: float, rtol: float, tiny: float) -> bool:
    if math.isnan(b):
        return math.isnan(a)
    if math.isinf(b):
        return a == b
    return math.isfinite(a) and abs(a - b) <= rtol * (abs(b) + scale) + tiny


def assert_metrics_close(got: dict[str, float], want: dict, dtype: torch.dtype, what: str,
                         rtol: float | None = None, ignore=("cov/selected_frac",), scales: dict | None = None) -> None:
    """``got`` (reduce_metrics) against ``want``: a metric dict of another call (name → float; ``scales``: the
    reference's metrics, whose scales then apply) or the reference's (name → (value, scale)); the same names, each
    value within tolerance."""
    rtol = _rtol(dtype) if rtol is None else rtol
    names_got = {k for k in got if k not in ignore}
    names_want = {k for k in want if k not in ignore}
    assert names_got == names_want, f"{what}: metric names differ: extra {sorted(names_got - names_want)}, " \
                                    f"missing {sorted(names_want - names_got)}"
    bad = []
    for k in sorted(names_want):
        if isinstance(want[k], tuple):
            value, scale = want[k]
        else:
            value = want[k]
            scale = scales[k][1] if scales is not None and k in scales else abs(value) if math.isfinite(value) else 0.0
        if not _same_float(got[k], value, scale, rtol, torch.finfo(dtype).tiny):
            bad.append(f"{k}: {got[k]!r} vs {value!r} (scale {scale:.3g})")
    assert not bad, f"{what}: metrics differ (rtol {rtol:g}):\n  " + "\n  ".join(bad)


def valid_mask(step: Step) -> torch.Tensor:
    return step.data["loss_mask"] != 0


def check_against_reference(step: Step, got: Result, ref: tuple[Result, float, dict], what: str) -> None:
    """Value, gradients (each differentiable input) and metrics of ``got`` against the reference."""
    want, size, metrics = ref
    compute = step.compute_dtype()
    assert_loss_close(got.loss, want.loss, size, compute, f"{what} vs reference")
    mask = valid_mask(step)
    for n in LEAVES:
        if want.grads[n] is not None:
            grad_dtype = step.data[n].dtype if tolerance(step.data[n].dtype)["rtol"] > _rtol(compute) else compute
            assert_grad_close(got.grads[n], want.grads[n], mask, grad_dtype, f"{what} d/d{n} vs reference")
    assert_metrics_close(got.metrics, metrics, compute, f"{what} vs reference")


# ----------------------------------------------------------------------------------------------- from logits
def logit_spreads(cfg):
    """How far old / rollout / reference log-probs lie from the logits' own (:func:`inputs_around_logits`). Never
    0: the kernel's float32 log-probs differ from the exact ones by ~1e-7, so old = log π exactly would put every
    ratio and OPSM drift on a bound of 1 / 0 (eps = 0, delta = 0) — a knife edge either side may take."""
    from hypothesis import strategies as st

    return st.sampled_from([0.1, 1.0] + ([5.0, 50.0] if cfg.policy.log_ratio_clamp is not None else []))


def inputs_around_logits(step: Step, logits: torch.Tensor, target: torch.Tensor, temperature: float, spread: float,
                         gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The step's loss inputs (float32, ``[B, W]``) for log-probs taken from ``logits`` ``[B, W, V]``: old / rollout
    / ref log-probs around the logits' own (those the step gives; rollout around old when both are), the step's
    junk where masked; the step's advantages."""
    from tests.reference import logprobs_reference

    d, mask = step.data, step.data["loss_mask"]
    lp_true, _ = logprobs_reference(logits, torch.where(target == -100, 0, target), temperature=temperature)
    around = {"old_logprobs": lp_true, "rollout_logprobs": lp_true, "ref_logprobs": lp_true}
    inputs = {}
    for k in ("old_logprobs", "rollout_logprobs", "ref_logprobs"):
        if k in d:
            noisy = around[k] + torch.randn(mask.shape, generator=gen, dtype=torch.float64) * spread
            inputs[k] = torch.where(mask, noisy, d[k].double()).float()  # the step's junk where masked
            if k == "old_logprobs":
                around["rollout_logprobs"] = inputs[k].double()
    inputs["advantages"] = d["advantages"].float()
    return inputs


@dataclass
class LogitsReference:
    """The float64 reference of a step's objective on logits (:func:`logits_reference`)."""

    loss: torch.Tensor
    """J (float64)."""
    grad: torch.Tensor
    """``upstream · ∂J/∂logits`` ``[B, W, V]``."""
    size: float
    """The loss's tolerance magnitude: Σ|per-token contributions| plus what the kernel's float32 log-probs and
    entropies carry into it."""
    grad_atol: torch.Tensor
    """``[B, W, 1]``: the float32 rounding a row's logit gradient carries (see :func:`logits_reference`)."""
    grad_mask: torch.Tensor
    """``[B, W, V]`` bool: rows that are trained or have a target (elsewhere the gradient is exactly 0)."""
    representable: bool
    """The loss terms fit float32 with room to spare, and the top-entropy selection does not hang on the float32
    rounding of the entropies (:func:`_entropy_selection_at_its_threshold`)."""


ENTROPY_ROUNDING = 8.0
"""Multiples of eps32 times a row's logit range (plus its largest |z| and 1) a kernel's float32 entropy may be off by:
the log-prob op's property's bound (tests/ops/test_logprob_properties.py)."""


def _entropy_selection_at_its_threshold(cfg, logits: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor,
                                        temperature: float) -> bool:
    """Whether the top-entropy selection (``entropy.top_quantile`` < 1: keep the tokens whose entropy is at least the
    step's quantile) would change with the float32 rounding of the entropies the loss computes from the logits: the
    smallest kept and the largest dropped float64 entropy within that rounding of each other. Near-deterministic
    rows have entropies of 1e-74 and 1e-54 in float64 and 0 in float32 (below its smallest subnormal): float32 ties
    them, so the loss keeps one the reference drops."""
    if cfg.entropy.top_quantile >= 1.0 or not bool(mask.any()):
        return False
    h = entropy[mask]
    kept = h >= torch.quantile(h, 1.0 - cfg.entropy.top_quantile)
    if bool(kept.all()):
        return False
    z = logits / temperature
    accuracy = (ENTROPY_ROUNDING * torch.finfo(torch.float32).eps
                * ((z.amax(-1) - z.amin(-1)) + z.abs().amax(-1) + 1.0))[mask]
    lowest_kept = int(torch.where(kept, h, math.inf).argmin())
    highest_dropped = int(torch.where(kept, -math.inf, h).argmax())
    gap = h[lowest_kept] - h[highest_dropped]
    return bool(gap <= accuracy[lowest_kept] + accuracy[highest_dropped])


def logits_reference(cfg, logits: torch.Tensor, target: torch.Tensor, inputs: dict[str, torch.Tensor],
                     mask: torch.Tensor, temperature: float, upstream: float, topk=None) -> LogitsReference:
    """J of ``[B, W, V]`` logits (log-probs and entropy of ``target`` at ``temperature`` in float64, then the
    objective on ``inputs`` — :func:`inputs_around_logits`), its gradient under ``upstream``, and the tolerances."""
    from tests.reference import logprobs_reference

    B, W, V = logits.shape
    shape = (B, W)
    r = logits.detach().cpu().double().requires_grad_()
    lp_r, ent_r = logprobs_reference(r, target.cpu(), temperature=temperature)
    lp_r.retain_grad()
    ent_r.retain_grad()
    mask = mask.cpu().reshape(shape)
    ref_inputs = {k: v.cpu().double() for k, v in inputs.items()}
    j = grpo_objective_reference(cfg, lp_r, ref_inputs.get("old_logprobs"), ref_inputs["advantages"], mask,
                                 rollout_logprobs=ref_inputs.get("rollout_logprobs"),
                                 ref_logprobs=ref_inputs.get("ref_logprobs"), entropy=ent_r, topk=topk)
    (j * upstream).backward()
    with torch.no_grad():
        size = float(grpo_objective_reference(
            cfg, lp_r.detach(), ref_inputs.get("old_logprobs"), ref_inputs["advantages"], mask, magnitude=True,
            rollout_logprobs=ref_inputs.get("rollout_logprobs"), ref_logprobs=ref_inputs.get("ref_logprobs"),
            entropy=ent_r.detach(), topk=topk))
    representable = size < 1e30 and not _entropy_selection_at_its_threshold(cfg, r.detach(), ent_r.detach(),
                                                                             mask, temperature)
    # The kernel's log-probs and entropies are float32 results (not given inputs): their rounding, ~eps32 · the
    # size of the logits, reaches the loss through ∂J/∂log π and ∂J/∂entropy.
    spread_of_logits = (r.detach().amax(-1) - r.detach().amin(-1)) / temperature + 1.0
    size += sum(float(((t.grad.abs() / abs(upstream)) * (t.detach().abs() + spread_of_logits)).sum())
                for t in (lp_r, ent_r) if t.grad is not None)
    # A row's logit gradient is ∂J/∂log π · (onehot − p) + ∂J/∂H · ∂H/∂z: float32 rounding of each, ~eps32 times
    # |∂J/∂log π| + |∂J/∂H| · the logits' spread, bounds its error even where the gradient itself is tiny (a
    # rejected token's entropy-bonus gradient at a 55-nat logit gap: 7e-25, which the float64 reference rounds to 0).
    per_token = sum((t.grad.detach().abs() * (1.0 if t is lp_r else spread_of_logits))
                    for t in (lp_r, ent_r) if t.grad is not None)
    atol = torch.finfo(torch.float32).eps * per_token.reshape(B, W, 1)
    # ∂J/∂log π itself moves with that rounding of log π, the kernel's float32 output (~eps32 · (|log π| + the
    # spread)): k2's coefficient is log π − ref, of which it is the absolute error — at log π = −78.6 and
    # log π − ref = 0.02, fp32's rounding of log π alone is 2e-4 of it. Bound it by ∂J/∂log π taken again at log π
    # moved by that much either way; a logit's share of it is at most 1 / T.
    if lp_r.grad is not None:
        lp_d = lp_r.detach()
        shift = torch.where(torch.isfinite(lp_d),
                            torch.finfo(torch.float32).eps * (lp_d.abs() + spread_of_logits), 0.0)
        moved = torch.zeros_like(lp_d)
        for sign in (1.0, -1.0):
            lp_s = (lp_d + sign * shift).requires_grad_()
            j_s = grpo_objective_reference(cfg, lp_s, ref_inputs.get("old_logprobs"), ref_inputs["advantages"], mask,
                                           rollout_logprobs=ref_inputs.get("rollout_logprobs"),
                                           ref_logprobs=ref_inputs.get("ref_logprobs"), entropy=ent_r.detach(),
                                           topk=topk)
            (j_s * upstream).backward()
            if lp_s.grad is not None:
                moved = torch.maximum(moved, torch.nan_to_num((lp_s.grad - lp_r.grad).abs(), nan=0.0))
        atol = atol + (moved / temperature).reshape(B, W, 1)
    grad_mask = (mask | (target.cpu().reshape(shape) != -100)).unsqueeze(-1).expand(B, W, V)
    return LogitsReference(j.detach(), r.grad, size, atol, grad_mask, representable)
