"""The output layer's GEMM with its logits stored batch-major: no ``[tokens, V_local]`` copy forward or backward.

Megatron computes activations sequence-major, ``[S, B, H]``, and GPTModel's output layer returns its
logits ``[S, B, V_local]``; GPTModel then hands them out as ``logits.transpose(0, 1).contiguous()``, a
copy of all ``N·V_local`` logits (N = S·B). In backward the gradient arrives as the transpose of the
loss's contiguous ``[B, S, V_local]`` gradient, and megatron-core's linear layer makes it contiguous
twice more (once inside ``grad_output.matmul(weight)``, once for the weight-gradient GEMM). With B > 1
that is three ``[N, V_local]`` copies per step — at N = 8192, V = 151936, bf16 each is 2.3 GiB read and
written — and a second ``[N, V_local]`` buffer alive at the peak.

:func:`batch_major_linear` computes the same product into a ``[B, S, V_local]``-contiguous buffer and
returns it as the ``[S, B, V_local]`` view: GPTModel's transpose of it is contiguous already, so its
``.contiguous()`` copies nothing; backward reads the incoming gradient in that same layout. Only
``[N, H]`` tensors are transposed (the input, and the input gradient on its way back), ``H / V_local``
of the logits' size.

Schedule of :class:`BatchMajorLinear` (``hidden`` ``[S, B, H]``, ``weight`` ``[V_local, H]``)

Forward
    1. ``x = hidden`` as ``[B·S, H]`` (batch-major; a copy unless B = 1). Saved for backward instead of
       ``hidden``: the same size.
    2. ``logits = x @ weightᵀ`` (cuBLAS, fp32 accumulation, hidden's dtype — or with ``logit_dtype=FP32`` the
       fp32 accumulator itself, never rounded to bf16) into a new ``[B, S, V_local]`` tensor, returned as its
       ``[S, B, V_local]`` view.
Backward (``grad`` ``[S, B, V_local]``)
    1. ``g = grad`` as ``[B·S, V_local]``: a view when the gradient is laid out as the logits are (what
       GPTModel's transpose hands back from a contiguous ``[B, S, V_local]`` gradient); else one copy. fp32
       logits' gradient is rounded to weight's dtype here (one ``[N, V_local]`` copy of half their size): the
       GEMMs below are the bf16 ones either way.
    2. ``grad_hidden = g @ weight``, returned as the ``[S, B, H]`` view of a ``[B, S, H]`` tensor.
    3. ``grad_weight = gᵀ @ x`` in weight's dtype; with ``accumulate_into_main_grad`` added into
       Megatron's ``weight.main_grad`` instead (fp32 accumulation by cuBLAS) and the zero placeholder
       returned, as Megatron's gradient-accumulation fusion does.

The values are those of megatron-core's ``ColumnParallelLinear`` GEMMs on the same operands (the weight
gradient sums the same products over the tokens in another order). Tensor parallelism is the caller's:
``hidden`` is the layer's input after its TP mapping (see :mod:`mp_grpo.megatron.logits_output`).
"""

from __future__ import annotations

import torch

from mp_grpo.config.precision import LogitDtype
from mp_grpo.ops.checks import check_main_grad
from mp_grpo.ops.output_chunks import logits_dtype, main_grad_placeholder, matmul_into


class BatchMajorLinear(torch.autograd.Function):
    """``hidden @ weightᵀ`` with batch-major logits; see the module docstring for the schedule."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, accumulate_into_main_grad: bool,
                dtype: torch.dtype) -> torch.Tensor:
        s, b, h = hidden.shape
        # --- 1. the input, batch-major ---
        x = hidden.transpose(0, 1).reshape(b * s, h)
        # --- 2. the logits into [B, S, V_local], handed out sequence-major ---
        logits = torch.empty((b, s, weight.shape[0]), dtype=dtype, device=hidden.device)
        matmul_into(logits.view(b * s, weight.shape[0]), x, weight.t(), accumulate=False)  # sizes given: b·s may be 0
        ctx.save_for_backward(x, weight)
        ctx.seq_batch = (s, b)
        ctx.accumulate_into_main_grad = accumulate_into_main_grad
        return logits.transpose(0, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        s, b = ctx.seq_batch
        # --- 1. the gradient, batch-major (a view for a gradient laid out as the logits) ---
        g = grad.transpose(0, 1).reshape(b * s, weight.shape[0]).to(weight.dtype)
        grad_hidden = grad_weight = None
        # --- 2. input gradient ---
        if ctx.needs_input_grad[0]:
            grad_hidden = torch.mm(g, weight).view(b, s, weight.shape[1]).transpose(0, 1)
        # --- 3. weight gradient (into main_grad under gradient-accumulation fusion) ---
        if ctx.needs_input_grad[1]:
            if ctx.accumulate_into_main_grad:
                matmul_into(weight.main_grad, g.t(), x, accumulate=True)
                grad_weight = main_grad_placeholder(weight, weight.dtype)
            else:
                grad_weight = torch.mm(g.t(), x)
        return grad_hidden, grad_weight, None, None


def batch_major_linear(
    hidden: torch.Tensor, weight: torch.Tensor, *, accumulate_into_main_grad: bool = False,
    logit_dtype: LogitDtype = LogitDtype.BF16,
) -> torch.Tensor:
    """``hidden @ weightᵀ`` as ``[S, B, V_local]`` logits stored as a contiguous ``[B, S, V_local]`` tensor.

    Args:
        hidden: ``[S, B, H]`` input of the output layer (after its tensor-parallel mapping).
        weight: ``[V_local, H]`` this rank's rows of the output weight, hidden's dtype.
        accumulate_into_main_grad: add the weight gradient into ``weight.main_grad`` (Megatron's
            gradient-accumulation fusion) and return the zero placeholder as the weight's gradient.
        logit_dtype: ``BF16``: the logits in hidden's dtype; ``FP32``: the GEMM's fp32 accumulator (see
            :class:`~mp_grpo.config.precision.LogitDtype`; refused where the torch has no such GEMM).

    Returns:
        ``[S, B, V_local]`` logits whose ``transpose(0, 1)`` is contiguous.
    """
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise ValueError(f"hidden must be a [S, B, H] tensor, got {got}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a [V_local, H={hidden.shape[2]}] tensor, got {got}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"weight ({weight.dtype}, {weight.device}) must have hidden's dtype and device "
                         f"({hidden.dtype}, {hidden.device})")
    if accumulate_into_main_grad:
        check_main_grad(weight)
    return BatchMajorLinear.apply(hidden, weight, bool(accumulate_into_main_grad), logits_dtype(logit_dtype, hidden))
