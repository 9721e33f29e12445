"""How the fused output-layer ops cut their work into chunks, and the GEMM helpers they share.

:func:`~mp_grpo.ops.fused_linear_logprobs.fused_linear_logprobs` and
:func:`~mp_grpo.ops.fused_linear_loss.fused_linear_loss` hold at most one logits chunk at a time
(:func:`plan_chunks` sizes it from a byte budget), compute it with one GEMM into a reused flat buffer
(:func:`chunk_view`), accumulate the hidden / weight gradients in fp32 (:func:`matmul_into`), and, with
Megatron's gradient-accumulation fusion, return Megatron's placeholder weight gradient
(:func:`main_grad_placeholder`). Their schedules are in their own modules' docstrings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mp_grpo.config.precision import LogitDtype

LOGITS_CHUNK_BYTES = 512 * 2**20
"""The one logits-chunk buffer each pass holds. 0.5 GiB: at N = 16384, V_local = 151936, bf16 the
forward chunks are 1664 x 151936 and the backward chunks 16384 x 15232 — GEMMs large enough for
cuBLAS's full rate — against 4.6 GiB for the whole logits."""

GRAD_HIDDEN_BLOCK_BYTES = 512 * 2**20
"""Backward's fp32 accumulator of the hidden-state gradient, ``[rows, H]``, bounds a token block:
all N = 16384 rows at H ≤ 8192 fit in one block (the weight gradient is then written once)."""

ROW_ALIGN = 128
"""Chunk rows are rounded to a multiple of this (whole 128-row GEMM tiles), unless the budget forbids."""

COL_ALIGN = 128
"""Chunk columns likewise (also keeps the chunk's row stride a multiple of 16 bytes for cuBLAS)."""

_MIXED_DTYPE_GEMM = "dtype_out" in torch.ops.aten.addmm.overloads()
"""torch ≥ 2.8: cuBLAS GEMMs of bf16 / fp16 operands may write an fp32 output (``out_dtype``)."""


@dataclass(frozen=True)
class ChunkPlan:
    """How one call cuts its work (the schedule of :mod:`mp_grpo.ops.fused_linear_logprobs`)."""

    forward_rows: int
    """Rows per forward chunk; a forward chunk is ``[forward_rows, V_local]`` (whole rows)."""
    backward_rows: int
    """Rows per backward token block (the fp32 hidden-gradient accumulator is ``[backward_rows, H]``)."""
    backward_cols: int
    """Columns per backward chunk; a backward chunk is ``[backward_rows, backward_cols]``."""


