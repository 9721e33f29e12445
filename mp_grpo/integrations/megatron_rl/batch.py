"""One Megatron-LM RL micro-batch, and the loss's fields at this rank's logit positions.

What ``train_rl.py::forward_step`` reads from the data iterator (``RLMicroBatch``): token rows ``[B, S]``
(padded rows, or one packed bin ``[1, S]`` of sequences at ``seq_starts`` with lengths ``seq_lengths``) and the
loss-side fields at log-prob positions ``[B, S-1]`` — position t predicts token t+1 (``loss_mask`` already
``[:, 1:]``; old / reference / inference log-probs computed that way) — and per-sequence advantages.

Schedule of :func:`loss_inputs`

1. Every ``[B, S-1]`` field padded with one masked column to the logits' ``[B, S]`` positions; the target of
   position t is ``tokens[t+1]`` (``IGNORE_INDEX`` where not trained on, and at the last position).
2. Context parallelism: the positions this rank's logits hold — TE's THD partition that Megatron-LM gives the
   model's input (``_scatter_for_context_parallel``: every segment of ``cu_seqlens_padded``, the whole row when
   unpacked, cut into 2·CP chunks, rank r keeping chunks r and 2·CP−1−r;
   :func:`mp_grpo.megatron.context_parallel.thd_cp_positions`).
3. The loss's layout: padded rows (``PaddedSequences``), or the bin's slots as packed segments
   (``PackedSequences`` over ``cu_seqlens_padded / CP``; a slot holds one sequence then its padding, all masked
   but the sequence's trained tokens), with the CP group. Advantages per row / per slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from mp_grpo.collectives import ProcessGroup, group_rank, group_size
from mp_grpo.loss.sequence import PackedSequences, PaddedSequences, SequenceLayout
from mp_grpo.megatron.context_parallel import select_positions, thd_cp_positions

IGNORE_INDEX = -100
"""Target of positions without a trained token (the log-prob kernel gives them 0, with no gradient)."""


@dataclass(frozen=True)
class RLMicroBatch:
    """A micro-batch as Megatron-LM's RL data iterator gives it (after ``load_packed_data_by_index`` for bins)."""

    tokens: torch.Tensor
    """``[B, S]`` token ids (one packed bin: B = 1)."""
    position_ids: torch.Tensor
    """``[B, S]``."""
    advantages: torch.Tensor
    """``[B]`` per row, or ``[n]`` per sequence of the bin."""
    loss_mask: torch.Tensor
    """``[B, S-1]`` at log-prob positions (Megatron-LM's ``loss_mask[:, 1:]``)."""
    old_logprobs: torch.Tensor
    """``[B, S-1]``."""
    ref_logprobs: torch.Tensor | None = None
    """``[B, S-1]`` reference log-probs (the KL), or None."""
    inference_logprobs: torch.Tensor | None = None
    """``[B, S-1]`` the inference engine's log-probs (the IS correction), or None."""
    seq_starts: tuple[int, ...] | None = None
    """Packed bin: each sequence's start, then the padded end (Megatron-LM's ``packing_info.seq_starts[bin]``)."""
    seq_lengths: tuple[int, ...] | None = None
    """Packed bin: each sequence's length."""
    packed_seq_params: object | None = None
    """Megatron ``PackedSeqParams`` of the bin (its ``cu_seqlens_q_padded`` / ``cu_seqlens_q`` give the slots)."""

    @property
    def packed(self) -> bool:
        return self.seq_starts is not None


class LossInputs(NamedTuple):
    """The loss's fields at this rank's logit positions (module docstring)."""

    target: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None
    inference_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    layout: SequenceLayout
    positions: torch.Tensor | None
    """The row positions this CP rank holds (None without context parallelism)."""


