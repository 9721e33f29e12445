"""Training–inference mismatch estimates between the trainer's and the rollout engine's log-probs.

With ``d = trainer − rollout`` (clamped like every log-ratio; tokens sampled from the rollout policy μ):

* ``k1 = −d``, whose mean estimates KL(μ ‖ π_trainer) ("vllm-kl" of the verl / slime reports);
* ``k3 = eᵈ − d − 1`` — the same KL, lower variance and never negative; its global mean decides
  ``mismatch.skip_threshold``;
* ``χ²`` per token ``e^{2d} − 1`` and per sequence ``e^{2 Σd} − 1`` (means estimate E_μ[ρ²] − 1).
"""

from __future__ import annotations

import torch

from mp_grpo.loss.clamps import symmetric_clamp


def k1(d: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimate ``−d``."""
    return -d


def k3(d: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate ``eᵈ − d − 1`` (0 where d = 0, so masked tokens with d = 0 add nothing)."""
    return torch.expm1(d) - d


def chi2_token(d: torch.Tensor) -> torch.Tensor:
    """Per-token ``ρ² − 1 = e^{2d} − 1``."""
    return torch.expm1(2.0 * d)


def chi2_sequence(seq_sum_d: torch.Tensor, clamp: float | None) -> torch.Tensor:
    """Per-sequence ``(Π ρ)² − 1`` from Σd, with Σd clamped like a sequence-level log-ratio."""
    return torch.expm1(2.0 * symmetric_clamp(seq_sum_d, clamp))
