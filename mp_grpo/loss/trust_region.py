"""DPPO's divergence trust region ("Rethinking the Trust Region in LLM Reinforcement Learning", Qi et al.,
arXiv 2602.04879): a token's policy term is dropped — not clipped — where a divergence between the trainer's
policy π_θ and the rollout engine's μ leaves a threshold, in the direction the update would push further.

Per valid token t, with lp = stopgrad(log π_θ(y_t)) (the ``logprobs``), mu = log μ(y_t) (the ``rollout_logprobs``):

* divergence D_t (``trust_region.mode``; every one a stop-gradient value, taken from log-probs, never by
  exponentiating a positive number — the formulas of :mod:`mp_grpo.kernels.token_math`, shared with the kernels):

  - ``binary_tv``: |π − μ| of the sampled token (paper Eq. 13);
  - ``binary_kl``: KL(Bernoulli(μ) ‖ Bernoulli(π)) = μ·log(μ/π) + (1 − μ)·log((1 − μ)/(1 − π)) (Eq. 14);
  - ``topk_tv`` / ``topk_kl`` (:func:`topk_divergence`, torch, float64): over the engine's top-K ids of the token
    (the :class:`TopKLogprobs` input) plus one bucket for the rest of the vocabulary, rest = max(1 − Σ_k p_k,
    ``TOPK_REST_FLOOR``): TV = ½ (Σ_k |π_k − μ_k| + |rest_π − rest_μ|), KL = Σ_k μ_k·log(μ_k/π_k) +
    rest_μ·log(rest_μ/rest_π) — TRL's definition (``DPPOTrainer._compute_divergence_mask``);

* the keep (:func:`mp_grpo.kernels.token_math.trust_region_keep`): drop where π > μ and D > ``delta_high`` or
  π < μ and D > ``delta_low`` — with ``direction=directional`` (Eq. 12) the first only where A > 0, the second
  only where A ≤ 0.

The dropped token's policy term is 0 in value and gradient (``torch.where``), it keeps its KL and entropy terms and
stays in every denominator — as each peer does (TRL and verl multiply the per-token loss by the mask and divide by
the completion tokens; prime-rl and open-instruct the same). Metric: ``rejected_frac/trust_region``.

**Top-K input.** :class:`TopKLogprobs` holds, in CSR form over the flattened token positions the loss sees (those of
``logprobs`` / ``target``, row-major), each position's entries: ``indptr`` [T + 1] int64 (position i's entries are
``indptr[i]:indptr[i + 1]``), the engine's log-probs of its top-K ids ``rollout`` [nnz] and the trainer's log-probs
at the same ids ``trainer`` [nnz] (detached here; ``mp_grpo.ops`` gathers them vocab-parallel from the logits). A
trained position must have at least one entry (the engine returns its top-K for every sampled token); a NaN or +inf
entry at a trained position is an error (the position's policy term is dropped, and ``mp_grpo.check_errors()``
raises); a −inf entry is a probability of 0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mp_grpo.config.loss import TrustRegion, TrustRegionConfig, TrustRegionDirection
from mp_grpo.kernels import grpo_loss_constants as K
from mp_grpo.kernels import token_math
from mp_grpo.loss.clamps import TOPK_REST_FLOOR, bound_or_inf
from mp_grpo.loss.dialect import CODES, torch_formula
from mp_grpo.ops.checks import CheckInputs, record_errors

_binary_divergence = torch_formula(token_math.binary_divergence)
_trust_region_keep = torch_formula(token_math.trust_region_keep)

BINARY_CODES = {TrustRegion.BINARY_TV: CODES.TR_BINARY_TV, TrustRegion.BINARY_KL: CODES.TR_BINARY_KL}
"""A binary :class:`TrustRegion` as the formulas' ``TRUST_REGION`` code."""
TOPK_MODES = (TrustRegion.TOPK_TV, TrustRegion.TOPK_KL)


