"""GPTModel's final hidden states and output-layer weight, for the fused output path (``OutputPath.FUSED``).

megatron-core 0.16's GPTModel has no argument that returns the hidden states from the last pipeline
stage: ``forward`` runs the decoder (which ends with the final LayerNorm), then ``_postprocess`` calls
``self.output_layer(hidden_states, weight=output_weight, runtime_gather_output=...)`` — with
``output_weight = shared_embedding_or_output_weight()`` under ``share_embeddings_and_output_weights``,
else None (the layer's own weight) — and returns the logits transposed from ``[S, B, V_local]`` to
``[B, S, V_local]``. :func:`call_for_hidden_states` calls the model with that one call answered
differently: for the duration of the model call, the output layer's ``forward`` is replaced (an
instance attribute, removed again afterwards, also on an exception) by a function that

- records the weight it was called with (the layer's own, or the shared embedding weight GPTModel
  passes), so the fused op uses exactly the weight the logits path would, and
- returns its input after the input mapping of ``ColumnParallelLinear`` instead of the logits:
  sequence parallelism off: ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce
  of the gradient over TP backward); on: ``gather_from_sequence_parallel_region(...,
  tensor_parallel_output_grad=True)`` (all-gather of ``[S/TP, B, H]`` to ``[S, B, H]`` forward,
  reduce-scatter backward) — on the layer's own TP group. This is what turns the PARTIAL
  hidden-state gradient that :func:`mp_grpo.fused_linear_logprobs` returns on each TP rank into the
  true one, exactly as for the logits path's GEMM. The gradient reaching the mapping is made
  contiguous first: GPTModel's ``[S, B] -> [B, S]`` transpose hands back a transposed (non-contiguous)
  gradient, and megatron-core 0.16's ``copy_to_tensor_model_parallel_region`` all-reduces
  ``grad.contiguous()`` — a copy, then — and returns the unreduced ``grad``: without this the TP sum
  would be silently lost.

GPTModel then returns these hidden states as it would the logits, ``[B, S, H]`` (one transposed copy
of ``N·H`` elements; ``N·V_local`` for the logits), through every wrapper: DDP passes it on,
``Float16Module`` upcasts it to fp32 unless called with ``fp32_output=False``. The decoder, the final
LayerNorm, the wrappers and the schedule run unchanged; only the output GEMM is skipped.

Schedule of :func:`call_for_hidden_states`

1. Find the module that owns ``output_layer`` through the wrappers (``get_attr_wrapped_model``). None:
   not the last pipeline stage — call the model as it is (it returns the activations to send on).
2. Refuse what the fused path cannot reproduce: an output layer other than ``ColumnParallelLinear``,
   an output-layer bias added to the logits, deferred embedding weight-gradient computation.
3. Call the model with the output layer's ``forward`` replaced (see above; with ``rows``, the micro-batch's loss
   rows alone go on: :func:`_input_mapping`); it must be called exactly once (multi-token prediction calls it once
   per MTP layer and is not supported).
4. Return ``(hidden [B, S, H], OutputWeight)`` (with ``rows``: ``hidden [1, K, H]``).

Then :meth:`MegatronGRPO.loss_func <mp_grpo.megatron.MegatronGRPO.loss_func>` computes the loss from them
in one of two ways (:func:`loss_in_forward` decides, per micro-batch):

- the loss in forward (:func:`fused_output_loss` → :func:`mp_grpo.ops.fused_linear_loss.fused_linear_loss`):
  for a token-separable loss config (:func:`mp_grpo.loss.separable.token_separable`) without context
  parallelism, with gradients enabled — GRPOLoss, given the step's GlobalBatch, is the ``loss_fn`` whose
  gradient per row chunk is multiplied out right away: three GEMMs, no recompute;
- otherwise (sequence-level objectives, OPSM, bypass at sequence level, CP > 1, no-grad passes) the
  per-token op :func:`mp_grpo.fused_linear_logprobs` (recompute in backward: four GEMMs) then GRPOLoss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from mp_grpo.collectives import ProcessGroup, group_size
from mp_grpo.config.loss import LossConfig
from mp_grpo.config.precision import LogitDtype
from mp_grpo.loss.separable import token_separable
from mp_grpo.loss.sequence import SequenceLayout
from mp_grpo.megatron.main_grad import accumulates_into_main_grad
from mp_grpo.ops.checks import CheckInputs, check_main_grad
from mp_grpo.ops.fused_linear_loss import LossFn, fused_linear_loss_unchecked
from mp_grpo.ops.loss_rows import LossRows
from mp_grpo.ops.sampling_filter import SamplingFilter
from mp_grpo.ops.token_ids import CapturedSupport, TokenIds


@dataclass(frozen=True)
class OutputWeight:
    """The output layer's weight as the model used it in one forward pass."""

    weight: torch.Tensor
    """``[V_local, H]``: the weight the output layer was called with — its own, or the word-embedding
    weight GPTModel passes under ``share_embeddings_and_output_weights``."""
    accumulate_into_main_grad: bool
    """The weight gradient goes into ``weight.main_grad`` (:func:`~mp_grpo.megatron.main_grad.accumulates_into_main_grad`:
    the layer's gradient-accumulation fusion, or a weight under Megatron DDP)."""


