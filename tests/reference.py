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
