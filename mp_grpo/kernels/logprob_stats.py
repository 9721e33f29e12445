"""Forward pass 1 of 2: per-row softmax statistics of one vocabulary shard (Triton).

One program reads one row of this rank's logits shard exactly once and writes four fp32 numbers:

    stats[row] = (m, s, u, z_t)
        m   = max_j z_j                              (z = logits / temperature)
        s   = sum_j exp(z_j - m)
        u   = sum_j exp(z_j - m) * (z_j - m)         (only with HAS_ENTROPY; else 0)
        z_t = z[target - vocab_start] if this shard owns the target, else 0

``u`` is what the entropy needs: H = log S - U / S after the statistics of all shards are merged
(see ``logprob_merge.py``). The running state is kept per lane ([BLOCK_V] vectors) so that the loop
needs no cross-lane reduction; the lanes are reduced once, after the loop.
"""

import triton
import triton.language as tl

# Initial running maximum of a lane. A finite sentinel rather than -inf: with -inf, the
# first update computes (-inf) - (-inf) = NaN for lanes that only ever see -inf (padding past
# V_local, or a filtered vocabulary). Far below any real logit / temperature.
MAX_SENTINEL: tl.constexpr = -1.0e30


@triton.jit
def logprob_stats_kernel(
    # pointers
    x_ptr,  # [N, V_local] logits shard; fp32 / bf16 / fp16; last dim contiguous
    target_ptr,  # [N] int64 global token ids
    stats_ptr,  # [N, 4] fp32 out: (m, s, u, z_t)
    # shapes
    V_local,
    vocab_start,  # first global id of this shard
    # strides
    stride_x_row,
    stride_stats_row,
    # scalars
    inv_temperature,  # fp32, 1 / temperature
    # meta-parameters
    HAS_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row_ptr = x_ptr + row * stride_x_row
    offs = tl.arange(0, BLOCK_V)

    # --- 1. the target logit, read once by the shard that owns it ---
    local_target = tl.load(target_ptr + row) - vocab_start
    owns_target = (local_target >= 0) & (local_target < V_local)
    z_target = tl.load(x_row_ptr + local_target, mask=owns_target, other=0.0).to(tl.float32)
    z_target = tl.where(owns_target, z_target * inv_temperature, 0.0)

    # --- 2. one pass over the row: per-lane online max, sum-exp and (for entropy) sum-exp*z ---
    m = tl.full([BLOCK_V], MAX_SENTINEL, dtype=tl.float32)
    s = tl.zeros([BLOCK_V], dtype=tl.float32)
    u = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V_local, BLOCK_V):
        cols = start + offs
        z = tl.load(x_row_ptr + cols, mask=cols < V_local, other=float("-inf")).to(tl.float32)
        z = z * inv_temperature
        # One exp per element: with d = |z - m|, exactly one of exp(m - m_new), exp(z - m_new)
        # is 1 and the other is exp(-d).
        d = tl.abs(z - m)
        e = tl.exp(-d)
        is_new_max = z > m
        if HAS_ENTROPY:
            # z = -inf gives d = inf and e = 0: e * d would be 0 * inf, so select instead.
            e_d = tl.where(e > 0.0, e * d, 0.0)
            u = tl.where(is_new_max, e * (u - d * s), u - e_d)
        s = tl.where(is_new_max, s * e + 1.0, s + e)
        m = tl.maximum(m, z)

    # --- 3. reduce the lanes to the row's statistics ---
    m_row = tl.max(m, axis=0)
    w = tl.exp(m - m_row)
    s_row = tl.sum(s * w, axis=0)
    stats_row_ptr = stats_ptr + row * stride_stats_row
    tl.store(stats_row_ptr + 0, m_row)
    tl.store(stats_row_ptr + 1, s_row)
    if HAS_ENTROPY:
        # Lanes still at the sentinel have s = 0, so (m - m_row) * s stays finite (= 0).
        u_row = tl.sum(w * (u + (m - m_row) * s), axis=0)
        tl.store(stats_row_ptr + 2, u_row)
    else:
        tl.store(stats_row_ptr + 2, 0.0)
    tl.store(stats_row_ptr + 3, z_target)
