"""The model output of a micro-batch's loss rows alone (``OutputRows.LOSS``): what the log-prob ops run on, and back.

With ``OutputRows.LOSS`` :meth:`MegatronGRPO.call_model <mp_grpo.megatron.MegatronGRPO.call_model>` hands GPTModel's
output layer the micro-batch's loss rows (:attr:`MicroBatch.loss_rows <mp_grpo.megatron.MicroBatch.loss_rows>`)
and the model returns their output alone, ``[1, K, H]`` hidden states (fused path) or ``[1, K, V_local]`` logits.
:func:`rows_output` turns that into what the ops take — the rows' targets ``[1, K]`` and sampling filter — and
scatters the ops' ``[1, K]`` log-probs and entropy back to the micro-batch's token shape, so that GRPOLoss, the
metrics and the forward-only pass see full-size tensors, as on every row.

Schedule of :func:`rows_output`

1. Which output: ``[1, K, X]``, the rows alone (what ``call_model`` makes); or ``[*targets, X]``, every row — a
   caller's own output, or the model's own output layer where the logits path cannot compute it (``call_for_logits``,
   step 1). Every row's hidden states: the fused path selects the rows' (one ``index_select``, whose backward writes
   every other row's gradient as 0), so that its GEMMs still run on K rows. Every row's logits exist already: the
   logits path reads them all (:attr:`RowsOutput.every_row`), and only the rows' results are kept, so that the
   results are the same whichever output the model made: outside the rows, 0.
2. The fill of the other positions: 0 (what a target ``ignore_index`` gets on every row), NaN at a trained position
   the rows do not cover — a MicroBatch whose loss mask was replaced by a larger one after its rows were made —,
   whose count goes to the error ledger (:func:`mp_grpo.ops.checks.record_errors`: raised at once on the CPU, at the
   next ``mp_grpo.check_errors()`` on a GPU; no host read).
3. The rows' targets and sampling filter (per-row values cut to the rows): one ``index_select`` each; the rollout
   engine's captured support and top-K ids (CSR) cut to the rows too (:meth:`LossRows.token_ids`: one host read of
   the kept entries' count on a GPU), the trainer's top-K log-probs scattered back to the micro-batch's whole list.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mp_grpo.config.job import OutputPath
from mp_grpo.megatron.micro_batch import MicroBatch
from mp_grpo.ops.checks import CheckInputs, record_errors
from mp_grpo.ops.loss_rows import LossFn, LossRows
from mp_grpo.ops.sampling_filter import SamplingFilter
from mp_grpo.ops.token_ids import CapturedSupport, TokenIds


@dataclass(frozen=True)
class RowsOutput:
    """A micro-batch's model output at its loss rows alone, with the rows' targets and how to scatter results back."""

    x: torch.Tensor
    """``[1, K, X]``: the rows' hidden states (fused path) or logits (logits path); with :attr:`every_row` every
    row's logits, ``[*targets, V_local]``."""
    rows: LossRows
    """The rows, as positions of the micro-batch's targets."""
    targets: torch.Tensor
    """``[1, K]`` the rows' targets (with :attr:`every_row`: the micro-batch's)."""
    sampling_filter: SamplingFilter | None
    """The micro-batch's sampling filter at the rows (per-row values cut to ``[1, K]``; with :attr:`every_row` as
    it is)."""
    fill: torch.Tensor
    """``[N]`` fp32, what every other position gets: 0, NaN at a trained position outside the rows (step 2)."""
    every_row: bool = False
    """:attr:`x` holds every row's logits (step 1): the ops' results are of every row, and :meth:`scatter` keeps
    the rows'."""
    captured_support: CapturedSupport | None = None
    """The micro-batch's captured support at the rows (CSR over the K rows; with :attr:`every_row` as it is)."""
    top_k_ids: TokenIds | None = None
    """The micro-batch's rollout top-K ids at the rows (CSR over the K rows; with :attr:`every_row` as they are)."""
    top_k_positions: torch.Tensor | None = None
    """``[nnz_rows]``: where :attr:`top_k_ids`' entries stand in the micro-batch's list (None: the same list)."""
    top_k_nnz: int = 0
    """The micro-batch's top-K entries (its list's length)."""

    def scatter(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """The ops' results on :attr:`x` as the micro-batch's ``[*targets]``: the rows' values, ``fill`` elsewhere
        (differentiable)."""
        if values is None:
            return None
        return self.rows.scatter(self.rows.select(values) if self.every_row else values, self.fill)

    def scatter_top_k(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """The ops' top-K log-probs on :attr:`top_k_ids` as the micro-batch's ``[nnz]`` list (0 at the entries of the
        positions outside the rows, which carry no loss)."""
        if values is None or self.top_k_positions is None:
            return values
        return LossRows.scatter_entries(values, self.top_k_positions, self.top_k_nnz)

    def loss_fn(self, loss_fn: LossFn) -> LossFn:
        """``loss_fn`` of full-size log-probs (and top-K log-probs) as a loss of the rows' (the fused op's ``loss_fn``)."""

        def with_top_k(logprobs: torch.Tensor, entropy: torch.Tensor | None, *top_k: torch.Tensor):
            return loss_fn(logprobs, entropy, *(self.scatter_top_k(t) for t in top_k))

        return self.rows.loss_fn(with_top_k, self.fill)


def rows_output(
    x: torch.Tensor, mb: MicroBatch, rows: LossRows | None, output_path: OutputPath, check_inputs: CheckInputs
) -> RowsOutput | None:
    """The checked model output ``x`` at ``mb``'s loss rows, or None to run on every row (see the module docstring).

    ``rows`` is None under ``OutputRows.ALL``; ``x`` passed :func:`~mp_grpo.megatron.output_checks.checked_output`
    (``[*targets, X]`` or, with rows, ``[1, K, X]``)."""
    if rows is None:
        return None
    # --- 1. the rows' output: as the model made it, or selected from every row's ---
    every_row = x.shape[:-1] == mb.targets.shape and output_path == OutputPath.LOGITS  # the logits exist already
    if x.shape[:-1] == mb.targets.shape and not every_row:
        x = rows.gather(x).unsqueeze(0)
    # --- 2. the other positions: 0, NaN at a trained position the rows miss (counted) ---
    fill, missing = rows.fill_outside(mb.loss_mask)
    record_errors("loss_mask outside loss_rows", missing, _missing_message(mb), mode=check_inputs)
    # --- 3. the rows' targets, sampling filter, captured support and top-K ids ---
    top_k_ids = None if mb.rollout_top_k is None else mb.rollout_top_k.ids
    if every_row:
        return RowsOutput(x, rows, mb.targets, mb.sampling_filter, fill, every_row=True,
                          captured_support=mb.captured_support, top_k_ids=top_k_ids)
    support = None if mb.captured_support is None else rows.token_ids(mb.captured_support)[0]
    positions, nnz = None, 0
    if top_k_ids is not None:
        nnz = top_k_ids.nnz
        top_k_ids, positions = rows.token_ids(top_k_ids)
    return RowsOutput(x, rows, rows.select(mb.targets), rows.sampling_filter(mb.sampling_filter), fill,
                      captured_support=support, top_k_ids=top_k_ids, top_k_positions=positions, top_k_nnz=nnz)


def _missing_message(mb: MicroBatch):
    shape = tuple(mb.targets.shape)

    def message(n: int) -> str:
        return (f"mb.loss_rows: {n} trained position(s) of the micro-batch's loss_mask {shape} are not among its "
                f"{mb.loss_rows.shape[0]} loss rows (the mask was replaced by a larger one after the MicroBatch was "
                "made?); their log-probs are NaN. Make the MicroBatch again (dataclasses.replace(mb, loss_mask=..., "
                "loss_rows=None)) or use output_rows=OutputRows.ALL")

    return message
