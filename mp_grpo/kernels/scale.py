"""Scale by a device scalar: ``out = cast(scale · x)`` or ``out += scale · x``, one pass (Triton).

The backward of :func:`mp_grpo.ops.fused_linear_loss.fused_linear_loss` multiplies the gradients it made
in forward by the upstream gradient ``g`` — a 0-dim tensor on the device (Megatron's loss scale, or 1).
Torch does this in several passes (a multiply, a cast, an add into ``main_grad``), and its elementwise
kernels do not vectorize a broadcast 0-dim CUDA operand. This kernel reads ``g`` from its pointer (no
host read), and each element once: one read of ``x`` and one write of ``out`` (with ``ACCUMULATE`` one
read of ``out`` too).

    out = (scale · x) in out's dtype              (ACCUMULATE = False; out may be x itself)
    out = (out + scale · x) in out's dtype        (ACCUMULATE = True: main_grad accumulation)

The products and the sum are in fp32 whatever the dtypes: one rounding, into out's dtype.
Each program handles BLOCK contiguous elements of the flat tensors (int64 offsets: a [V_local, H]
weight gradient may pass 2^31 elements).
"""

import triton
import triton.language as tl


@triton.jit
def scale_kernel(
    # pointers
    x_ptr,  # [n] contiguous; fp32 / bf16 / fp16
    out_ptr,  # [n] contiguous; fp32 / bf16 / fp16 (may alias x_ptr when of x's dtype)
    scale_ptr,  # [1] the scale; fp32 / bf16 / fp16
    # shapes
    n,
    # meta-parameters
    ACCUMULATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n

    # --- 1. the scale (one load per program, no host read) and this block of x ---
    scale = tl.load(scale_ptr).to(tl.float32)
    y = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * scale

    # --- 2. add into out (main_grad) or overwrite it, rounded once to out's dtype ---
    if ACCUMULATE:
        y += tl.load(out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)
