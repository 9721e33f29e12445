"""Top-entropy token selection ("Beyond the 80/20 rule", arXiv 2506.01939).

Also :func:`sampled_token_entropy`, Megatron-LM RL's one-token entropy term.

The threshold is the ``1 − top_quantile`` quantile (linear interpolation, as ``torch.quantile`` and TRL)
of the entropies of *all* valid tokens of the step on all ranks of the data-parallel group — an exact
quantile needs the values themselves, so :class:`~mp_grpo.GlobalBatch` gathers them once per step (4
bytes a valid token; 64 MiB for 16M tokens). The policy term is kept on valid tokens whose entropy is at
least the threshold. Computed once per step, the mask does not depend on how the step is split.
"""

from __future__ import annotations

import torch

from mp_grpo.kernels import token_math
from mp_grpo.loss.dialect import torch_formula

_high_entropy = torch_formula(token_math.high_entropy)


def linear_quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """The ``q`` quantile of 1-D ``values`` with linear interpolation (``torch.quantile``'s default), float64.

    Uses two ``kthvalue`` selections instead of ``torch.quantile``, which refuses inputs of more than 2^24
    elements. An empty input gives −inf (every token kept — there is none).
    """
    n = values.numel()
    if n == 0:
        return torch.full((), float("-inf"), dtype=torch.float64, device=values.device)
    v = values.detach().to(torch.float64)
    position = q * (n - 1)
    lower = int(position)  # floor: position ≥ 0
    upper = min(lower + 1, n - 1)
    frac = position - lower
    lo = torch.kthvalue(v, lower + 1).values
    hi = torch.kthvalue(v, upper + 1).values if upper != lower else lo
    return lo + frac * (hi - lo)


def entropy_threshold(valid_entropies: torch.Tensor, top_quantile: float) -> torch.Tensor:
    """Threshold below which a token's policy term is dropped; −inf (keep all) for ``top_quantile`` = 1."""
    if top_quantile >= 1.0:
        return torch.full((), float("-inf"), dtype=torch.float64, device=valid_entropies.device)
    return linear_quantile(valid_entropies, 1.0 - top_quantile)


def high_entropy(entropy: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Bool: the token's entropy is at least ``threshold`` (compared in float64, like the threshold;
    :func:`mp_grpo.kernels.token_math.high_entropy`, the kernels' formula)."""
    return _high_entropy(entropy.detach(), threshold)


def sampled_token_entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """``−p·log p`` of the sampled token alone (p = exp(log π_θ(y_t))), differentiable: Megatron-LM RL's
    ``entropy_term`` (``megatron/rl/rl_utils.py::calculate_grpo_loss``) — one term of the entropy sum, not the
    entropy of the distribution. Passed as ``entropy=`` it makes ``entropy.bonus_coef`` Megatron-LM's
    ``--grpo-entropy-term-weight``."""
    return -torch.exp(logprobs) * logprobs
