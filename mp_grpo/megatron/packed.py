"""Packed (THD) sequences: B variable-length sequences laid end to end in one ``[1, T]`` row.

Megatron's THD format describes a packed row by ``cu_seqlens`` (cumulative real lengths) and
``cu_seqlens_padded`` (cumulative lengths after padding each segment — to a multiple of 2·CP under
context parallelism, so that every segment splits into 2·CP equal chunks). Attention never crosses a
segment boundary, positions restart at 0 in every segment, and every per-sequence quantity of the
loss is taken per segment.

:class:`PackedLayout` holds the boundaries and moves per-token fields between the padded
``[B, S, ...]`` layout and the packed ``[T, ...]`` layout (and back), one ``index_select`` each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is ≥ ``n``."""
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class PackedLayout:
    """Where each of B sequences lies in a packed row of ``total`` tokens."""

    lengths: torch.Tensor
    """``[B]`` int64 real lengths (tokens of each sequence, before padding)."""
    padded_lengths: torch.Tensor
    """``[B]`` int64 segment lengths in the packed row (≥ ``lengths``; padding at each segment's end)."""

    @classmethod
    def build(cls, lengths: torch.Tensor, *, segment_multiple: int = 1, total_multiple: int | None = None) -> PackedLayout:
        """Segments padded to a multiple of ``segment_multiple`` (2·CP under context parallelism); the last one
        padded further (by multiples of ``segment_multiple``) until the row length is a multiple of ``total_multiple``
        (e.g. 2·CP·TP with sequence parallelism, whose local row must split evenly over TP ranks); None: ``segment_multiple``."""
        total_multiple = segment_multiple if total_multiple is None else total_multiple
        if lengths.dim() != 1 or lengths.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"lengths must be a 1-D integer tensor, got shape {tuple(lengths.shape)} {lengths.dtype}")
        if lengths.numel() == 0:
            raise ValueError("lengths must hold at least one sequence")
        if bool((lengths < 1).any()):
            raise ValueError(f"lengths must all be ≥ 1, got {lengths.tolist()}")
        if total_multiple % segment_multiple:
            raise ValueError(f"total_multiple ({total_multiple}) must be a multiple of segment_multiple ({segment_multiple})")
        lengths = lengths.to(torch.int64)
        padded = -(-lengths // segment_multiple) * segment_multiple
        padded[-1] += round_up(int(padded.sum()), total_multiple) - int(padded.sum())
        return cls(lengths=lengths, padded_lengths=padded)

    @property
    def num_sequences(self) -> int:
        return int(self.lengths.numel())

    @property
    def total(self) -> int:
        """Length T of the packed row, padding included."""
        return int(self.padded_lengths.sum())

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """``[B+1]`` int32 cumulative real lengths (Megatron / TE ``cu_seqlens``)."""
        return _cumulative(self.lengths)

    @property
    def cu_seqlens_padded(self) -> torch.Tensor:
        """``[B+1]`` int32 segment boundaries in the packed row (``cu_seqlens_padded``)."""
        return _cumulative(self.padded_lengths)

    @property
    def max_seqlen(self) -> int:
        return int(self.padded_lengths.max())

    def _gather_index(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For each packed position: the source row and column in a ``[B, seq_len]`` tensor, and validity."""
        if int(self.lengths.max()) > seq_len:
            raise ValueError(f"lengths (max {int(self.lengths.max())}) exceed the padded sequence length {seq_len}")
        starts = self.cu_seqlens_padded[:-1].to(torch.int64)
        row = torch.repeat_interleave(torch.arange(self.num_sequences), self.padded_lengths)
        col = torch.arange(self.total) - starts[row]
        valid = col < self.lengths[row]
        return row, torch.where(valid, col, torch.zeros_like(col)), valid

    def pack(self, x: torch.Tensor, fill: float | int | bool) -> torch.Tensor:
        """``[B, S, ...]`` → ``[T, ...]``: each sequence's first ``length`` entries, segment padding set to ``fill``."""
        if x.dim() < 2 or x.shape[0] != self.num_sequences:
            raise ValueError(f"expected a [B={self.num_sequences}, S, ...] tensor to pack, got shape {tuple(x.shape)}")
        row, col, valid = self._gather_index(x.shape[1])
        row, col, valid = row.to(x.device), col.to(x.device), valid.to(x.device)
        picked = x[row, col]
        valid = valid.view(-1, *([1] * (picked.dim() - 1)))
        return torch.where(valid, picked, torch.full((), fill, dtype=x.dtype, device=x.device))

    def unpack(self, x: torch.Tensor, seq_len: int, fill: float | int | bool) -> torch.Tensor:
        """``[T, ...]`` → ``[B, seq_len, ...]``: the inverse of :meth:`pack`, positions past a length set to ``fill``."""
        if x.shape[0] != self.total:
            raise ValueError(f"expected a packed [T={self.total}, ...] tensor, got shape {tuple(x.shape)}")
        row, col, valid = self._gather_index(seq_len)
        out = torch.full((self.num_sequences, seq_len, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
        valid = valid.to(x.device)
        out[row[valid].to(x.device), col[valid].to(x.device)] = x[valid]
        return out


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)


def packed_seq_params(layout: PackedLayout, device: torch.device | None = None):
    """Megatron's ``PackedSeqParams`` (``qkv_format="thd"``) for a packed row built with ``layout``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu, cu_padded = layout.cu_seqlens.to(device), layout.cu_seqlens_padded.to(device)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=layout.max_seqlen,
        max_seqlen_kv=layout.max_seqlen,
    )
