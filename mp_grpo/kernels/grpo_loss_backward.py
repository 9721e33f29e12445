"""Fused GRPO loss, backward: the upstream gradient times the per-token gradients of the forward (Triton).

    grad_lp[t]  = g · grad_lp_fwd[t] + G[s(t)] · seq_factor[t]      (the second term for gspo / gmpo only)
    grad_ent[t] = g · grad_ent_fwd[t]                               (entropy bonus only)

g is the upstream gradient of this call's share (a 0-dim tensor: no host read). G[s] is the forward's
Σ_{t ∈ s} ∂(c_t / D_t)/∂m_s, times g here (SEQ_GRAD_SCALED false) or already g-scaled and summed over the
context-parallel group by the host (SEQ_GRAD_SCALED true). Gradients are written in the inputs' dtypes.

Schedule: 1. load g and the forward's gradients of the block; 2. (gspo / gmpo) add G[s] · seq_factor;
3. store.
"""

import triton
import triton.language as tl

from mp_grpo.kernels.grpo_loss_common import sequence_index


@triton.jit
def grpo_loss_backward_kernel(
    grad_out_ptr,  # 0-dim upstream gradient of the share
    grad_lp_fwd_ptr,  # [N] compute dtype
    grad_ent_fwd_ptr,  # [N] compute dtype (ENTROPY_GRAD only)
    seq_grad_ptr,  # [S] float64 (SEQ_GRAD only)
    seq_factor_ptr,  # [N] compute dtype (SEQ_GRAD only)
    cu_ptr,  # [S + 1] cu_seqlens (packed only)
    grad_lp_ptr,  # [N] out, dtype of the log-probs
    grad_ent_ptr,  # [N] out, dtype of the entropy (ENTROPY_GRAD only)
    N, T, S, search_steps,
    PACKED: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr,
    ENTROPY_16BIT: tl.constexpr,  # the entropy is bf16 / fp16: its gradient is converted through float32
    SEQ_GRAD: tl.constexpr,
    SEQ_GRAD_SCALED: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < N
    # --- 1. upstream gradient, forward gradients ---
    g = tl.load(grad_out_ptr).to(COMPUTE)
    grad_lp = g * tl.load(grad_lp_fwd_ptr + offs, mask=in_range, other=0.0).to(COMPUTE)
    # --- 2. through the sequence mean (gspo / gmpo) ---
    if SEQ_GRAD:
        seq = sequence_index(offs, cu_ptr, T, S, search_steps, PACKED)
        factor = tl.load(seq_factor_ptr + offs, mask=in_range, other=0.0).to(COMPUTE)
        seq_grad = tl.load(seq_grad_ptr + seq, mask=in_range & (seq < S), other=0.0).to(COMPUTE)
        if not SEQ_GRAD_SCALED:
            seq_grad = seq_grad * g
        grad_lp += seq_grad * factor
    # --- 3. store in the inputs' dtypes ---
    tl.store(grad_lp_ptr + offs, grad_lp.to(grad_lp_ptr.dtype.element_ty), mask=in_range)
    if ENTROPY_GRAD:
        grad_ent = g * tl.load(grad_ent_fwd_ptr + offs, mask=in_range, other=0.0).to(COMPUTE)
        if ENTROPY_16BIT:  # float64 → float32 → bf16 / fp16: Triton's interpreter turns float64 → bf16 into garbage
            grad_ent = grad_ent.to(tl.float32)
        tl.store(grad_ent_ptr + offs, grad_ent.to(grad_ent_ptr.dtype.element_ty), mask=in_range)
