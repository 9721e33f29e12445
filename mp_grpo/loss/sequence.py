"""Which tokens of a micro-batch form one sequence, and the per-sequence sums of the loss.

Every sequence-level quantity of the loss (GSPO / GMPO ratios, sequence and geometric IS ratios, the
OPSM mean, the lengths of seq-mean aggregation, sequence counts) is a sum over the valid tokens of one
sequence. A :class:`SequenceLayout` says how to take those sums and how to spread a per-sequence value
back onto its tokens:

* :class:`PaddedSequences` — tokens ``[B, T]``, row ``b`` is sequence ``b`` (the default);
* :class:`PackedSequences` — tokens ``[T]`` or ``[1, T]`` (THD), segment ``i`` of ``cu_seqlens`` is
  sequence ``i``; the loss equals that of the same sequences padded into rows.

Context parallelism: with ``cp_group`` set, this rank holds only some tokens of every sequence (any split;
Megatron gives rank r the chunks r and 2·CP−1−r of every sequence or packed segment). The per-sequence
sums are then all-reduced over ``cp_group`` so every rank sees the value of the whole sequence, and the
loss equals that of CP = 1. That all-reduce is differentiable with an **all-reduce as its backward**
(:class:`SumOverGroup`): each CP rank's loss share depends on the reduced value, so the gradient of a
token's partial sum is the sum over the CP ranks of their shares' gradients — not the identity backward
of Megatron's ``reduce_from_tensor_model_parallel_region``, which is right only when one rank's copy of
the loss is used.

Positions outside every packed segment belong to no sequence and are never valid.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from mp_grpo.collectives import ProcessGroup, all_reduce_sum, group_rank, group_size


class SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over ``group``, differentiable: the backward all-reduces (sums) the gradient.

    Forward: ``y = Σ_r x_r`` on every rank. Each rank r then computes a loss share ``L_r(y)``, and the
    objective is ``Σ_r L_r``; so ``∂(Σ_r L_r)/∂x_q = Σ_r ∂L_r/∂y`` — the sum of every rank's incoming
    gradient, on every rank. Every rank of ``group`` must call backward through it (they do: they run the
    same loss graph).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce_sum(grad.contiguous(), ctx.group), None


def sum_over_group(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``x`` summed over ``group`` with :class:`SumOverGroup`; ``x`` itself for a group of size 1.

    A collective: GRPOLoss calls it between its (optionally compiled) stages, never inside one.
    """
    if group_size(group) == 1:
        return x
    return SumOverGroup.apply(x, group)


class SequenceLayout(ABC):
    """How the tokens of one micro-batch group into sequences (see the module docstring)."""

    def __init__(self, cp_group: ProcessGroup | None = None) -> None:
        self.cp_group = cp_group
        """Context-parallel group over which the tokens of every sequence are split; None: no CP."""

    @abstractmethod
    def check_tokens(self, shape: torch.Size, name: str) -> None:
        """Raise ValueError (naming ``name``) unless ``shape`` is a token shape of this layout."""

    @abstractmethod
    def num_sequences(self, token_shape: torch.Size) -> int:
        """Number of sequences of a micro-batch with tokens of ``token_shape`` (known on the host)."""

    @abstractmethod
    def local_seq_sum(self, x: torch.Tensor, token_shape: torch.Size) -> torch.Tensor:
        """``[S, *k]``: sums of ``x`` (``[*token_shape, *k]``) over this rank's tokens of each sequence.

        ``x`` must already be 0 where tokens are not valid. Differentiable.
        """

    @abstractmethod
    def broadcast(self, v: torch.Tensor, token_shape: torch.Size) -> torch.Tensor:
        """``[*token_shape, *k]``: each token gets the value of its sequence in ``v`` (``[S, *k]``)."""

    def in_sequence(self, token_shape: torch.Size, device: torch.device) -> torch.Tensor | None:
        """Bool mask of positions that belong to a sequence, or None when all do."""
        return None

    def is_per_sequence(self, shape: torch.Size, token_shape: torch.Size, name: str) -> bool:
        """Whether ``name`` (of ``shape``) holds one value per sequence ``[S]`` (True) or one per token
        (``token_shape``, False). ValueError when it is neither — or both: flat packed tokens ``[T]`` with as many
        sequences as tokens (T = S, e.g. empty segments under context parallelism), where a ``[T]`` tensor is
        ambiguous and no rule can tell which was meant; ``[1, T]`` tokens (Megatron's THD shape) never are."""
        per_sequence = torch.Size([self.num_sequences(token_shape)])
        if shape == token_shape and shape == per_sequence:
            raise ValueError(
                f"{name} has shape {tuple(shape)}: both one per sequence ({per_sequence[0]} sequences) and one per "
                f"token of these flat packed tokens {tuple(token_shape)}, which this layout cannot tell apart; give "
                f"the tokens as [1, T] (Megatron's THD shape): {name} is then [1, T] per token or [S] per sequence")
        if shape not in (token_shape, per_sequence):
            raise ValueError(f"{name} has shape {tuple(shape)}; expected one per sequence [{per_sequence[0]}] or one "
                             f"per token {tuple(token_shape)}")
        return shape == per_sequence

    def valid_tokens(self, loss_mask: torch.Tensor) -> torch.Tensor:
        """Bool: the loss mask is nonzero and the position belongs to a sequence."""
        valid = loss_mask != 0
        inside = self.in_sequence(loss_mask.shape, loss_mask.device)
        return valid if inside is None else valid & inside

    def seq_sum(self, x: torch.Tensor, token_shape: torch.Size) -> torch.Tensor:
        """``[S, *k]``: sums over the whole of each sequence (all CP ranks); differentiable (sum backward)."""
        return sum_over_group(self.local_seq_sum(x, token_shape), self.cp_group)

    @property
    def owns_sequences(self) -> bool:
        """Whether this rank counts per-sequence quantities (CP rank 0), so each sequence counts once."""
        return group_rank(self.cp_group) == 0


