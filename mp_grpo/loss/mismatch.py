"""Training–inference mismatch estimates between the trainer's and the rollout engine's log-probs.

With ``d = trainer − rollout`` (clamped like every log-ratio; tokens sampled from the rollout policy μ):

* ``k1 = −d``, whose mean estimates KL(μ ‖ π_trainer) ("vllm-kl" of the verl / slime reports);
* ``k3 = eᵈ − d − 1`` — the same KL, lower variance and never negative; its global mean decides
  ``mismatch.skip_threshold``;
* ``χ²`` per token ``e^{2d} − 1`` and per sequence ``e^{2 Σd} − 1`` (means estimate E_μ[ρ²] − 1).

k1 / k3 are the KL estimators of :mod:`mp_grpo.kernels.token_math` applied to d, χ² its ``chi2``: the
formulas the fused kernels use, run on torch tensors.
"""

from __future__ import annotations

import torch

from mp_grpo.kernels import token_math
from mp_grpo.loss.clamps import symmetric_clamp
from mp_grpo.loss.dialect import CODES, torch_formula

_kl_estimator = torch_formula(token_math.kl_estimator)
_chi2 = torch_formula(token_math.chi2)


def k1(d: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimate ``−d``."""
    return _kl_estimator(d, CODES.KL_K1, False)[0]


def k3(d: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate ``eᵈ − d − 1`` (0 where d = 0, so masked tokens with d = 0 add nothing)."""
    return _kl_estimator(d, CODES.KL_K3, False)[0]


def chi2_token(d: torch.Tensor) -> torch.Tensor:
    """Per-token ``ρ² − 1 = e^{2d} − 1``."""
    return _chi2(d)[0]


def chi2_sequence(seq_sum_d: torch.Tensor, clamp: float | None) -> torch.Tensor:
    """Per-sequence ``(Π ρ)² − 1`` from Σd, with Σd clamped like a sequence-level log-ratio."""
    return _chi2(symmetric_clamp(seq_sum_d, clamp))[0]
