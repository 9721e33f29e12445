"""The rows that carry loss, alone through the output layer: one gather of their hidden states, one scatter back.

In RL most positions of a micro-batch carry no loss — prompts, tool outputs, padding — yet an output layer
multiplies every position's hidden state by the whole (vocabulary-shard) weight, and a log-prob op then reads
every row of the logits, though a position outside the loss mask (target ``ignore_index``) gets log-prob 0 and no
gradient. :class:`LossRows` lets a caller run the output layer's GEMMs, the log-prob statistics and the backward on
the K loss rows only, and hand back full-size results:

- :func:`loss_rows`: the ``[K]`` int64 flat positions (ascending) of a loss mask. ``nonzero`` sizes its output
  from the data: on a GPU mask that is a host read, so a caller makes the rows once, at data preparation, from the
  mask while it is still on the host (``mp_grpo.megatron.prepare_micro_batch`` does), never in the micro-batch loop.
- :meth:`LossRows.gather`: the K rows of ``x`` (one ``index_select``); its backward writes the gradient of every
  other row as exactly 0 (one zero-filled buffer of ``x``'s size and one ``index_copy_`` of the K rows' gradient —
  no atomics, so bitwise deterministic). :meth:`LossRows.gather_sequence_major` does the same on Megatron's
  sequence-major ``[S, B, H]`` activations for batch-major positions.
- :meth:`LossRows.scatter`: ``[K]`` results back at their positions of the full token shape (one ``index_copy``
  into ``fill``: 0 where ``ignore_index`` rows get 0, see :meth:`LossRows.fill_outside`); backward reads the K
  rows' gradients (one ``index_select``).
- :meth:`LossRows.sampling_filter`: a sampling filter's per-row values at the rows.
- :meth:`LossRows.token_ids`: a per-token id list in CSR form (the rollout engine's captured support, its top-K ids)
  cut to the rows, with the positions of the kept entries, so that values computed per entry (the trainer's top-K
  log-probs) go back to the whole list (:meth:`LossRows.scatter_entries`). The kept entries' count sizes the cut
  list: on a GPU one host read per call (only micro-batches carrying such lists pay it).
- :meth:`LossRows.loss_fn`: a ``loss_fn`` for :func:`~mp_grpo.ops.fused_linear_loss.fused_linear_loss` run on the
  K rows that calls the caller's loss on the full-size log-probs (the loss maths stays defined once, on the
  micro-batch's own layout).

What the result is. A loss row's logits, log-prob, entropy and logits gradient are those of its own hidden state and
the weight: the same arithmetic as on all rows, except that the GEMMs run on K rows instead of N, and cuBLAS may
tile a GEMM of another shape differently (a logit can then differ by one rounding step of its dtype; on the CPU, at
the tests' sizes, they came out bitwise equal). The hidden-state gradient of every other row is exactly 0 — on the all-rows path it is
``0 @ W``, also exactly 0 — and the weight gradient sums the K rows' products, where the all-rows path also adds the
other rows' exact zeros (in another order: the same rounding, not the same bits). Under tensor parallelism every
rank of the group must select the same rows, as it already passes the same targets (the ops' collectives gather
``[K + 1, 4]`` statistics per rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from mp_grpo.ops.fused_linear_loss import LossFn
from mp_grpo.ops.sampling_filter import SamplingFilter
from mp_grpo.ops.token_ids import TokenIds


def loss_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[K]`` int64 ascending positions of ``loss_mask.reshape(-1)`` that are True (a bool tensor of any shape).

    A host read for a mask on a GPU (the count sizes the output): call it at data preparation."""
    if not isinstance(loss_mask, torch.Tensor) or loss_mask.dtype != torch.bool:
        got = loss_mask.dtype if isinstance(loss_mask, torch.Tensor) else type(loss_mask).__name__
        raise TypeError(f"loss_mask must be a bool tensor, got {got}")
    return loss_mask.reshape(-1).nonzero().reshape(-1)