def slot_boundaries(mb: RLMicroBatch) -> torch.Tensor:
    """``[n_slots + 1]`` int64 slot boundaries of a packed bin on the host: the bin's ``cu_seqlens_q_padded`` (or
    ``cu_seqlens_q``) when it has PackedSeqParams, else the sequences' starts and the bin's end."""
    row = mb.tokens.shape[1]
    params = mb.packed_seq_params
    cu = None
    if params is not None:
        cu = getattr(params, "cu_seqlens_q_padded", None)
        cu = getattr(params, "cu_seqlens_q", None) if cu is None else cu
    if cu is None:
        starts = list(mb.seq_starts or (0,))
        cu = torch.tensor(starts + ([row] if starts[-1] != row else []), dtype=torch.int64)
    cu = cu.to("cpu", torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != row:
        raise ValueError(f"the packed bin's boundaries {cu.tolist()} must run from 0 to its length {row}")
    return cu


def cp_row_positions(mb: RLMicroBatch, cp_group: ProcessGroup | None) -> torch.Tensor | None:
    """Step 2: the row positions this CP rank holds (None without context parallelism)."""
    cp = group_size(cp_group)
    if cp == 1:
        return None
    row = mb.tokens.shape[1]
    bounds = slot_boundaries(mb) if mb.packed else torch.tensor([0, row], dtype=torch.int64)
    return thd_cp_positions(bounds, cp, group_rank(cp_group)).to(mb.tokens.device)


def loss_inputs(mb: RLMicroBatch, cp_group: ProcessGroup | None) -> LossInputs:
    """The loss's fields of ``mb`` at this rank's logit positions (module docstring, steps 1–3)."""
    B, S = mb.tokens.shape
    for name in ("loss_mask", "old_logprobs", "ref_logprobs", "inference_logprobs"):
        x = getattr(mb, name)
        if x is not None and tuple(x.shape) != (B, S - 1):
            raise ValueError(f"{name} must be [B, S-1] = [{B}, {S - 1}] (log-prob positions), got {tuple(x.shape)}")
    device = mb.tokens.device

    # --- 1. pad the log-prob positions to the logits' S positions ---
    def pad(x: torch.Tensor | None, fill) -> torch.Tensor | None:
        return None if x is None else torch.cat([x, x.new_full((B, 1), fill)], dim=1)

    mask = pad(mb.loss_mask != 0, False)
    target = torch.where(mask, torch.cat([mb.tokens[:, 1:], mb.tokens[:, :1]], dim=1).long(),
                         torch.full((), IGNORE_INDEX, device=device))
    fields = [pad(x, 0.0) for x in (mb.old_logprobs, mb.ref_logprobs, mb.inference_logprobs)]
    # --- 2. this CP rank's positions ---
    positions = cp_row_positions(mb, cp_group)
    if positions is not None:
        mask, target = select_positions(mask, positions), select_positions(target, positions)
        fields = [None if x is None else select_positions(x, positions) for x in fields]
    # --- 3. the layout and the advantages per sequence ---
    cp = group_size(cp_group)
    if mb.packed:
        if B != 1:
            raise ValueError(f"a packed bin is one row, got tokens of shape {(B, S)}")
        bounds = slot_boundaries(mb)
        n_slots = bounds.numel() - 1
        advantages = torch.zeros(n_slots, dtype=torch.float64, device=device)
        n = len(mb.seq_lengths or ())
        if mb.advantages.numel() != n:
            raise ValueError(f"advantages has {mb.advantages.numel()} values for the bin's {n} sequences")
        starts = torch.tensor(list(mb.seq_starts[:n]) if n else [], dtype=torch.int64)  # type: ignore[index]
        slot = torch.bucketize(starts, bounds[1:], right=True)  # the slot each sequence starts
        advantages[slot.to(device)] = mb.advantages.to(device, torch.float64)
        layout: SequenceLayout = PackedSequences((bounds // cp).to(device), cp_group=cp_group)
        mask, target = mask.reshape(1, -1), target.reshape(1, -1)
    else:
        advantages = mb.advantages.reshape(B).to(torch.float64)
        layout = PaddedSequences(cp_group=cp_group)
    old, ref, inference = fields
    return LossInputs(target, mask, old, ref, inference, advantages, layout, positions)  # type: ignore[arg-type]
