"""Megatron's context-parallel sequence layout: 2·CP chunks, rank r holds chunks r and 2·CP−1−r.

Causal attention makes late chunks costlier than early ones, so Megatron cuts every sequence into
``2·CP`` equal chunks and gives rank r the pair ``(r, 2·CP−1−r)`` (``get_batch_on_this_cp_rank``
for the padded ``[B, S]`` layout; Transformer Engine's ``thd_get_partitioned_indices`` applies the
same rule to every packed segment of a THD batch). Here the same selection is written as index
tensors, so that every per-token rollout field is cut exactly like the model's input.

Target shifting: the target of position ``s`` is token ``s+1``. At the end of chunk r that token
lives in chunk r+1, usually on another rank. Shifting therefore happens on the whole sequence
*before* the split (:func:`mp_grpo.megatron.micro_batch.prepare_micro_batch` does it), never on a
rank's local chunks — the same order Megatron's GPT data path uses (labels are made, then both
tokens and labels are split).
"""

from __future__ import annotations

import torch


def cp_positions(seq_len: int, cp_size: int, cp_rank: int, *, device: torch.device | None = None) -> torch.Tensor:
    """Positions ``[2·seq_len/(2·CP)]`` (int64) of a length-``seq_len`` sequence held by ``cp_rank``.

    Chunk ``cp_rank`` followed by chunk ``2·CP−1−cp_rank``; ``seq_len`` must be a multiple of 2·CP.
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must lie in [0, cp_size); got cp_rank={cp_rank}, cp_size={cp_size}")
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"seq_len ({seq_len}) must be a multiple of 2·cp_size ({2 * cp_size}) for Megatron's context-parallel "
            "layout; pad the sequences (prepare_micro_batch does)"
        )
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    second = torch.arange(second_start, second_start + chunk, device=device)
    return torch.cat([first, second])


def thd_cp_positions(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions in a packed ``[T]`` batch held by ``cp_rank``: each segment split as :func:`cp_positions`.

    ``cu_seqlens_padded`` ``[n+1]``: segment boundaries, every segment's length a multiple of 2·CP.
    Segments stay in order, so the local batch is again packed, with boundaries ``cu_seqlens_padded / CP``.
    """
    bounds = [int(v) for v in cu_seqlens_padded.tolist()]
    pieces = [
        start + cp_positions(end - start, cp_size, cp_rank, device=cu_seqlens_padded.device)
        for start, end in zip(bounds[:-1], bounds[1:])
    ]
    if not pieces:
        return torch.zeros(0, dtype=torch.int64, device=cu_seqlens_padded.device)
    return torch.cat(pieces)


def select_positions(x: torch.Tensor, positions: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
    """``x`` restricted to ``positions`` along ``seq_dim`` (a new tensor; ``x`` is not modified)."""
    return x.index_select(seq_dim, positions)
