"""The metrics dict of one loss call in NeMo-RL's form (``ClippedPGLossFn``'s keys and normalizations).

NeMo-RL sums every metric over micro-batches and data-parallel ranks (``np.sum`` in ``grpo.py``) except the
extrema, which it reduces with min / max. So each mean is returned as this call's *share*: the sum over its
valid tokens divided by the step's global count — ``global_valid_toks`` for token metrics, ``global_valid_seqs``
for per-sequence ones — and the shares add up to the step's mean. Keys (``MetricNormalizer``):

* ``loss`` — this call's share of the objective (the sum over CP ranks of their shares); normalized like the
  gradient.
* ``probs_ratio``, ``probs_ratio_min`` / ``_max`` — the objective's ratio as mp_grpo computes it (token ratio
  π_θ/π_old; GSPO's sequence ratio, as NeMo-RL); ``probs_ratio_clamped`` (+ ``_min`` / ``_max``) — that ratio
  clamped to [1 − eps_low, 1 + eps_high] (log-prob input only: the logit path keeps the log-probs inside its
  fused kernel; the clamped extremes are the clamped raw extremes there too).
* ``kl_penalty`` — the mean KL per valid token without its coefficient (0 when ``kl.coef`` is 0): the token
  share Σ KL / ``global_valid_toks`` — NeMo-RL's value at token level; at sequence level NeMo-RL averages each
  sequence first.
* ``token_mult_prob_error``, ``gen_kl_error``, ``policy_kl_error``, ``js_divergence_error`` — trainer
  (``prev_logprobs``) vs rollout engine (``generation_logprobs``), NeMo-RL's formulas with the config's KL
  estimator.
* ``sampling_importance_ratio`` — the IS weight applied to the policy term (mp_grpo's ``rollout_correction``;
  exp(prev − generation) when none is configured).
* ``approx_entropy`` — log-prob input: NeMo-RL's estimate −E[(π/π_gen)·log π]; logit input: the exact entropy of
  π_θ, which the log-prob kernel computes.
* ``num_valid_samples`` (raw count), ``positive_nll_loss`` (this call's mean −log π over its positive tokens).

Under context parallelism (logit input) every sum is all-reduced over the CP group (one sum, one max), so every
CP rank reports the whole micro-batch. One host read per call.

With NeMo-RL's split-API placeholder counts (``normalized=False``) every normalized metric is the raw sum, which
NeMo-RL's ``finish_train_step`` multiplies by 1 / the count ``metric_normalizations`` names; the synchronous value
divides that sum by the count + 1e-8 (``masked_mean``'s epsilon, as ``ClippedPGLossFn``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from mp_grpo.collectives import ProcessGroup, all_reduce_max, all_reduce_sum
from mp_grpo.config.loss import KLConfig, LossConfig
from mp_grpo.integrations.nemo_rl.data import LossFields
from mp_grpo.integrations.nemo_rl.interfaces import MetricNormalizer
from mp_grpo.loss.kl import kl_penalty
from mp_grpo.loss.mismatch import k3

TOKEN_METRICS = (
    "probs_ratio", "probs_ratio_clamped", "token_mult_prob_error", "gen_kl_error", "policy_kl_error",
    "js_divergence_error", "sampling_importance_ratio", "approx_entropy",
)
EXTREMA = ("probs_ratio_min", "probs_ratio_max", "probs_ratio_clamped_min", "probs_ratio_clamped_max")


def metric_normalizations(sequence_level: bool) -> dict[str, object]:
    """``MetricNormalizer`` of every key (NeMo-RL's split-API trainers rescale by it)."""
    grad = MetricNormalizer.SEQUENCES if sequence_level else MetricNormalizer.TOKENS
    out: dict[str, object] = {"loss": grad, "kl_penalty": MetricNormalizer.TOKENS}
    out.update({name: MetricNormalizer.TOKENS for name in TOKEN_METRICS})
    out.update({name: MetricNormalizer.NONE for name in EXTREMA + ("num_valid_samples", "positive_nll_loss")})
    return out


def _estimator(cfg: LossConfig, logprobs: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """The config's KL estimator of ``x = reference − logprobs``, no clamp, no weight (NeMo-RL's diagnostics)."""
    plain = KLConfig(estimator=cfg.kl.estimator, input_clamp=None, output_clamp=None)
    return kl_penalty(logprobs, reference, torch.zeros_like(logprobs), plain)


def nemo_rl_metrics(
    cfg: LossConfig,
    fields: LossFields,
    share: torch.Tensor,
    ours: Mapping[str, torch.Tensor],
    *,
    global_valid_toks: torch.Tensor,
    logprobs: torch.Tensor | None,
    cp_group: ProcessGroup | None,
    rewards: torch.Tensor | None,
    normalized: bool = True,
) -> dict[str, float]:
    """NeMo-RL's metric dict of one call (module docstring). ``ours`` is GRPOLoss's metric dict of the call;
    ``logprobs`` the trained log-probs (log-prob input) or None (logit input); ``normalized=False``: the raw sums
    (placeholder counts)."""
    m = fields.mask
    dtype = torch.float64
    zero = torch.zeros((), dtype=dtype, device=m.device)

    def masked_sum(x: torch.Tensor, mask: torch.Tensor = m) -> torch.Tensor:
        return torch.where(mask, x.detach().to(dtype), zero).sum()

    prev = fields.fields["prev_logprobs"].detach().to(dtype)
    gen = fields.fields["generation_logprobs"].detach().to(dtype)
    prev, gen = torch.where(m, prev, zero), torch.where(m, gen, zero)  # masked entries never reach an exp
    log_mix = torch.logaddexp(prev, gen) - math.log(2.0)
    sums = {
        "loss": share.detach().to(dtype),
        "probs_ratio": ours["ratio/mean"][0],
        "token_mult_prob_error": masked_sum(torch.exp((gen - prev).abs())),
        "gen_kl_error": masked_sum(_estimator(cfg, gen, prev)),
        "policy_kl_error": masked_sum(_estimator(cfg, prev, gen)),
        "js_divergence_error": masked_sum(0.5 * k3(prev - log_mix) + 0.5 * k3(gen - log_mix)),
    }
    for key in ("is_weight/applied/mean", "is_weight/truncated/mean"):
        if key in ours:
            sums["sampling_importance_ratio"] = ours[key][0]
            break
    else:
        sums["sampling_importance_ratio"] = masked_sum(torch.exp(prev - gen))
    ratio_min, ratio_max = ours["ratio/min"], ours["ratio/max"]
    low = -math.inf if cfg.policy.eps_low is None else 1.0 - cfg.policy.eps_low
    high = math.inf if cfg.policy.eps_high is None else 1.0 + cfg.policy.eps_high
    if logprobs is not None:
        lp = torch.where(m, logprobs.detach().to(dtype), zero)
        sums["approx_entropy"] = -masked_sum(torch.exp(lp - gen) * lp)
        ratio = torch.where(m, torch.exp(lp - prev), zero)
        sums["probs_ratio_clamped"] = masked_sum(ratio.clamp(low, high))
    elif "entropy" in ours:
        sums["approx_entropy"] = ours["entropy"][0]
    if "kl" in ours and cfg.kl.coef != 0.0:
        sums["kl_penalty"] = ours["kl"][0]
    positive = None
    if rewards is not None and cfg.nll.positive_coef > 0.0 and "nll/positive" in ours:
        positive = ours["nll/positive"]  # [Σ −lp over positive valid tokens, their count]

    # --- one sum and one max over the CP group ---
    names = sorted(sums)
    vector = torch.stack([sums[n].reshape(()).to(dtype) for n in names] + ([positive[0], positive[1]] if positive is not None else []))
    vector = all_reduce_sum(vector, cp_group)
    extremes = torch.stack([-ratio_min.to(dtype), ratio_max.to(dtype)]).reshape(2)
    extremes = all_reduce_max(extremes, cp_group)
    counts = torch.stack([global_valid_toks.to(dtype).reshape(()), fields.sample_mask.sum().to(dtype)])
    *values, neg_lo, hi, tokens, samples = torch.cat([vector, extremes, counts]).tolist()  # the one host read
    lo = -neg_lo
    out: dict[str, float] = {}
    for n, v in zip(names, values):
        out[n] = v if n == "loss" or not normalized else v / (tokens + 1e-8)
    if "kl_penalty" not in out:
        out["kl_penalty"] = 0.0
    out["probs_ratio_min"], out["probs_ratio_max"] = lo, hi
    # the clamp is monotone: the clamped extremes are the clamped extremes (±inf: nothing to report)
    out["probs_ratio_clamped_min"] = min(max(lo, low), high) if math.isfinite(lo) else lo
    out["probs_ratio_clamped_max"] = min(max(hi, low), high) if math.isfinite(hi) else hi
    out["num_valid_samples"] = samples
    if positive is not None:
        total, count = values[len(names)], values[len(names) + 1]
        out["positive_nll_loss"] = total / count if count > 0 else 0.0
    else:
        out["positive_nll_loss"] = 0.0
    return out
