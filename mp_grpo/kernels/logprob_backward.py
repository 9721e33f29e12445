"""Backward: the gradient of (log-prob, entropy) w.r.t. one vocabulary shard, in one pass (Triton).

With z = logits / T, p_j = exp(z_j - logZ), logZ = M / T + log S over the *whole* vocabulary (both
terms saved by forward, M in raw logit units; log p_j = (x_j - M) / T - log S, the difference of logits formed
before it is scaled, keeps precision for logits near 1e4 and for the tokens near the maximum):

    d logprob / d z_j = [j == target] - p_j
    d entropy / d z_j = -p_j (log p_j + H)

so  grad_logits_j = (g_lp ([j == target] - p_j) - g_H p_j (log p_j + H)) / T.

At j = target the factors 1 - p_t and log p_t + H are q_t and c_t as the merge formed them from the other tokens'
sums (``logprob_merge.py``), not the differences of the recomputed p_t and log p_t: near p_t = 1 those would
cancel (fp32's spacing 6e-8 near 1 against q_t ~ c_t ~ 1 - p_t).

With HAS_THRESHOLD (a sampling filter) the columns whose raw logit is below ``threshold[row]`` have
p = 0 and get no gradient; M, log S and H then describe the filtered, renormalized distribution.
The host zeroes g_lp of rows whose target lies outside the kept set (their log-prob is the constant -inf).

With HAS_GRAD_SCALE the upstream gradients are ``scale · g_lp`` and ``scale · g_H``, ``scale`` a 0-dim
device value: the GRPO loss from logits (``mp_grpo/ops/logits_grpo_loss.py``) passes the loss's per-token
coefficients d loss / d logp, d loss / d H made in forward and the loss's own upstream gradient, so that its
backward is this one launch, with no host read of the upstream gradient.

A row whose M or log S is not finite (a NaN or +inf logit in it, or -inf throughout: ``logprob_merge.py``)
gets a zero gradient, selected (``tl.where``), never computed as 0 · NaN: its probabilities are NaN, and whatever
its upstream gradient (an ignored row's is 0, and the loss gives 0 to a position it drops), no NaN reaches the
logits' gradient. The merge counts such rows in forward.

Every quantity that couples the shards (M, S, H) was merged in forward, so backward needs no
collective. Each program handles BLOCK_V columns of one row: it reads them once and writes their
gradient once, in the gradient buffer's dtype (which may be the logits buffer itself).

With ROW_LOOP one program handles a whole row, its column blocks in ascending order, so that the gradient can be
written NARROWED IN PLACE: fp32 logits (``LogitDtype.FP32``) and their bf16 / fp16 gradient in the front half of
each row's own storage (``stride_grad_x_row`` = 2·``stride_x_row`` elements of half the size). Block b's gradient
covers the bytes of columns [b·BLOCK_V / 2, (b + 1)·BLOCK_V / 2), which only blocks ≤ b hold: read already, in
earlier iterations or in this one before its barrier — the one barrier per block orders every warp's loads of the
block before any warp's stores (without it a warp ahead of another could overwrite logits not yet read).
"""

import triton
import triton.language as tl


@triton.jit
def logprob_backward_kernel(
    # pointers
    x_ptr,  # [N, V_local] logits shard; fp32 / bf16 / fp16
    grad_x_ptr,  # [N, V_local] out, logits' dtype (may alias x_ptr)
    target_ptr,  # [N] int64 global token ids
    row_max_ptr,  # [N] fp32 M, the row maximum of the raw logits over the whole vocabulary
    log_sum_ptr,  # [N] fp32 log S, S = sum exp(z - M) over the whole vocabulary
    complement_ptr,  # [N] fp32 q_t = 1 - p_t of the target, summed apart by the merge
    centered_ptr,  # [N] fp32 c_t = log p_t + H of the target, summed apart (only with HAS_ENTROPY_GRAD)
    entropy_ptr,  # [N] fp32 entropy (only with HAS_ENTROPY_GRAD)
    grad_logprob_ptr,  # [N] fp32 upstream gradient of the log-probs
    grad_entropy_ptr,  # [N] fp32 upstream gradient of the entropy (only with HAS_ENTROPY_GRAD)
    threshold_ptr,  # [N] fp32 raw-logit threshold of the kept set (only with HAS_THRESHOLD)
    grad_scale_ptr,  # 0-dim fp32 factor of both upstream gradients (only with HAS_GRAD_SCALE)
    # shapes
    V_local,
    vocab_start,
    ignore_index,
    # strides
    stride_x_row,
    stride_grad_x_row,
    # scalars
    inv_temperature,  # fp32, 1 / temperature
    # meta-parameters
    HAS_ENTROPY_GRAD: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    ROW_LOOP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)

    # --- 1. per-row scalars: log-partition terms, target, upstream gradients ---
    row_max, log_sum, complement, target, g_logprob, g_entropy, entropy, centered, row_ok = row_scalars(
        row, target_ptr, row_max_ptr, log_sum_ptr, complement_ptr, centered_ptr, entropy_ptr, grad_logprob_ptr,
        grad_entropy_ptr, grad_scale_ptr, ignore_index, HAS_ENTROPY_GRAD, HAS_GRAD_SCALE,
    )
    threshold = 0.0
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + row)
    x_row = x_ptr + row * stride_x_row
    grad_row = grad_x_ptr + row * stride_grad_x_row
    target_col = target - vocab_start

    if ROW_LOOP:  # --- 2.–3. every column block of the row, ascending: the gradient may be narrowed in place ---
        for start in range(0, V_local, BLOCK_V):
            _gradient_block(x_row, grad_row, start + tl.arange(0, BLOCK_V), V_local, target_col, row_max, log_sum,
                            complement, centered, entropy, g_logprob, g_entropy, threshold, row_ok, inv_temperature,
                            HAS_ENTROPY_GRAD, HAS_THRESHOLD, True)
    else:  # --- 2.–3. this program's column block ---
        cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
        _gradient_block(x_row, grad_row, cols, V_local, target_col, row_max, log_sum, complement, centered, entropy,
                        g_logprob, g_entropy, threshold, row_ok, inv_temperature, HAS_ENTROPY_GRAD, HAS_THRESHOLD, False)