def _piece_size(total: int, cap: int, align: int) -> int:
    """Size of the pieces when ``total`` is cut into ⌈total / cap⌉ near-equal pieces of at most ``cap``.

    Rounded up to a multiple of ``align`` unless that would exceed ``cap`` (the budget wins)."""
    cap = max(cap, 1)  # a budget below one row or column still makes progress, one at a time
    if total <= cap:
        return max(total, 1)
    pieces = -(-total // cap)
    size = -(-total // pieces)
    return min(-(-size // align) * align, cap)


def plan_chunks(
    rows: int,
    hidden_size: int,
    v_local: int,
    dtype: torch.dtype,
    *,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
    logits_chunk_bytes: int = LOGITS_CHUNK_BYTES,
) -> ChunkPlan:
    """The chunks of one call: explicit sizes where given, else the largest within the byte budgets.

    ``chunk_tokens`` sets both the forward chunk rows and the backward token block; ``chunk_vocab``
    the backward chunk columns (forward chunks are always whole rows). ``logits_chunk_bytes``: the
    logits-chunk budget (:mod:`mp_grpo.ops.fused_linear_loss` holds no recompute chunk and takes a larger one).
    """
    element = torch.empty((), dtype=dtype).element_size()
    n = max(rows, 1)  # no rows: a one-row plan (the forward still launches once for the shard-size row)
    if chunk_tokens is not None:
        forward_rows = backward_rows = min(chunk_tokens, n)
    else:
        forward_rows = _piece_size(n, logits_chunk_bytes // (v_local * element), ROW_ALIGN)
        backward_rows = _piece_size(n, GRAD_HIDDEN_BLOCK_BYTES // (hidden_size * 4), ROW_ALIGN)
    if chunk_vocab is not None:
        backward_cols = min(chunk_vocab, v_local)
    else:
        backward_cols = _piece_size(v_local, logits_chunk_bytes // (backward_rows * element), COL_ALIGN)
    return ChunkPlan(forward_rows, backward_rows, backward_cols)


def matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, accumulate: bool) -> None:
    """``out = a @ b`` (or ``out += a @ b``) in place; the products are summed in fp32.

    ``out`` is either of the operands' dtype or an fp32 accumulator for bf16 / fp16 operands. On CUDA
    cuBLAS reads the low-precision operands and writes the fp32 output itself (``out_dtype``, torch ≥
    2.8): no fp32 copy of either operand. CPU aten (and torch < 2.8) has no mixed-dtype GEMM, so there
    the operands are upcast first — the same products, summed in fp32, at the cost of fp32 copies of
    one chunk's operands.
    """
    if out.dtype == a.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif out.is_cuda and _MIXED_DTYPE_GEMM:
        if accumulate:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            torch.mm(a, b, out_dtype=out.dtype, out=out)
    elif accumulate:
        out.addmm_(a.float(), b.float())
    else:
        torch.mm(a.float(), b.float(), out=out)


def logits_dtype(logit_dtype: LogitDtype, operands: torch.Tensor) -> torch.dtype:
    """The dtype the output layer's logits are written in for ``logit_dtype`` and ``operands`` (hidden states and
    weight, one dtype): the operands' own for ``BF16``, fp32 for ``FP32``.

    ``FP32`` from bf16 / fp16 operands is a GEMM that writes its fp32 accumulator (:func:`matmul_into`): on CUDA
    cuBLAS's mixed-dtype GEMM (torch ≥ 2.8). Where the installed torch has none it would take fp32 copies of the
    operands and an fp32 GEMM — another cost and, with TF32 on, another precision — so it is refused, not
    downgraded. On the CPU the products are the same either way (aten upcasts one chunk's operands)."""
    if not isinstance(logit_dtype, LogitDtype):
        raise TypeError(f"logit_dtype must be a LogitDtype (BF16 or FP32), got {logit_dtype!r}")
    if logit_dtype is LogitDtype.BF16 or operands.dtype == torch.float32:
        return operands.dtype
    if operands.is_cuda and not _MIXED_DTYPE_GEMM:
        raise ValueError(
            f"logit_dtype=fp32: this torch ({torch.__version__}) has no CUDA GEMM of {operands.dtype} operands with an "
            "fp32 output (torch.mm(..., out_dtype=torch.float32), torch ≥ 2.8); fp32 logits would need fp32 copies of "
            "the operands and an fp32 GEMM — use logit_dtype=bf16 or a newer torch")
    return torch.float32


def chunk_view(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous ``[rows, cols]`` tensor on the front of a flat reusable buffer."""
    return buffer[: rows * cols].view(rows, cols)


_PLACEHOLDER_ZEROS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
"""One zero element per (dtype, device), expanded to the weight's shape for every placeholder."""


def main_grad_placeholder(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The weight "gradient" returned after accumulating into ``weight.main_grad`` (see
    :mod:`mp_grpo.ops.fused_linear_logprobs`, "Megatron gradient-accumulation fusion").

    Zeros, as Megatron's linear layer makes them under ``weight.zero_out_wgrad`` (tied embeddings: the
    embedding lookup's gradient is added to it, and DDP's hook adds the sum into ``main_grad``), but
    allocated once: a single zero element expanded to ``weight.shape`` (stride 0), so the op itself
    allocates and fills nothing per call. Autograd's AccumulateGrad still materializes it when it becomes
    ``weight.grad`` (a stride-0 tensor breaks the gradient layout contract: one ``V_local × H`` allocation
    from the caching allocator and one write, the cost the fresh ``torch.zeros`` had); Megatron's DDP hook
    then drops that ``.grad``. Nothing ever writes into the cached element."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    key = (dtype, weight.device)
    zero = _PLACEHOLDER_ZEROS.get(key)
    if zero is None:
        zero = _PLACEHOLDER_ZEROS[key] = torch.zeros((), dtype=dtype, device=weight.device)
    return zero.expand(weight.shape)