class TopKLogprobs(NamedTuple):
    """The engine's top-K log-probs of every token position and the trainer's at the same ids, in CSR form (see the
    module docstring): ``GRPOLoss(...)(..., topk_logprobs=TopKLogprobs(indptr, rollout, trainer))``."""

    indptr: torch.Tensor
    """[T + 1] int64 over the flattened token positions: position i's entries are ``indptr[i]:indptr[i + 1]``
    (vLLM's CSR layout); ``indptr[0] = 0``, non-decreasing, ``indptr[-1] = nnz``."""
    rollout: torch.Tensor
    """[nnz] float: the rollout engine's log-probs of the position's top-K ids (log μ(k))."""
    trainer: torch.Tensor
    """[nnz] float: the trainer's log-probs at the same ids (log π_θ(k)); detached for the decision."""


def check_topk_logprobs(cfg: TrustRegionConfig, topk: TopKLogprobs | None, token_shape: torch.Size,
                        device: torch.device, reference: str) -> None:
    """``topk_logprobs`` given exactly with a top-K mode, of the container's types and shapes for ``token_shape``,
    on ``device`` (host-side checks; the CSR's structure is checked on the device by :func:`topk_divergence`)."""
    needed = cfg.mode in TOPK_MODES
    if topk is None:
        if needed:
            raise ValueError(f"topk_logprobs must be given: trust_region.mode={cfg.mode.value} takes the divergence "
                             "over the engine's top-K ids (mp_grpo.loss.TopKLogprobs(indptr, rollout, trainer))")
        return
    if not needed:
        raise ValueError(f"topk_logprobs is only used by trust_region.mode topk_tv | topk_kl, not {cfg.mode.value}")
    if not isinstance(topk, TopKLogprobs):
        raise TypeError(f"topk_logprobs must be a mp_grpo.loss.TopKLogprobs, got {type(topk).__name__}")
    positions = token_shape.numel()
    indptr, rollout, trainer = topk
    if not isinstance(indptr, torch.Tensor) or indptr.dtype != torch.int64 or indptr.shape != (positions + 1,):
        got = f"{indptr.dtype} of shape {tuple(indptr.shape)}" if isinstance(indptr, torch.Tensor) else type(indptr).__name__
        raise ValueError(f"topk_logprobs.indptr must be an int64 tensor [T + 1] = [{positions + 1}] over the "
                         f"{positions} token positions of {reference} {tuple(token_shape)}, got {got}")
    for name, x in (("rollout", rollout), ("trainer", trainer)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 1:
            got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"topk_logprobs.{name} must be a 1-D floating-point tensor [nnz], got {got}")
    if rollout.shape != trainer.shape:
        raise ValueError(f"topk_logprobs.rollout has {rollout.numel()} entries but topk_logprobs.trainer has "
                         f"{trainer.numel()}: the trainer's log-probs are taken at the engine's ids, one each")
    for name, x in (("indptr", indptr), ("rollout", rollout), ("trainer", trainer)):
        if x.device != device:
            raise ValueError(f"topk_logprobs.{name} is on {x.device} but {reference} is on {device}")


