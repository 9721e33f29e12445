"""A synthetic rollout engine for the main job: random prompts and completions, a toy reward, GRPO advantages.

Schedule of :func:`synthesize_rollouts` (one optimizer step's global batch; the same on every rank
for a given seed)

1. ``N / group_size`` prompts of random length and random tokens; each is repeated for the
   ``group_size`` completions of its group.
2. Completions of random length and random tokens; the loss mask covers them, except for one
   tool-output span of ``tool_mask_fraction`` of the completion (never its first token).
3. Reward: the fraction of a completion's trained tokens in the lower half of the vocabulary — a toy
   task the policy can learn.
4. Advantages: reward minus its group mean, over the group's standard deviation (GRPO).
5. Train–inference mismatch: token-aligned N(0, mismatch_std²) noise on the trained tokens; the job
   adds it to the trainer's own log-probs to make the "rollout engine's" log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mp_grpo.config.job import RolloutConfig
from mp_grpo.megatron.rollouts import Rollouts

ADVANTAGE_STD_EPS = 1e-6
"""Added to a group's reward standard deviation: a group whose rewards are all equal gets advantage 0
instead of 0/0 (TRL's and verl's GRPO use the same kind of epsilon)."""


@dataclass(frozen=True)
class SyntheticBatch:
    """One step's global batch from :func:`synthesize_rollouts`."""

    rollouts: Rollouts
    """Token-aligned fields of all N sequences (rollout / old log-probs not yet known)."""
    rewards: torch.Tensor
    """``[N]`` float32 rewards."""
    mismatch_noise: torch.Tensor
    """``[N, S]`` float32 token-aligned noise (0 off the loss mask): rollout log-probs = trainer's + noise."""


def synthesize_rollouts(cfg: RolloutConfig, *, num_sequences: int, vocab_size: int, seed: int) -> SyntheticBatch:
    """``num_sequences`` synthetic rollouts (a multiple of ``cfg.group_size``); see the module docstring."""
    if num_sequences % cfg.group_size:
        raise ValueError(
            f"num_sequences ({num_sequences}) must be a multiple of rollout.group_size ({cfg.group_size}): "
            "every prompt's group must be whole in the global batch"
        )
    gen = torch.Generator().manual_seed(seed)
    groups = num_sequences // cfg.group_size

    def randint(low: int, high: int, size: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(low, high + 1, size, generator=gen)

    # --- 1. prompts, one per group ---
    prompt_len = randint(cfg.prompt_min_length, cfg.prompt_max_length, (groups,)).repeat_interleave(cfg.group_size)
    # --- 2. completions and their loss mask ---
    completion_len = randint(cfg.completion_min_length, cfg.completion_max_length, (num_sequences,))
    lengths = prompt_len + completion_len
    seq_len = int(lengths.max())
    prompts = randint(0, vocab_size - 1, (groups, seq_len)).repeat_interleave(cfg.group_size, dim=0)
    completions = randint(0, vocab_size - 1, (num_sequences, seq_len))
    pos = torch.arange(seq_len).unsqueeze(0)
    in_prompt = pos < prompt_len.unsqueeze(1)
    in_sequence = pos < lengths.unsqueeze(1)
    tokens = torch.where(in_prompt, prompts, torch.where(in_sequence, completions, torch.zeros_like(completions)))
    loss_mask = in_sequence & ~in_prompt
    span = (completion_len.float() * cfg.tool_mask_fraction).floor().long()  # < completion length
    offset = 1 + (torch.rand(num_sequences, generator=gen) * (completion_len - span)).floor().long()  # in [1, len - span]
    span_start = prompt_len + offset
    in_tool = (pos >= span_start.unsqueeze(1)) & (pos < (span_start + span).unsqueeze(1))
    loss_mask = loss_mask & ~in_tool
    # --- 3. rewards ---
    good = (tokens < vocab_size // 2) & loss_mask
    rewards = good.sum(1).float() / loss_mask.sum(1).clamp(min=1).float()
    # --- 4. group-normalized advantages ---
    grouped = rewards.view(groups, cfg.group_size)
    advantages = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, unbiased=False, keepdim=True) + ADVANTAGE_STD_EPS)
    # --- 5. mismatch noise ---
    noise = torch.randn(num_sequences, seq_len, generator=gen) * cfg.mismatch_std
    noise = torch.where(loss_mask, noise, torch.zeros_like(noise))
    rollouts = Rollouts(tokens=tokens, lengths=lengths, loss_mask=loss_mask, advantages=advantages.reshape(-1))
    return SyntheticBatch(rollouts=rollouts, rewards=rewards, mismatch_noise=noise)
