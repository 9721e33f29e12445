"""Forward pass 2 of 2: merge the per-shard statistics of all TP ranks into log-probs (Triton).

Input is the all-gathered ``[TP, N, 4]`` tensor of ``logprob_stats_kernel`` outputs: m_r and x_t in raw logit
units, the sums s_r, u_r without the target's column. With M = max_r m_r (raw), every difference of logits formed
before it is scaled — w_r = exp((m_r - M) / T), d_t = (x_t - M) / T — and e_t = exp(d_t) where the target lies in
``[0, V_global)`` (one shard owns it and left its column out of s and u), else 0:

    x_t     = sum_r x_t,r   (one shard owns it, the others wrote 0)
    S_o     = sum_r w_r s_r                                  the other tokens' mass (relative to M)
    S       = S_o + e_t                                      logZ     = M / T + log S
    U       = sum_r w_r (u_r + (m_r - M) / T · s_r) + e_t d_t    entropy  = log S - U / S
    logprob = d_t - log S          (0 where target == ignore_index)
    q_t     = S_o / S = 1 - p_t                               (saved for backward, without cancellation)
    c_t     = q_t d_t - U_o / S = log p_t + H                 (with the entropy; U_o: U without the target's term)

d_t is exact for the logits near the maximum (the tokens that carry the probability): x_t / T - M / T would
round each term at the logits' magnitude instead, eps · |x| / T (2e-6 nats at |x| = 34, T = 0.7).

The target's own logit gradient is (p_t - 1)·g_lp - p_t (log p_t + H)·g_H. Near p_t = 1 both factors are small
differences of fp32 numbers near 1 or near 0: 1 - p_t from an fp32 p_t loses ~6e-8 absolute (all of it at p_t =
1 - 1e-7), and log p_t + H from log S and H loses as much. q_t and c_t come from the other tokens' sums kept apart,
so they keep fp32's relative rounding whatever p_t (``logprob_backward.py`` reads them at the target's column).

logZ is kept as its two terms (M raw, log S): with logits near 1e4 the fp32 sum M / T + log S would lose
log S to rounding (ulp(1e4) ~ 1e-3), and (x - M) / T is exact for the logits near the maximum that matter.

It also checks its inputs, so that bad input is never silently wrong: a target outside
``[0, V_global)`` (other than ``ignore_index``) gets a NaN log-prob, and if the TP ranks' shard
sizes (row N of the stats, column 0) differ, every output is NaN. The kernel adds the number of ranks
whose shard size differs from rank 0's into ``errors[0]``, the number of bad targets into
``errors[1]`` and the number of rows with non-finite logits into ``errors[2]``: three int64 counters
that are the deferred error ledger's own slots (no launch of the host's to record them) or, for a
check at the call, fresh zeros the host reads.

Non-finite logits are seen here, per row, from the merged statistics — no work per logit, and the same
count on every TP rank (each merges every shard's statistics), so every rank raises alike: a NaN or
+inf logit anywhere in a row makes its sum S NaN (exp(NaN), or +inf − +inf), and a row that is −inf
throughout has S = 0; either way log S is not finite, and the row's log-prob and entropy are NaN.
Such a row is counted when its target is not ``ignore_index`` (the backward kernel gives it no
gradient either way). A −inf logit elsewhere is probability 0 — a filtered or masked token — and is
allowed; at the target it gives the log-prob −inf, which the loss counts as a non-finite log-prob.
"""

import triton
import triton.language as tl