@triton.jit
def _gradient_block(
    x_row,  # the row's logits
    grad_row,  # the row's gradient (may alias x_row; narrowed in place with SYNC)
    cols,
    V_local,
    target_col,  # the target's column in this shard (outside [0, V_local) when another shard holds it)
    row_max,
    log_sum,
    complement,  # q_t = 1 - p_t
    centered,  # c_t = log p_t + H
    entropy,
    g_logprob,
    g_entropy,
    threshold,
    row_ok,
    inv_temperature,
    HAS_ENTROPY_GRAD: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr,
    SYNC: tl.constexpr,
):
    col_mask = cols < V_local
    # --- 2. probabilities of this block, recomputed from the logits ---
    z = tl.load(x_row + cols, mask=col_mask, other=float("-inf")).to(tl.float32)
    if SYNC:  # every warp's loads of the block before any warp's stores (the gradient overwrites read logits)
        tl.debug_barrier()
    if HAS_THRESHOLD:
        z = tl.where(z >= threshold, z, float("-inf"))
    grad = gradient_values(z, cols == target_col, row_max, log_sum, complement, centered, entropy, g_logprob, g_entropy,
                           row_ok, inv_temperature, HAS_ENTROPY_GRAD)

    # --- 3. write the gradient once, in the buffer's dtype (0 for a row with non-finite statistics) ---
    tl.store(grad_row + cols, grad.to(grad_row.dtype.element_ty), mask=col_mask)


@triton.jit
def row_scalars(
    row, target_ptr, row_max_ptr, log_sum_ptr, complement_ptr, centered_ptr, entropy_ptr, grad_logprob_ptr,
    grad_entropy_ptr, grad_scale_ptr, ignore_index, HAS_ENTROPY_GRAD: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr,
):
    """Step 1 of ``logprob_backward_kernel`` for ``row``: (M, log S, q_t = 1 - p_t, the target, g_lp — 0 for an
    ignored row —, g_H, H, c_t = log p_t + H, whether the row's statistics are finite). Shared with the
    captured-support backward (``logprob_support.py``)."""
    row_max = tl.load(row_max_ptr + row)
    log_sum = tl.load(log_sum_ptr + row)
    complement = tl.load(complement_ptr + row)
    target = tl.load(target_ptr + row)
    # An ignored row's log-prob is the constant 0: no gradient flows from it.
    g_logprob = tl.load(grad_logprob_ptr + row)
    if HAS_GRAD_SCALE:
        grad_scale = tl.load(grad_scale_ptr).to(tl.float32)
        g_logprob = g_logprob * grad_scale
    g_logprob = tl.where(target != ignore_index, g_logprob, 0.0)

    g_entropy = 0.0
    entropy = 0.0
    centered = 0.0
    if HAS_ENTROPY_GRAD:
        entropy = tl.load(entropy_ptr + row)
        centered = tl.load(centered_ptr + row)
        g_entropy = tl.load(grad_entropy_ptr + row)
        if HAS_GRAD_SCALE:
            g_entropy = g_entropy * grad_scale
    # A select per element: one uniform branch per program instead measured 11–17 % slower with the entropy
    # gradient (more registers; docs/benchmarks/nonfinite_ab.md).
    row_ok = (tl.abs(row_max) < float("inf")) & (tl.abs(log_sum) < float("inf"))
    return row_max, log_sum, complement, target, g_logprob, g_entropy, entropy, centered, row_ok


@triton.jit
def gradient_values(
    z, is_target, row_max, log_sum, complement, centered, entropy, g_logprob, g_entropy, row_ok, inv_temperature,
    HAS_ENTROPY_GRAD: tl.constexpr,
):
    """The fp32 gradient of the logits ``z`` (raw units; -inf: probability 0) of one row — the module docstring's
    formula, the target's column (``is_target``) from q_t and c_t —; 0 where the row's statistics are not finite."""
    log_p = (z - row_max) * inv_temperature - log_sum
    p = tl.exp(log_p)
    grad = tl.where(is_target, g_logprob * complement, -g_logprob * p)
    if HAS_ENTROPY_GRAD:
        # p = 0 (a -inf logit) contributes nothing; p * log_p would be 0 * -inf = NaN.
        grad -= g_entropy * tl.where(p > 0.0, p * tl.where(is_target, centered, log_p + entropy), 0.0)
    return tl.where(row_ok, grad * inv_temperature, 0.0)