def call_for_hidden_states(
    model: torch.nn.Module, *args, rows: LossRows | None = None, **kwargs
) -> tuple[torch.Tensor, OutputWeight | None]:
    """``model(*args, **kwargs)`` with its output layer returning its TP-mapped input instead of logits.

    Returns ``(hidden, output_weight)``: ``hidden`` is what the model returns in place of its logits —
    for GPTModel ``[B, S, H]``, the full (sequence-parallel-gathered) sequence on every TP rank; with ``rows``
    (the micro-batch's loss rows, :class:`~mp_grpo.ops.loss_rows.LossRows` of its ``[B, S]`` tokens) ``[1, K, H]``,
    those rows alone (:func:`_input_mapping`) — and ``output_weight`` the weight the output layer was called with.
    On a pipeline stage without an output layer, ``(the model's output, None)``. See the module docstring.
    """
    from megatron.core.utils import get_attr_wrapped_model

    # --- 1. the module that owns the output layer ---
    try:
        owner = get_attr_wrapped_model(model, "output_layer", return_model_obj=True)
    except RuntimeError:
        return model(*args, **kwargs), None  # not the last pipeline stage
    layer = owner.output_layer
    # --- 2. what the fused path cannot reproduce ---
    _check_supported(layer)
    # --- 3. one call of the output layer, answered with its mapped input ---
    calls: list[OutputWeight] = []

    # ColumnParallelLinear.forward's signature; runtime_gather_output does not apply: no logits to gather.
    def returns_its_input(input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        if calls:
            raise RuntimeError(
                "output_path=fused: the model called its output layer more than once in one forward pass "
                "(multi-token prediction?); the fused output path supports one output-layer call"
            )
        w = layer.weight if weight is None else weight
        calls.append(OutputWeight(w, accumulates_into_main_grad(layer, w)))
        return _input_mapping(layer, input_, rows), None

    with _forward_replaced(layer, returns_its_input):
        hidden = model(*args, **kwargs)
    if not calls:
        raise RuntimeError(
            "output_path=fused: the model's forward never called its output layer; the fused path needs a "
            "model that computes its logits with output_layer, as GPTModel does"
        )
    # --- 4. the hidden states and the weight ---
    return hidden, calls[0]


def _input_mapping(layer: torch.nn.Module, input_: torch.Tensor, rows: LossRows | None = None) -> torch.Tensor:
    """ColumnParallelLinear's mapping of its input: the full sequence forward, the TP-summed gradient backward.

    With ``rows`` only those rows go on, as a ``[K, 1, H]`` input in the rows' (batch-major) order, so that GPTModel's
    ``[S, B] -> [B, S]`` transpose hands back ``[1, K, H]`` without a copy: one ``index_select``
    (:meth:`LossRows.gather_sequence_major`), whose backward writes every other row's gradient as 0. Without sequence
    parallelism they are selected before the mapping, so that its backward all-reduce over TP carries K rows, not
    N; with it, after the all-gather of the sequence (each rank holds only its shard before it)."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region

    if layer.sequence_parallel:
        mapped = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=layer.tp_group)
        if rows is not None:
            mapped = rows.gather_sequence_major(mapped).unsqueeze(1)
    else:
        if rows is not None:
            input_ = rows.gather_sequence_major(input_).unsqueeze(1)
        mapped = copy_to_tensor_model_parallel_region(input_, group=layer.tp_group)
    return _ContiguousGradient.apply(mapped)


class _ContiguousGradient(torch.autograd.Function):
    """Identity forward; backward hands the mapping a contiguous gradient (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _check_supported(layer: torch.nn.Module) -> None:
    from megatron.core.tensor_parallel import ColumnParallelLinear

    if not isinstance(layer, ColumnParallelLinear):
        raise TypeError(
            "output_path=fused: the model's output_layer must be megatron-core's ColumnParallelLinear (as "
            f"GPTModel's is), whose input mapping the fused path reproduces; got {type(layer).__name__}"
        )
    if layer.bias is not None and not layer.skip_bias_add:
        raise ValueError(
            "output_path=fused: the model's output layer has a bias added to its logits, which the fused "
            "op does not compute (GPTModel's output layer has none); use output_path=logits"
        )
    if layer.config.defer_embedding_wgrad_compute:
        raise ValueError(
            "output_path=fused: config.defer_embedding_wgrad_compute defers the output layer's weight "
            "gradient to finalize_model_grads, but the fused op computes it in backward; turn it off"
        )


@contextlib.contextmanager
def _forward_replaced(module: torch.nn.Module, forward: Callable) -> Iterator[None]:
    """``module.forward`` is ``forward`` inside the block (an instance attribute); restored after, also on error."""
    previous = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


def loss_in_forward(config: LossConfig, layout: SequenceLayout) -> bool:
    """Whether the fused path computes this micro-batch's loss gradient in forward (see the module docstring).

    Token-separable configs only (a token's gradient must not read a per-sequence sum of current
    log-probs), without context parallelism (the loss is called once per row chunk, and under CP its
    per-sequence sums are collectives whose count must then match across CP ranks), and while gradients
    are enabled (a no-grad pass needs no gradient)."""
    return torch.is_grad_enabled() and token_separable(config) and group_size(layout.cp_group) == 1


def fused_output_loss(
    hidden: torch.Tensor,
    output_weight: OutputWeight,
    targets: torch.Tensor,
    loss_fn: LossFn,
    *,
    tp_group: ProcessGroup | None,
    inv_temperature: float,
    with_entropy: bool,
    ignore_index: int,
    sampling_filter: SamplingFilter | None,
    check_inputs: CheckInputs,
    logit_dtype: LogitDtype,
    captured_support: CapturedSupport | None = None,
    top_k_ids: TokenIds | None = None,
):
    """``(share, metrics)`` of ``loss_fn`` on the fused output layer, its gradient made in forward.

    ``loss_fn(logprobs, entropy) -> (share, metrics)`` is GRPOLoss bound to the micro-batch and the step's
    GlobalBatch; with ``top_k_ids`` it is called ``loss_fn(logprobs, entropy, top_k_logprobs)`` (the trainer's
    log-probs at the engine's top-K ids, :func:`mp_grpo.ops.fused_linear_loss.fused_linear_loss`). The weight
    gradient goes into ``main_grad`` when ``output_weight`` says so
    (:mod:`mp_grpo.megatron.main_grad`; only when a weight gradient is computed).
    The arguments are checked already by the caller, ``MegatronGRPO.loss_func`` (the micro-batch's boundary;
    ``weight.main_grad`` here, where the accumulation is decided): this runs
    :func:`~mp_grpo.ops.fused_linear_loss.fused_linear_loss_unchecked`."""
    weight = output_weight.weight
    accumulate = output_weight.accumulate_into_main_grad and weight.requires_grad
    if accumulate:
        check_main_grad(weight)
    return fused_linear_loss_unchecked(
        hidden, weight, targets, loss_fn, tp_group=tp_group, inv_temperature=inv_temperature,
        with_entropy=with_entropy, ignore_index=ignore_index, chunk_tokens=None, accumulate_into_main_grad=accumulate,
        sampling_filter=sampling_filter, check_inputs=check_inputs, logit_dtype=logit_dtype,
        captured_support=captured_support, top_k_ids=top_k_ids,
    )
