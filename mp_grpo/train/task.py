"""The learning job's verifiable task: successor counting, with an exact checker.

A prompt is a few random tokens from ``[0, K)`` (K = ``task.modulus``, default the vocabulary size). A
correct completion counts on from the prompt's last token: ``last + 1, last + 2, …`` (mod K). The
reward of a completion is the fraction of its tokens that equal the previous token + 1 (mod K) — the
first compared with the prompt's last token — so partial credit is exact and every step of the
policy's improvement shows. A uniformly random policy over a vocabulary of V scores 1/V per token.

Why this task: the CPU stand-in model has no attention (each position sees its own token and
position), and this task needs nothing more — the best next token is a function of the current one —
so a model of a few thousand parameters goes from a reward near 1/V to about 0.5 in 20 GRPO steps
on a 2-core CPU (README). Rewards are computed from token ids only: identical on every layout.
"""

from __future__ import annotations

import torch

from mp_grpo.train.sampler import keyed_uniform

PROMPT_SALT = 0x9A0B17
"""Added to the seed for prompt draws, so that prompts and sampling noise are independent."""


def make_prompts(
    *, num_prompts: int, min_length: int, max_length: int, modulus: int, seed: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [num_prompts, max_length] int64, lengths [num_prompts])`` — keyed by (seed, step, prompt)."""
    prompt = torch.arange(num_prompts, dtype=torch.int64).unsqueeze(1)
    u_len = keyed_uniform(seed + PROMPT_SALT, step, prompt, torch.full_like(prompt, -1), torch.zeros(1, dtype=torch.int64))
    lengths = min_length + (u_len.squeeze(1) * (max_length - min_length + 1)).long()
    pos = torch.arange(max_length, dtype=torch.int64).unsqueeze(0)
    u_tok = keyed_uniform(seed + PROMPT_SALT, step, prompt, pos, torch.zeros(1, dtype=torch.int64))
    tokens = (u_tok * modulus).long().clamp(max=modulus - 1)
    tokens = torch.where(pos < lengths.unsqueeze(1), tokens, torch.zeros_like(tokens))
    return tokens, lengths


def successor_reward(tokens: torch.Tensor, prompt_lengths: torch.Tensor, completion_length: int, modulus: int) -> torch.Tensor:
    """``[N]`` float32: fraction of each completion's tokens equal to the previous token + 1 (mod ``modulus``).

    ``tokens``: ``[N, S]`` prompt followed by ``completion_length`` completion tokens (row b's completion at
    ``[prompt_lengths[b], prompt_lengths[b] + completion_length)``).
    """
    idx = prompt_lengths.unsqueeze(1) + torch.arange(completion_length, device=tokens.device).unsqueeze(0)
    completion = tokens.gather(1, idx)
    previous = tokens.gather(1, idx - 1)
    correct = completion == torch.remainder(previous + 1, modulus)
    return correct.float().mean(1)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """GRPO advantages: reward minus its group's mean, over the group's standard deviation plus ``eps``."""
    grouped = rewards.view(-1, group_size)
    centered = grouped - grouped.mean(1, keepdim=True)
    return (centered / (grouped.std(1, unbiased=False, keepdim=True) + eps)).reshape(-1)
