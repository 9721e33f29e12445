"""The lab's tiny policy, its rollout engine with a mismatch knob, and one step's rollouts.

- :class:`TinyPolicy`: a position-wise language model small enough for CPU experiments —
  ``logits_t = W · tanh(E_prompt[p] + E_token[x_{t-1}] + E_pos[t]) + b``. It has no attention, so a
  rollout step needs only the previous token; what matters here is that it has parameters, a gradient
  and a realistic (peaked) next-token distribution.
- :class:`RolloutEngine`: the "inference engine". It samples the completions and reports its own
  log-probs through a different numerics path from the trainer: a **bf16 copy** of the weights, one
  position at a time, plus the mismatch knob ``noise_std`` — Gaussian noise of that standard deviation on
  its logits (a stand-in for the kernels, batch-variant reductions and quantization of a real engine).
  At ``noise_std = 0`` only bf16 rounding separates it from the trainer.
- :func:`make_rollouts`: G completions per prompt sampled by the engine, lengths drawn uniformly in
  ``[min_length, max_length]`` (the engine's "EOS"), a verifiable reward (the fraction of completion
  tokens in the lower quarter of the vocabulary) and group-normalized advantages.

The trainer's log-probs are :func:`trainer_logprobs`: fp32 logits of the full sequence through
:func:`mp_grpo.vocab_parallel_logprobs` at TP = 1 (the Triton kernel; its interpreter on CPU).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

import mp_grpo

ADVANTAGE_STD_FLOOR = 1e-6
"""Floor of a group's reward standard deviation in the advantage (r − mean) / std: a group whose
completions all earned the same reward has std 0 and advantages exactly 0."""


@dataclass(frozen=True)
class PolicyShape:
    """Sizes of the tiny policy and of one step's rollouts."""

    vocab: int = 32
    """Vocabulary size V (token 0 .. V−1; BOS is the extra id V, never sampled)."""
    hidden: int = 32
    """Hidden width."""
    num_prompts: int = 8
    """Distinct prompts per step."""
    group_size: int = 8
    """Completions per prompt (G)."""
    min_length: int = 4
    """Shortest completion."""
    max_length: int = 16
    """Longest completion (T, the padded width)."""
    logit_scale: float = 3.0
    """Standard deviation of the output layer's initial weights times sqrt(hidden): > 1 makes the initial
    next-token distribution peaked, with low-probability tokens as in a real language model."""


