"""Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556, eq. 9).

A sequence's policy term is zeroed where ``A < 0`` and the mean over its valid tokens of
``behaviour − stopgrad(log π_θ)`` exceeds ``delta`` — the sequence became much less likely under the
current policy than under the one that sampled it, and it is being pushed down further. The behaviour
log-probs are the rollout engine's (both sources of off-policyness, as TRL does), or the old ones when
no rollout log-probs are given. With per-token advantages the test is made per token.
"""

from __future__ import annotations

import torch

from mp_grpo.kernels import token_math
from mp_grpo.loss.dialect import torch_formula

_floor_count = torch_formula(token_math.floor_count)
_opsm_keep = torch_formula(token_math.opsm_keep)


def opsm_divergence(behaviour: torch.Tensor, logprobs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-token ``behaviour − stopgrad(logprobs)`` on valid tokens, exactly 0 elsewhere (to be summed per sequence)."""
    diff = behaviour.detach() - logprobs.detach()
    return torch.where(valid, diff, torch.zeros((), dtype=diff.dtype, device=diff.device))


def opsm_keep(
    advantages: torch.Tensor, seq_sum_div: torch.Tensor, seq_count: torch.Tensor, delta: float
) -> torch.Tensor:
    """Bool per token: keep unless ``A < 0`` and the sequence's mean divergence exceeds ``delta``
    (:func:`mp_grpo.kernels.token_math.opsm_keep`, the kernels' formula)."""
    return _opsm_keep(advantages, seq_sum_div, _floor_count(seq_count), delta)
