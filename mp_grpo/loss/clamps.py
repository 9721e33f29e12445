"""The loss layer's fixed bounds, each with the reason it exists, and the symmetric clamp they share.

The floors the kernels share (``COUNT_FLOOR``, ``WEIGHT_MEAN_FLOOR``) are defined once on the kernels' floor,
:mod:`mp_grpo.kernels.grpo_loss_constants`, and re-exported here as floats. The configurable bounds (``policy.log_ratio_clamp``, ``kl.input_clamp``,
``kl.output_clamp``, the clipping ranges) live in :mod:`mp_grpo.config.loss`; the constants here are not meant to be tuned.
"""

from __future__ import annotations

import math

import torch

from mp_grpo.kernels import grpo_loss_constants
from mp_grpo.kernels.token_math import clamp_sym
from mp_grpo.loss.dialect import torch_formula

COUNT_FLOOR: float = grpo_loss_constants.COUNT_FLOOR.value
"""Floor of every count used as a divisor: the kernels' :data:`mp_grpo.kernels.grpo_loss_constants.COUNT_FLOOR`
(defined once there, on the kernels' floor, with why), as a float."""

WEIGHT_MEAN_FLOOR: float = grpo_loss_constants.WEIGHT_MEAN_FLOOR.value
"""Below this global mean the IS weights are left unnormalized (verl's rule): the kernels'
:data:`mp_grpo.kernels.grpo_loss_constants.WEIGHT_MEAN_FLOOR` (defined once there, with why), as a float."""

_clamp_sym = torch_formula(clamp_sym)


def symmetric_clamp(x: torch.Tensor, bound: float | None) -> torch.Tensor:
    """``x`` clamped to ``[-bound, bound]`` (:func:`mp_grpo.kernels.token_math.clamp_sym`, the kernels' clamp);
    ``x`` itself when ``bound`` is None (disabled in the config: what the clamp gives at ±inf)."""
    if bound is None:
        return x
    return _clamp_sym(x, float(bound))[0]


def bound_or_inf(bound: float | None, sign: float = 1.0) -> float:
    """A config bound as the per-token formulas take it: ``sign``·inf when absent (None), as in the kernels'
    parameter vector (``mp_grpo.ops.grpo_loss_plan.config_parameters``)."""
    return sign * math.inf if bound is None else float(bound)


VESPO_LOG_W_MIN = math.log(1e-8)
"""Lower bound of VESPO's log sequence weight and of each token IS weight's log inside it (TRL / Liger
``get_gamma_weights``: ``log(1e-8)`` ≈ −18.42). A token the rollout rejection drops enters with weight 1e-8
(log 0 would be −inf), which makes φ(w) ≈ 0 for its sequence, as in TRL's ``token_mask`` mode."""

VESPO_LOG_W_MAX = 20.0
"""Upper bound of VESPO's log sequence weight and of each token IS weight's log (TRL / Liger): w ≤ e^20
≈ 4.9e8 keeps λ·w finite in fp32."""

VESPO_LOG_RATIO_BOUND = 20.0
"""VESPO's own bound on each token's |log π_θ/π_old| before the sum (TRL / Liger ``get_gamma_weights``), part
of its definition: applied whatever ``policy.log_ratio_clamp`` is."""

VESPO_LAMBDA_FLOOR = 1e-4
"""Floor of VESPO's gamma rate λ (TRL / Liger ``.clamp(min=1e-4)``): with λ = 0, φ(w) = w^k is unbounded."""

TOPK_REST_FLOOR = 1e-12
"""Floor of the top-K trust region's rest-of-vocabulary mass 1 − Σ_k p_k (TRL ``DPPOTrainer``'s ``clamp(min=1e-12)``,
part of the definition its presets reproduce): where the top-K ids hold (all but a rounding of) the whole mass the
difference is rounding, possibly ≤ 0, and log of it would be −inf or NaN in the KL's rest term."""