class TinyPolicy(nn.Module):
    """``logits_t = out(tanh(prompt[p] + token[x_{t-1}] + position[t]))``; ``x_{-1}`` is BOS (id V)."""

    def __init__(self, shape: PolicyShape, generator: torch.Generator) -> None:
        super().__init__()
        self.shape = shape
        h = shape.hidden
        self.prompt = nn.Embedding(shape.num_prompts, h)
        self.token = nn.Embedding(shape.vocab + 1, h)
        self.position = nn.Embedding(shape.max_length, h)
        self.out = nn.Linear(h, shape.vocab)
        with torch.no_grad():
            for emb in (self.prompt, self.token, self.position):
                emb.weight.copy_(torch.randn(emb.weight.shape, generator=generator))
            self.out.weight.copy_(torch.randn(self.out.weight.shape, generator=generator) * shape.logit_scale / h**0.5)
            self.out.bias.zero_()

    def step_logits(self, prompts: torch.Tensor, previous: torch.Tensor, position: int) -> torch.Tensor:
        """Logits ``[B, V]`` of position ``position`` given the previous tokens ``[B]``."""
        pos = self.position.weight[position]
        return self.out(torch.tanh(self.prompt(prompts) + self.token(previous) + pos))

    def forward(self, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` of every position of the completions ``tokens`` ``[B, T]`` (teacher forcing)."""
        bos = torch.full_like(tokens[:, :1], self.shape.vocab)
        previous = torch.cat([bos, tokens[:, :-1]], dim=1)
        pos = self.position.weight[: tokens.shape[1]]
        return self.out(torch.tanh(self.prompt(prompts)[:, None, :] + self.token(previous) + pos))


class RolloutEngine:
    """Samples completions with a bf16 copy of the policy plus logit noise ``noise_std`` (the mismatch knob)."""

    def __init__(self, policy: TinyPolicy, noise_std: float) -> None:
        if noise_std < 0:
            raise ValueError(f"noise_std must be ≥ 0, got {noise_std}")
        self.model = copy.deepcopy(policy).to(torch.bfloat16).requires_grad_(False)
        self.noise_std = noise_std

    @torch.no_grad()
    def sample(self, prompts: torch.Tensor, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens`` ``[B, length]`` and the engine's log-probs of them (fp32), one position at a time."""
        previous = torch.full_like(prompts, self.model.shape.vocab)
        tokens, logprobs = [], []
        for t in range(length):
            logits = self.model.step_logits(prompts, previous, t).float()
            noise = torch.randn(logits.shape, generator=generator)
            logp = torch.log_softmax(logits + self.noise_std * noise, dim=-1)
            token = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
            tokens.append(token)
            logprobs.append(logp.gather(-1, token[:, None])[:, 0])
            previous = token
        return torch.stack(tokens, 1), torch.stack(logprobs, 1)


@dataclass
class Rollouts:
    """One step's completions, ``B = num_prompts · group_size`` rows, padded to ``max_length``."""

    prompts: torch.Tensor
    """``[B]`` prompt ids."""
    tokens: torch.Tensor
    """``[B, T]`` sampled tokens (0 after the completion's end)."""
    loss_mask: torch.Tensor
    """``[B, T]`` bool, True on completion tokens."""
    rollout_logprobs: torch.Tensor
    """``[B, T]`` the engine's log-probs of the tokens (0 after the end)."""
    rewards: torch.Tensor
    """``[B]`` verifiable reward in [0, 1]."""
    advantages: torch.Tensor
    """``[B]`` group-normalized rewards."""

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` completion lengths."""
        return self.loss_mask.sum(1)


def reward(tokens: torch.Tensor, loss_mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Fraction of each completion's tokens whose id is in the lower quarter of the vocabulary."""
    hits = torch.where(loss_mask, tokens < vocab // 4, torch.zeros_like(loss_mask))
    return hits.sum(1).double() / loss_mask.sum(1).clamp(min=1).double()


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(r − group mean) / max(group std, :data:`ADVANTAGE_STD_FLOOR`), fp32."""
    grouped = rewards.view(-1, group_size)
    centered = grouped - grouped.mean(1, keepdim=True)
    std = grouped.std(1, keepdim=True).clamp(min=ADVANTAGE_STD_FLOOR)
    return (centered / std).reshape(-1).float()


def make_rollouts(policy: TinyPolicy, engine: RolloutEngine, generator: torch.Generator) -> Rollouts:
    """Sample one step: every prompt ``group_size`` times, lengths uniform in [min_length, max_length]."""
    s = policy.shape
    prompts = torch.arange(s.num_prompts).repeat_interleave(s.group_size)
    tokens, logprobs = engine.sample(prompts, s.max_length, generator)
    lengths = torch.randint(s.min_length, s.max_length + 1, (prompts.numel(),), generator=generator)
    mask = torch.arange(s.max_length)[None, :] < lengths[:, None]
    tokens = torch.where(mask, tokens, torch.zeros_like(tokens))
    logprobs = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    rewards = reward(tokens, mask, s.vocab)
    return Rollouts(prompts, tokens, mask, logprobs, rewards, group_advantages(rewards, s.group_size))


def trainer_logprobs(policy: TinyPolicy, rollouts: Rollouts) -> torch.Tensor:
    """log π_θ of the sampled tokens ``[B, T]``: fp32 logits through :func:`mp_grpo.vocab_parallel_logprobs`."""
    logits = policy(rollouts.prompts, rollouts.tokens)
    return mp_grpo.vocab_parallel_logprobs(logits, rollouts.tokens)
