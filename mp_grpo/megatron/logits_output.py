"""GPTModel's vocab-parallel logits (logits output path) without the ``[tokens, V_local]`` transposed copies.

GPTModel computes its logits sequence-major, ``[S, B, V_local]``, and returns
``logits.transpose(0, 1).contiguous()``: for B > 1 a copy of every logit, and in backward megatron-core's
linear layer makes the transposed gradient contiguous again (twice). :func:`call_for_logits` calls the
model with its output layer's ``forward`` answered by :func:`mp_grpo.ops.batch_major_linear.batch_major_linear`
— the same GEMMs, the logits written batch-major — so GPTModel's transpose is already contiguous and
none of the three copies is made; the logits path then holds one ``[N, V_local]`` buffer (with
``inplace_backward``, the loss's gradient goes into it) where it held two at its peak.

The replacement is the one :mod:`mp_grpo.megatron.fused_output` makes for the fused path (an instance
attribute for the duration of the call, removed afterwards, also on an exception), with the layer's
input mapping reproduced the same way (TP all-reduce of the input gradient, or the sequence-parallel
all-gather / reduce-scatter), and the weight the model passes (tied embeddings) or the layer's own.
The weight gradient is added into ``weight.main_grad`` under the layer's gradient-accumulation fusion, as
Megatron's layer adds it, and also for a weight under Megatron DDP without it (:mod:`.main_grad`: a tied
weight's gradient is not held to the end of backward).

Schedule of :func:`call_for_logits`

1. Find the module that owns ``output_layer`` (``get_attr_wrapped_model``). None (not the last pipeline
   stage), or an output layer this cannot reproduce — not ``ColumnParallelLinear``, a bias,
   ``gather_output``, ``disable_grad_reduce``, deferred embedding weight-gradient computation: call the
   model as it is (same values, the copies made as before).
2. Call the model with the output layer's ``forward`` replaced: input mapping (with ``rows``: the loss rows
   alone, one ``index_select``), then :func:`~mp_grpo.ops.batch_major_linear.batch_major_linear`. A second call of
   the layer in one forward (multi-token prediction) raises.
3. Return what the model returns: ``[B, S, V_local]`` logits (with ``rows``: ``[1, K, V_local]``), contiguous,
   through every wrapper
   (``Float16Module`` upcasts them to fp32 unless called with ``fp32_output=False``; with ``logit_dtype=FP32``
   they are fp32 already — the GEMM's accumulator, not an upcast of rounded values).
"""

from __future__ import annotations

import torch

from mp_grpo.config.precision import LogitDtype
from mp_grpo.megatron.fused_output import _forward_replaced, _input_mapping
from mp_grpo.megatron.main_grad import accumulates_into_main_grad
from mp_grpo.ops.batch_major_linear import batch_major_linear
from mp_grpo.ops.loss_rows import LossRows


def call_for_logits(
    model: torch.nn.Module, *args, logit_dtype: LogitDtype = LogitDtype.BF16, rows: LossRows | None = None, **kwargs
) -> torch.Tensor:
    """``model(*args, **kwargs)`` with the output layer writing its logits batch-major (see the module docstring),
    in ``logit_dtype`` (:class:`~mp_grpo.config.precision.LogitDtype`: ``FP32``, the GEMM's fp32 accumulator).

    ``rows`` (the micro-batch's loss rows, :class:`~mp_grpo.ops.loss_rows.LossRows` of its ``[B, S]`` tokens): the
    GEMM runs on those rows alone and the model returns ``[1, K, V_local]`` logits
    (:func:`~mp_grpo.megatron.fused_output._input_mapping` selects them). An output layer this does not compute itself
    (step 1) runs as it is, on every row: the model then returns ``[B, S, V_local]``."""
    from megatron.core.utils import get_attr_wrapped_model

    # --- 1. the output layer, if it is one this reproduces ---
    try:
        owner = get_attr_wrapped_model(model, "output_layer", return_model_obj=True)
    except RuntimeError:
        return model(*args, **kwargs)  # not the last pipeline stage
    layer = owner.output_layer
    if not reproducible(layer):
        if logit_dtype is LogitDtype.FP32:  # the model's own layer would round them to its dtype
            raise ValueError(
                f"logit_dtype=fp32: the model's output layer ({type(layer).__name__}) is not one the logits path "
                "computes itself (a ColumnParallelLinear without bias, gather_output, disable_grad_reduce or "
                "deferred embedding wgrad), so its logits would be rounded to the model's dtype; use "
                "output_path=fused or logit_dtype=bf16")
        return model(*args, **kwargs)
    # --- 2. one call of the output layer, batch-major ---
    calls = []

    # ColumnParallelLinear.forward's signature; runtime_gather_output must not ask for gathered logits.
    def batch_major_forward(input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        if calls:
            raise RuntimeError(
                "output_path=logits: the model called its output layer more than once in one forward pass "
                "(multi-token prediction?); MegatronGRPO reads one output-layer call"
            )
        if runtime_gather_output:
            raise ValueError("runtime_gather_output=True: the logits output path reads vocab-parallel logits "
                             "(GPTModel with parallel_output=True)")
        calls.append(True)
        w = layer.weight if weight is None else weight
        logits = batch_major_linear(_input_mapping(layer, input_, rows), w,
                                    accumulate_into_main_grad=accumulates_into_main_grad(layer, w),
                                    logit_dtype=logit_dtype)
        return logits, None

    with _forward_replaced(layer, batch_major_forward):
        # --- 3. the model's output, as it returns it ---
        return model(*args, **kwargs)


def reproducible(layer: torch.nn.Module) -> bool:
    """Whether :func:`call_for_logits` computes ``layer``'s output itself (else the model's own layer runs)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    return (
        isinstance(layer, ColumnParallelLinear)
        and layer.bias is None
        and not layer.gather_output
        and not getattr(layer, "disable_grad_reduce", False)
        and not layer.config.defer_embedding_wgrad_compute
    )