def topk_divergence(mode: TrustRegion, topk: TopKLogprobs, valid: torch.Tensor, check: CheckInputs) -> torch.Tensor:
    """D_t of a top-K mode for every token position (float64, ``valid``'s shape; see the module docstring), from the
    CSR input. No host synchronization: the CSR's structure (``indptr[0] = 0``, non-decreasing, ``indptr[-1] = nnz``),
    trained positions without an entry and NaN / +inf entries at trained positions are counted on the device into
    the deferred error ledger (raised at once on the CPU); a trained position with a NaN / +inf entry gets D = +inf
    (dropped by any threshold)."""
    # --- 1. each entry's token position and its stop-gradient probabilities (log-probs capped at LOGPROB_MAX) ---
    indptr = topk.indptr
    positions = indptr.numel() - 1
    nnz = topk.rollout.numel()
    entry = torch.arange(nnz, device=indptr.device, dtype=torch.int64)
    token = (torch.searchsorted(indptr, entry, right=True) - 1).clamp(0, max(positions - 1, 0))
    mu = topk.rollout.detach().to(torch.float64)
    pi = topk.trainer.detach().to(torch.float64)
    bad_entry = torch.isnan(mu) | torch.isnan(pi) | (mu == float("inf")) | (pi == float("inf"))
    ceiling = K.LOGPROB_MAX.value
    mu, pi = mu.clamp(max=ceiling), pi.clamp(max=ceiling)
    zero = torch.zeros((), dtype=torch.float64, device=mu.device)
    mu, pi = torch.where(bad_entry, zero, mu), torch.where(bad_entry, zero, pi)
    q, p = torch.exp(mu), torch.exp(pi)

    def per_token(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(positions, dtype=torch.float64, device=x.device).index_add_(0, token, x)

    # --- 2. the buckets: the top-K entries and the rest of the vocabulary ---
    rest_q = (1.0 - per_token(q)).clamp(min=TOPK_REST_FLOOR)
    rest_p = (1.0 - per_token(p)).clamp(min=TOPK_REST_FLOOR)
    if mode == TrustRegion.TOPK_TV:
        divergence = 0.5 * (per_token((p - q).abs()) + (rest_p - rest_q).abs())
    else:  # KL(μ ‖ π): μ_k = 0 adds 0 (0·log 0), π_k = 0 < μ_k adds +inf
        body = torch.where(q > 0, q * (mu - pi), zero)
        divergence = per_token(body) + rest_q * (torch.log(rest_q) - torch.log(rest_p))
    # --- 3. errors: structure, trained positions without entries or with NaN / +inf entries ---
    valid_flat = valid.reshape(-1)
    counts = indptr[1:] - indptr[:-1]
    bad_token = per_token(bad_entry.to(torch.float64)) > 0
    divergence = torch.where(bad_token, torch.full_like(divergence, float("inf")), divergence)
    structure = (indptr[0] != 0).to(torch.int64) + (counts < 0).sum() + (indptr[-1] != nnz).to(torch.int64)
    record_errors("topk_logprobs structure", structure, lambda n: (
        f"topk_logprobs.indptr is not a CSR row pointer over {nnz} entries ({n} violation(s) of indptr[0] = 0, "
        "indptr non-decreasing, indptr[-1] = nnz)"), ValueError, check)
    empty = (valid_flat & (counts == 0)).sum()
    record_errors("topk_logprobs empty", empty, lambda n: (
        f"topk_logprobs has no entry at {n} trained position(s): the engine's top-K log-probs of every sampled token "
        "are needed for the top-K trust region"), ValueError, check)
    nonfinite = (valid_flat & bad_token).sum()
    record_errors("topk_logprobs non-finite", nonfinite, lambda n: (
        f"topk_logprobs has a NaN or +inf log-prob at {n} trained position(s): their policy term was dropped"),
        ValueError, check)
    return divergence.view(valid.shape)


def binary_divergence(mode: TrustRegion, logprobs: torch.Tensor, rollout: torch.Tensor) -> torch.Tensor:
    """D_t of a binary mode per token (:func:`mp_grpo.kernels.token_math.binary_divergence`, the kernels'
    formula), of stop-gradient log-probs (``logprobs`` = the trainer's, ``rollout`` = the engine's)."""
    return _binary_divergence(logprobs.detach(), rollout.detach(), BINARY_CODES[mode])


def trust_region_keep(cfg: TrustRegionConfig, divergence: torch.Tensor, logprobs: torch.Tensor, rollout: torch.Tensor,
                      advantages: torch.Tensor) -> torch.Tensor:
    """Bool per token: the trust region keeps the policy term (:func:`mp_grpo.kernels.token_math.trust_region_keep`)."""
    directional = cfg.direction == TrustRegionDirection.DIRECTIONAL
    return _trust_region_keep(divergence, logprobs.detach(), rollout.detach(), advantages,
                              bound_or_inf(cfg.delta_low), bound_or_inf(cfg.delta_high), directional)
