"""KL penalty towards the reference policy, per token (Schulman's estimators, http://joschu.net/blog/kl-approx.html).

Schedule of :func:`kl_penalty`
    1. ``x = clamp(ref − log π_θ, ±input_clamp)`` (0 on masked tokens, whose inputs were zeroed).
    2. ``k1 = −x``, ``k2 = x²/2``, ``k3 = eˣ − x − 1``; with ``straight_through`` the value of k3 with the
       gradient of k2 (verl's ``k3+``).
    3. ``bias_correction``: times the ratio π_θ/π_old at ``bias_correction_level`` (token: the clamped token
       ratio, DeepSeek-V3.2's unbiased estimate; geometric / sequence: the sequence's), with its gradient.
       ``score_function``: times ``exp(log π_θ − stopgrad(log π_θ))`` (value 1; adds the score-function
       gradient, NeMo-RL's default). Its gradient is not left to autograd: inside the input clamp the two paths
       to log π_θ, x's −∂k/∂x and the score's k, are each ~eˣ for k3 and cancel to −x, which float32 keeps only
       in multiples of their ulp; :func:`mp_grpo.kernels.token_math.score_function_gradient` gives the sum in
       one exact expression, as in the fused kernels (:func:`_score_function_kl`).
    Steps 2–3 are :func:`mp_grpo.kernels.token_math.weighted_kl`, the one definition the fused kernels use
    too, run on torch tensors (:mod:`mp_grpo.loss.dialect`); the clamps of steps 1 and 4 its ``clamp_sym``.
    4. ``clamp(·, ±output_clamp)``; where it binds, the gradient is exactly 0 — also where the unclamped value
       overflowed (the differentiable formula runs only on the tokens inside the clamp).
The penalty is added on every valid token; the IS weights and the rejection / OPSM / entropy masks of
the policy term never touch it.
"""

from __future__ import annotations

import torch

from mp_grpo.config.loss import KLConfig, KLEstimator
from mp_grpo.kernels.token_math import clamp_sym, kl_estimator, score_function_gradient, weighted_kl
from mp_grpo.loss.clamps import bound_or_inf, symmetric_clamp
from mp_grpo.loss.dialect import CODES, torch_formula

_weighted_kl = torch_formula(weighted_kl)
"""Estimator and weight of ``mp_grpo/kernels/token_math.py`` (one definition for this path and the fused kernels)."""
_clamp_sym = torch_formula(clamp_sym)
_kl_estimator = torch_formula(kl_estimator)
_score_function_gradient = torch_formula(score_function_gradient)
_ESTIMATOR_CODES = {KLEstimator.K1: CODES.KL_K1, KLEstimator.K2: CODES.KL_K2, KLEstimator.K3: CODES.KL_K3}


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, log_ratio: torch.Tensor, cfg: KLConfig
) -> torch.Tensor:
    """Per-token KL estimate (differentiable w.r.t. ``logprobs``); ``log_ratio`` is the log π_θ/π_old at
    ``bias_correction_level`` (read only with ``bias_correction``). ``logprobs`` are the policy's log-probs
    the KL is taken of — the unfiltered ones when top-k / top-p filtering is on (NeMo-RL).

    ``logprobs`` and ``ref_logprobs`` must already hold 0 on masked tokens, where the result is then 0.
    """
    if cfg.score_function and not cfg.bias_correction:
        return _score_function_kl(ref_logprobs.detach() - logprobs, logprobs, cfg)
    # --- 1. the clamped log-ratio of the reference to the policy ---
    x = symmetric_clamp(ref_logprobs.detach() - logprobs, cfg.input_clamp)
    # --- 2. + 3. the estimator and its weight (mp_grpo/kernels/token_math.py; autograd differentiates the value) ---
    mode = CODES.KL_RATIO_BIAS_CORRECTION if cfg.bias_correction else CODES.KL_RATIO_NONE
    score = None  # the score function: _score_function_kl
    codes = (_ESTIMATOR_CODES[cfg.estimator], cfg.straight_through, mode)
    if cfg.output_clamp is None:
        return _weighted_kl(x, log_ratio, score, *codes)[0]
    # --- 4. the output clamp: where it binds, the value is the bound and the gradient exactly 0 ---
    # Where the unclamped value overflows (k3 = eˣ − x − 1 beyond x ≈ 88 in float32 without an input clamp, or
    # times the bias-correction ratio), autograd's product rule would give 0 · inf = NaN to the inputs. So the
    # value is taken first without a graph, and the differentiable formula runs on those tokens' inputs only.
    with torch.no_grad():
        value = _weighted_kl(x, log_ratio, score, *codes)[0]
        inside = value.abs() <= cfg.output_clamp
    zero = torch.zeros((), dtype=x.dtype, device=x.device)

    def where_inside(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.where(inside, t, zero)

    kl = _weighted_kl(where_inside(x), where_inside(log_ratio), where_inside(score), *codes)[0]
    return torch.where(inside, kl, symmetric_clamp(value, cfg.output_clamp))


def _score_function_kl(raw: torch.Tensor, logprobs: torch.Tensor, cfg: KLConfig) -> torch.Tensor:
    """Steps 1–4 with the score function: the value k(x) and, as its gradient w.r.t. ``logprobs``, the token_math
    expression the fused kernels use — k − ∂k/∂x inside the input clamp (−x for k3), the score's k outside it,
    0 where the output clamp binds; ``raw`` = ref − log π_θ."""
    codes = (_ESTIMATOR_CODES[cfg.estimator], cfg.straight_through)
    with torch.no_grad():
        # --- 1. ---
        x, x_inside = _clamp_sym(raw, bound_or_inf(cfg.input_clamp))  # the kernels' clamp and its inside flag
        # --- 2. + 3. ---
        value, d_estimator = _kl_estimator(x, *codes)
        grad = torch.where(x_inside, _score_function_gradient(x, value, d_estimator, *codes), value)
        # --- 4. ---
        if cfg.output_clamp is not None:
            out_inside = value.abs() <= cfg.output_clamp
            value = torch.where(out_inside, value, symmetric_clamp(value, cfg.output_clamp))
            grad = torch.where(out_inside, grad, torch.zeros_like(grad))
    return value + (logprobs - logprobs.detach()) * grad
