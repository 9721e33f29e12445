"""Language-model-like logit rows for the sampling-filter tests and benchmarks (GPU or CPU).

- :func:`policy_logits` — a trained policy's rows: a head of 1-8 plausible tokens over a bulk of N(0, 2²)
  logits, the bulk holding a tail mass ``1 - q`` drawn log-uniformly in [1e-4, 3e-2] per row (the head
  holds 97-99.99 % of the probability); inside the head the logits fall by steps of mean 2.5, so the top
  token's probability is ~0.5 to ~1 (median ~0.9; mean entropy ~0.5 nats: forks and confident tokens).
  Top-p at 0.95 keeps head tokens only; at 0.99 some rows reach into the bulk.
- :func:`flat_logits` — rows whose bulk holds almost all the mass: 40 dominant tokens (+9 … +3) over the same
  N(0, 2²) bulk (the bulk holds ~95 % of the mass at V = 151936): top-p keeps tens of thousands of tokens.
- :func:`mixed_logits` — policy rows with a fraction of flat rows at random positions.

Columns are shuffled (a random token order), one generator per call: the same seed gives the same rows.
"""

from __future__ import annotations

import math

import torch

TAIL_MASS = (1e-4, 3e-2)
"""Range of the bulk's probability mass in a policy row (log-uniform)."""
HEAD_TOKENS = 8
"""Largest head: 1 … HEAD_TOKENS plausible tokens a row (uniform)."""


def policy_logits(n: int, v: int, *, device="cuda", seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, v, device=device, generator=gen) * 2
    # --- head: h tokens, logits L - d_i with d_0 = 0 and Exp(mean 2.5) steps ---
    h = torch.randint(1, HEAD_TOKENS + 1, (n, 1), device=device, generator=gen)
    steps = torch.empty(n, HEAD_TOKENS, device=device).exponential_(1 / 2.5, generator=gen)
    steps[:, 0] = 0.0
    offsets = steps.cumsum(-1)
    in_head = torch.arange(HEAD_TOKENS, device=device) < h
    head_weight = torch.where(in_head, torch.exp(-offsets), 0.0).sum(-1)
    # --- top logit L such that the head holds q of the mass: e^L head_weight / bulk = q / (1 - q) ---
    lo, hi = math.log(TAIL_MASS[0]), math.log(TAIL_MASS[1])
    tail = torch.exp(lo + (hi - lo) * torch.rand(n, device=device, generator=gen))
    bulk = torch.logsumexp(x, -1)
    top = bulk + torch.log((1 - tail) / tail) - torch.log(head_weight)
    head_logits = torch.where(in_head, top[:, None] - offsets, float("-inf"))
    x[:, :HEAD_TOKENS] = torch.maximum(x[:, :HEAD_TOKENS], head_logits)
    perm = torch.randperm(v, device=device, generator=gen)
    return x[:, perm].to(dtype)


def flat_logits(n: int, v: int, *, device="cuda", seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, v, device=device, generator=gen) * 2
    x[:, :40] += torch.linspace(9, 3, 40, device=device)
    perm = torch.randperm(v, device=device, generator=gen)
    return x[:, perm].to(dtype)


def mixed_logits(n: int, v: int, flat_fraction: float, *, device="cuda", seed: int = 0,
                 dtype=torch.bfloat16) -> torch.Tensor:
    x = policy_logits(n, v, device=device, seed=seed, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    rows = torch.randperm(n, device=device, generator=gen)[: round(flat_fraction * n)]
    x[rows] = flat_logits(len(rows), v, device=device, seed=seed + 2, dtype=dtype)
    return x