class PaddedSequences(SequenceLayout):
    """Tokens ``[B, T]``: row ``b`` is sequence ``b`` (this rank's tokens of it under context parallelism)."""

    def check_tokens(self, shape: torch.Size, name: str) -> None:
        if len(shape) != 2:
            raise ValueError(f"{name} must be [B, T] for padded sequences, got shape {tuple(shape)}")

    def num_sequences(self, token_shape: torch.Size) -> int:
        return int(token_shape[0])

    def local_seq_sum(self, x: torch.Tensor, token_shape: torch.Size) -> torch.Tensor:
        return x.sum(dim=1)

    def broadcast(self, v: torch.Tensor, token_shape: torch.Size) -> torch.Tensor:
        return v.unsqueeze(1).expand(token_shape[0], token_shape[1], *v.shape[1:])

    def __repr__(self) -> str:
        return f"PaddedSequences(cp_group={self.cp_group!r})"


class PackedSequences(SequenceLayout):
    """Tokens ``[T]`` or ``[1, T]`` (THD): positions ``[cu_seqlens[i], cu_seqlens[i+1])`` are sequence ``i``.

    ``cu_seqlens`` (``[S+1]`` integers, from 0, non-decreasing) are the boundaries *in this rank's token
    row*: under context parallelism, Megatron's ``cu_seqlens_padded / CP``. Padding inside a segment is
    part of its sequence and must be masked by the loss mask; positions at or after ``cu_seqlens[-1]``
    belong to no sequence and are never valid. ``cu_seqlens`` is validated when it lives on the CPU;
    on a GPU that would cost a host synchronization per micro-batch, so it is trusted.
    """

    def __init__(self, cu_seqlens: torch.Tensor, cp_group: ProcessGroup | None = None) -> None:
        super().__init__(cp_group)
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 \
                or cu_seqlens.dtype not in (torch.int32, torch.int64):
            got = f"shape {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}" if isinstance(cu_seqlens, torch.Tensor) \
                else type(cu_seqlens).__name__
            raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor [S+1], got {got}")
        if cu_seqlens.device.type == "cpu":
            if int(cu_seqlens[0]) != 0 or bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
                raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {cu_seqlens.tolist()}")
        self.cu_seqlens = cu_seqlens
        self._ids: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._cu_on: dict[torch.device, torch.Tensor] = {}

    def check_tokens(self, shape: torch.Size, name: str) -> None:
        if not (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)):
            raise ValueError(f"{name} must be [T] or [1, T] for packed sequences, got shape {tuple(shape)}")

    def num_sequences(self, token_shape: torch.Size) -> int:
        return int(self.cu_seqlens.numel()) - 1

    def cu_seqlens_on(self, device: torch.device) -> torch.Tensor:
        """``cu_seqlens`` on ``device`` (copied once per device, then cached)."""
        if self.cu_seqlens.device == device:
            return self.cu_seqlens
        if device not in self._cu_on:
            self._cu_on[device] = self.cu_seqlens.to(device)
        return self._cu_on[device]

    def _sequence_ids(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """``[T]`` int64: the sequence of every position, S for positions after the last segment."""
        key = (num_tokens, device)
        if key not in self._ids:
            bounds = self.cu_seqlens[1:].to(device=device, dtype=torch.int64)
            positions = torch.arange(num_tokens, device=device)
            self._ids[key] = torch.bucketize(positions, bounds, right=True)
        return self._ids[key]

    def in_sequence(self, token_shape: torch.Size, device: torch.device) -> torch.Tensor:
        ids = self._sequence_ids(int(token_shape[-1]), device)
        return (ids < self.num_sequences(token_shape)).view(token_shape)

    def local_seq_sum(self, x: torch.Tensor, token_shape: torch.Size) -> torch.Tensor:
        num_tokens = int(token_shape[-1])
        flat = x.reshape(num_tokens, *x.shape[len(token_shape):])
        ids = self._sequence_ids(num_tokens, x.device)
        out = flat.new_zeros((self.num_sequences(token_shape) + 1, *flat.shape[1:]))  # last row: no sequence
        return out.index_add(0, ids, flat)[:-1]

    def broadcast(self, v: torch.Tensor, token_shape: torch.Size) -> torch.Tensor:
        num_tokens = int(token_shape[-1])
        padded = torch.cat([v, v.new_zeros((1, *v.shape[1:]))])  # positions after the last segment read 0
        picked = padded.index_select(0, self._sequence_ids(num_tokens, v.device))
        return picked.view(*token_shape, *v.shape[1:])

    def __repr__(self) -> str:
        return f"PackedSequences(num_sequences={self.cu_seqlens.numel() - 1}, cp_group={self.cp_group!r})"