class _GatherRows(torch.autograd.Function):
    """``x[rows]`` along dim 0; backward: a zero-filled gradient of ``x``'s shape with the K rows copied in."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.x_shape = x.shape
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.x_shape)  # every row outside `rows` written as 0
        return out.index_copy_(0, rows, grad), None


@dataclass(frozen=True)
class LossRows:
    """The K positions of a token-shaped micro-batch that carry loss (see the module docstring)."""

    index: torch.Tensor
    """``[K]`` int64 ascending flat positions of :attr:`shape` (batch-major: ``b·S + s`` for ``[B, S]``)."""
    shape: torch.Size
    """The full token shape the positions index, e.g. the targets' ``[B, S]``."""

    def __post_init__(self) -> None:
        if not isinstance(self.index, torch.Tensor) or self.index.dim() != 1 or self.index.dtype != torch.int64:
            got = f"{tuple(self.index.shape)} {self.index.dtype}" if isinstance(self.index, torch.Tensor) else type(self.index).__name__
            raise ValueError(f"loss rows: index must be a [K] int64 tensor of flat positions, got {got}")
        if self.index.numel() > self.numel:
            raise ValueError(f"loss rows: {self.index.numel()} rows for a token shape {tuple(self.shape)} of "
                             f"{self.numel} positions")

    @property
    def count(self) -> int:
        """K (the index's length: known on the host, no read of the device)."""
        return int(self.index.shape[0])

    @property
    def numel(self) -> int:
        """N, the positions of :attr:`shape`."""
        return math.prod(self.shape)

    @property
    def compact_shape(self) -> torch.Size:
        """``[1, K]``: the token shape of the rows alone (one packed row, as the ops take it)."""
        return torch.Size([1, self.count])

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[K, *rest]`` rows of ``x`` ``[*shape, *rest]`` (differentiable; every other row's gradient is 0)."""
        if x.shape[: len(self.shape)] != self.shape:
            raise ValueError(f"loss rows: x has shape {tuple(x.shape)}, expected [{', '.join(map(str, self.shape))}, ...]")
        return _GatherRows.apply(x.reshape(self.numel, *x.shape[len(self.shape):]), self.index)

    def gather_sequence_major(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of Megatron's sequence-major ``x`` ``[S, B, H]`` for this ``[B, S]`` shape: ``[K, H]`` in the
        rows' (batch-major) order, differentiable as :meth:`gather`. One integer pass over the K positions maps
        ``b·S + s`` to ``s·B + b`` (none for B = 1)."""
        if len(self.shape) != 2 or x.dim() != 3 or x.shape[:2] != (self.shape[1], self.shape[0]):
            raise ValueError(f"loss rows: the output layer's input has shape {tuple(x.shape)}, expected "
                             f"[S={self.shape[-1]}, B={self.shape[0]}, H] for the micro-batch's tokens {tuple(self.shape)}")
        b, s = self.shape
        index = self.index if b == 1 else (self.index % s) * b + self.index // s
        return _GatherRows.apply(x.reshape(s * b, x.shape[2]), index)

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, K]`` values of a token-shaped ``x`` (targets, per-row values) at the rows (no gradient)."""
        return x.reshape(-1).index_select(0, self.index).view(self.compact_shape)

    def fill_outside(self, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fill, missing)`` for :meth:`scatter`: ``fill`` ``[N]`` fp32 is 0 at every position, NaN at a trained
        position (``loss_mask``) the rows do not cover — so that such a position is never silently given log-prob
        0 —, and ``missing`` the 0-dim int64 count of those positions (for the caller's error ledger). No host read."""
        outside = loss_mask.reshape(-1).index_fill(0, self.index, False)
        fill = torch.where(outside, torch.full((), math.nan, device=outside.device),
                           torch.zeros((), device=outside.device))
        return fill, outside.sum()

    def scatter(self, values: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        """``[*shape]`` fp32: ``values`` (``K`` of them, any shape) at the rows, ``fill`` ``[N]`` elsewhere
        (differentiable w.r.t. ``values``: backward reads the rows' gradients)."""
        return fill.index_copy(0, self.index, values.reshape(-1).to(fill.dtype)).view(self.shape)

    def sampling_filter(self, filt: SamplingFilter | None) -> SamplingFilter | None:
        """``filt`` for the rows alone: per-row tensors (of :attr:`shape`) cut to ``[1, K]``, numbers kept."""
        if filt is None:
            return None
        values = {f.name: getattr(filt, f.name) for f in fields(filt)}
        return SamplingFilter(**{name: self.select(v) if isinstance(v, torch.Tensor) else v for name, v in values.items()})

    def token_ids(self, ids: TokenIds) -> tuple[TokenIds, torch.Tensor]:
        """``ids`` (CSR over the :attr:`shape`'s flat positions) cut to the rows — the same type, CSR over the K rows —
        and the ``[nnz_rows]`` int64 positions of its entries in ``ids.ids`` (for :meth:`scatter_entries`)."""
        counts = (ids.indptr[1:] - ids.indptr[:-1]).index_select(0, self.index)
        starts = ids.indptr[:-1].index_select(0, self.index)
        indptr = torch.cat([ids.indptr.new_zeros(1), counts.cumsum(0)])
        entry = torch.arange(int(indptr[-1]), device=indptr.device)  # the rows' entries' count: a host read on a GPU
        row = torch.searchsorted(indptr[1:], entry, right=True)
        positions = starts.index_select(0, row) + entry - indptr.index_select(0, row)
        return type(ids)(indptr, ids.ids.index_select(0, positions)), positions

    @staticmethod
    def scatter_entries(values: torch.Tensor, positions: torch.Tensor, nnz: int) -> torch.Tensor:
        """``[nnz]`` of the rows' per-entry ``values`` at ``positions`` (:meth:`token_ids`), 0 at the other rows'
        entries (positions that carry no loss; no gradient flows)."""
        return values.new_zeros(nnz).index_copy(0, positions, values)

    def loss_fn(self, loss_fn: LossFn, fill: torch.Tensor) -> LossFn:
        """A ``loss_fn`` of the rows' ``[1, K]`` log-probs and entropy that calls ``loss_fn`` on them scattered to
        :attr:`shape` (``fill`` elsewhere): :func:`~mp_grpo.ops.fused_linear_loss.fused_linear_loss` on the rows
        then differentiates the caller's loss through the scatter, i.e. reads its gradient at the rows."""

        def on_rows(logprobs: torch.Tensor, entropy: torch.Tensor | None, *top_k: torch.Tensor):
            return loss_fn(self.scatter(logprobs, fill), None if entropy is None else self.scatter(entropy, fill),
                           *top_k)

        return on_rows