@triton.jit
def merge_rows(
    stats_ptr, target_ptr, rows, row_mask, N, TP, V_global, ignore_index, stride_stats_rank, stride_stats_row,
    inv_temperature, HAS_ENTROPY: tl.constexpr,
):
    """Steps 1–3 below for the positions ``rows`` (in range where ``row_mask``): (log-prob — NaN where poisoned —,
    entropy — 0 without HAS_ENTROPY —, M (raw units), log S, q_t = 1 - p_t, c_t = log p_t + H — 0 without HAS_ENTROPY —,
    shard-size mismatches (a scalar), targets out of range (bool), rows with non-finite logits (bool; see the module
    docstring)).
    Shared with the GRPO loss kernels that take the log-probs straight from the statistics (``FROM_STATS``)."""
    row_ptr = stats_ptr + rows * stride_stats_row

    # --- 1. shard sizes agree? global maximum over the shards ---
    v_rank0 = tl.load(stats_ptr + N * stride_stats_row)
    shard_mismatches = 0
    for r in range(0, TP):
        v_r = tl.load(stats_ptr + r * stride_stats_rank + N * stride_stats_row)
        shard_mismatches += (v_r != v_rank0).to(tl.int32)
    m_max = tl.full(rows.shape, float("-inf"), dtype=tl.float32)
    for r in range(0, TP):
        m_r = tl.load(row_ptr + r * stride_stats_rank + 0, mask=row_mask, other=0.0)
        m_max = tl.maximum(m_max, m_r)

    # --- 2. rescale and sum the shards' sum-exp, sum-exp*z and target logits ---
    s_tot = tl.zeros(rows.shape, dtype=tl.float32)
    u_tot = tl.zeros(rows.shape, dtype=tl.float32)
    x_target = tl.zeros(rows.shape, dtype=tl.float32)
    for r in range(0, TP):
        shard_ptr = row_ptr + r * stride_stats_rank
        m_r = tl.load(shard_ptr + 0, mask=row_mask, other=0.0)
        s_r = tl.load(shard_ptr + 1, mask=row_mask, other=0.0)
        shift_r = (m_r - m_max) * inv_temperature
        w_r = tl.exp(shift_r)
        s_tot += w_r * s_r
        if HAS_ENTROPY:
            u_r = tl.load(shard_ptr + 2, mask=row_mask, other=0.0)
            u_tot += w_r * (u_r + shift_r * s_r)
        x_target += tl.load(shard_ptr + 3, mask=row_mask, other=0.0)

    # --- 3. the target's own term (its shard left it out of s and u), log-prob, 1 - p_t, entropy; bad targets ---
    target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index)
    in_vocab = (target >= 0) & (target < V_global)  # exactly where one shard owns the target
    d_target = (x_target - m_max) * inv_temperature
    # exp(-inf) = 0 for a target outside a sampling filter's kept set; NaN / +inf logits make S NaN either way.
    e_target = tl.where(in_vocab, tl.exp(d_target), 0.0)
    s_other = s_tot
    s_tot = s_other + e_target
    complement = s_other / s_tot
    centered = tl.zeros(rows.shape, dtype=tl.float32)
    if HAS_ENTROPY:
        centered = complement * d_target - u_tot / s_tot
        u_tot += tl.where(e_target > 0.0, e_target * d_target, 0.0)
    log_s = tl.log(s_tot)
    valid = target != ignore_index
    out_of_range = valid & ~in_vocab
    poisoned = out_of_range | (shard_mismatches > 0)
    logprob = tl.where(valid, d_target - log_s, 0.0)
    logprob = tl.where(poisoned, float("nan"), logprob)
    # a NaN / +inf logit in the row, or -inf throughout: log S is not finite (NaN compares false)
    nonfinite = valid & ~poisoned & ~(tl.abs(log_s) < float("inf"))
    entropy = tl.zeros(rows.shape, dtype=tl.float32)
    if HAS_ENTROPY:
        entropy = tl.where(shard_mismatches > 0, float("nan"), log_s - u_tot / s_tot)
    return logprob, entropy, m_max, log_s, complement, centered, shard_mismatches, out_of_range, nonfinite


@triton.jit
def add_error_counts(errors_ptr, shard_mismatches, out_of_range, nonfinite, row_mask):
    """Step 4 below: the shard-size mismatches (once, by program 0), this block's bad targets and its rows with
    non-finite logits, added into the ``[3]`` int64 counters (the deferred ledger's own slots, or fresh zeros)."""
    if tl.program_id(0) == 0:
        tl.atomic_add(errors_ptr + 0, shard_mismatches.to(tl.int64))
    tl.atomic_add(errors_ptr + 1, tl.sum((out_of_range & row_mask).to(tl.int64), axis=0))
    tl.atomic_add(errors_ptr + 2, tl.sum((nonfinite & row_mask).to(tl.int64), axis=0))


@triton.jit
def logprob_merge_kernel(
    # pointers
    stats_ptr,  # [TP, N + 1, 4] fp32 per-shard (m, s, u, x_t), s and u without t; row N: (V_local, 0, 0, 0)
    target_ptr,  # [N] int64 global token ids
    logprob_ptr,  # [N] fp32 out
    entropy_ptr,  # [N] fp32 out (only with HAS_ENTROPY)
    row_max_ptr,  # [N] fp32 out: M in raw logit units, saved for backward
    log_sum_ptr,  # [N] fp32 out: log S (logZ = M / T + log S), saved for backward
    complement_ptr,  # [N] fp32 out: q_t = 1 - p_t, summed apart (saved for backward)
    centered_ptr,  # [N] fp32 out: c_t = log p_t + H, summed apart (only with HAS_ENTROPY; saved for backward)
    errors_ptr,  # [3] int64 counters, added into: (shard-size mismatches, bad targets, non-finite rows)
    # shapes
    N,
    TP,
    V_global,
    ignore_index,
    # strides
    stride_stats_rank,
    stride_stats_row,
    # scalars
    inv_temperature,  # fp32, 1 / temperature
    # meta-parameters
    HAS_ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N

    # --- 1.–3. merge the shards' statistics (merge_rows) ---
    logprob, entropy, m_max, log_s, complement, centered, shard_mismatches, out_of_range, nonfinite = merge_rows(
        stats_ptr, target_ptr, rows, row_mask, N, TP, V_global, ignore_index, stride_stats_rank, stride_stats_row,
        inv_temperature, HAS_ENTROPY,
    )
    tl.store(logprob_ptr + rows, logprob, mask=row_mask)
    tl.store(row_max_ptr + rows, m_max, mask=row_mask)
    tl.store(log_sum_ptr + rows, log_s, mask=row_mask)
    tl.store(complement_ptr + rows, complement, mask=row_mask)
    if HAS_ENTROPY:
        tl.store(entropy_ptr + rows, entropy, mask=row_mask)
        tl.store(centered_ptr + rows, centered, mask=row_mask)

    # --- 4. error counts, added into the counters (the deferred ledger's own slots, or fresh zeros) ---
    add_error_counts(errors_ptr, shard_mismatches, out_of_range, nonfinite, row_mask)
