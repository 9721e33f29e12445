"""Per-token id lists (CSR, vLLM's layout) cut as a micro-batch's per-token loss fields are cut.

The rollout engine returns, per generated token, its captured support or its top-K ids (and their log-probs): a CSR
over the rollout's tokens, token-aligned like :class:`~mp_grpo.megatron.rollouts.Rollouts`' fields — row-major over
``[num_sequences, S]`` (``S`` any width that holds every sequence; a prompt or padding token has no entries). The
loss needs them per logit position of this rank: :func:`lay_out_csr` moves each token's entries to the logit that
predicts it, lays the rows out (padded or packed) and keeps this CP rank's positions — what
:meth:`~mp_grpo.megatron.micro_batch.TokenLayout.target_field` does to a dense field, done on the row pointer.

Schedule of :func:`lay_out_csr`

1. The source token of every local position: ``target_field`` of the token index ``[num_sequences, S]`` (-1 where
   no token: a sequence's last position, padding).
2. The local counts (0 at -1) and their running sum: the local ``indptr``; its last entry (the local ``nnz``) read
   on the host once — the output's size (a micro-batch is made while the data is prepared, before the step).
3. Each local entry's source entry: its source token's first entry plus its place among the token's entries; the
   ids (and any values aligned with them, the engine's log-probs) gathered there.
"""

from __future__ import annotations

import torch


def lay_out_csr(layout, indptr: torch.Tensor, num_sequences: int, name: str,
                *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(local indptr, *values at the local entries)`` of a CSR over the rollout's tokens ``[num_sequences, S]``
    (``indptr`` ``[num_sequences · S + 1]`` int64; ``values`` ``[nnz]`` tensors aligned with its entries — the ids,
    and the engine's log-probs), cut by ``layout`` (a :class:`~mp_grpo.megatron.micro_batch.TokenLayout`) to this
    rank's logit positions, row-major over the local targets. ``name`` names the argument in errors."""
    tokens = indptr.numel() - 1
    if num_sequences < 1 or tokens % num_sequences:
        raise ValueError(f"{name}.indptr has {indptr.numel()} entries: a CSR over the micro-batch's "
                         f"{num_sequences} sequences × S token-aligned positions needs num_sequences · S + 1")
    seq_len = tokens // num_sequences
    device = indptr.device
    # --- 1. the source token of every local position (-1: none) ---
    source_token = layout.target_field(torch.arange(tokens, device=device).view(num_sequences, seq_len), -1).reshape(-1)
    has_token = source_token >= 0
    first = indptr[:-1][source_token.clamp(min=0)]
    # --- 2. the local counts and row pointer ---
    counts = torch.where(has_token, indptr[1:][source_token.clamp(min=0)] - first, 0).clamp(min=0)
    local_indptr = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), counts.cumsum(0)])
    nnz = int(local_indptr[-1])
    # --- 3. each local entry's source entry ---
    row = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts, output_size=nnz)
    source = first[row] + torch.arange(nnz, device=device) - local_indptr[row]
    return (local_indptr, *(v[source] for v in values))
