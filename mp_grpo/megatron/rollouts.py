"""The rollout fields of B sequences, token-aligned and padded: what a rollout engine hands the trainer.

"Token-aligned": entry ``[b, s]`` of every per-token field describes token ``tokens[b, s]`` — its
log-prob given the tokens before it, whether it is trained on. The model's output at position s
predicts token s+1, so :mod:`mp_grpo.megatron.micro_batch` shifts these fields by one before the
loss sees them. Every rank of a data-parallel replica (all its TP and CP ranks) holds the same
:class:`Rollouts` of each micro-batch, as Megatron's data path gives every rank the whole micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class Rollouts:
    """Token-aligned rollout fields of B sequences padded to length S (see the module docstring)."""

    tokens: torch.Tensor
    """``[B, S]`` int64: prompt followed by completion; entries at or after ``lengths[b]`` are padding."""
    lengths: torch.Tensor
    """``[B]`` int64: tokens of each sequence (prompt + completion), 1 ≤ length ≤ S."""
    loss_mask: torch.Tensor
    """``[B, S]`` bool: the tokens trained on (sampled completion tokens; not prompts, tool outputs or padding).
    Token 0 has no prefix to predict it from, so it is never trained on."""
    advantages: torch.Tensor
    """``[B]`` (one per sequence) or ``[B, S]`` (token-aligned) float advantages."""
    rollout_logprobs: torch.Tensor | None = None
    """``[B, S]`` float: the rollout engine's log-prob of each token (needed by rollout correction)."""
    old_logprobs: torch.Tensor | None = None
    """``[B, S]`` float: the trainer's log-probs before the update; None = on-policy (the current ones, detached)."""
    ref_logprobs: torch.Tensor | None = None
    """``[B, S]`` float: the reference policy's log-probs (needed by a KL penalty)."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_sequences(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    def validate(self, vocab_size: int | None = None) -> None:
        """Shapes, dtypes and mask consistency; with ``vocab_size``, token ids too. Errors name the field."""
        t = self.tokens
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"rollouts.tokens must be an int64 [B, S] tensor, got {_describe(t)}")
        b, s = t.shape
        if not isinstance(self.lengths, torch.Tensor) or self.lengths.shape != (b,) or self.lengths.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"rollouts.lengths must be an int64 [B={b}] tensor, got {_describe(self.lengths)}")
        if bool((self.lengths < 1).any()) or bool((self.lengths > s).any()):
            raise ValueError(f"rollouts.lengths must lie in [1, S={s}], got {self.lengths.tolist()}")
        if not isinstance(self.loss_mask, torch.Tensor) or self.loss_mask.shape != (b, s) or self.loss_mask.dtype != torch.bool:
            raise ValueError(f"rollouts.loss_mask must be a bool [B={b}, S={s}] tensor, got {_describe(self.loss_mask)}")
        inside = torch.arange(s, device=t.device).unsqueeze(0) < self.lengths.to(t.device).unsqueeze(1)
        if bool((self.loss_mask & ~inside).any()):
            raise ValueError("rollouts.loss_mask is True at a padding position (at or after lengths[b])")
        if bool(self.loss_mask[:, 0].any()):
            raise ValueError("rollouts.loss_mask is True at token 0, which no prefix predicts; the first token is a prompt token")
        a = self.advantages
        if not isinstance(a, torch.Tensor) or a.dtype not in _FLOAT or a.shape not in ((b,), (b, s)):
            raise ValueError(f"rollouts.advantages must be a float [B={b}] or [B={b}, S={s}] tensor, got {_describe(a)}")
        for name in ("rollout_logprobs", "old_logprobs", "ref_logprobs"):
            x = getattr(self, name)
            if x is not None and (not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT or x.shape != (b, s)):
                raise ValueError(f"rollouts.{name} must be None or a float [B={b}, S={s}] tensor, got {_describe(x)}")
        if vocab_size is not None:
            valid = torch.where(inside, t, torch.zeros_like(t))
            if bool((valid < 0).any()) or bool((valid >= vocab_size).any()):
                raise ValueError(f"rollouts.tokens has ids outside [0, vocab_size={vocab_size}) inside the sequences")

    def select(self, index: torch.Tensor | slice) -> Rollouts:
        """The rollouts of the sequences ``index`` (rows), e.g. one micro-batch of a global batch."""
        return Rollouts(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index] for f in fields(self)})


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"shape {tuple(x.shape)} {x.dtype}"
    return type(x).__name__
