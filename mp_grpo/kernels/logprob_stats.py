"""Forward pass 1 of 2: per-row softmax statistics of one vocabulary shard (Triton).

One program reads one row of this rank's logits shard exactly once and writes four fp32 numbers:

    stats[row] = (m, s, u, x_t)
        m   = max_j x_j                                        (raw logits x; the target's column included)
        s   = sum_{j != t} exp((x_j - m) / T)
        u   = sum_{j != t} exp((x_j - m) / T) * (x_j - m) / T  (only with HAS_ENTROPY; else 0)
        x_t = x[target - vocab_start] if this shard owns the target, else 0

m and x_t stay in raw logit units, so that every consumer forms a difference of logits before it scales by 1/T:
(x_t - M) / T is exact for the logits near the maximum (Sterbenz), while x_t / T - M / T would round each term at
the logits' magnitude (eps · |x| / T: 2e-6 nats at |x| = 34, T = 0.7).

The sums leave out the target's own column t (where this shard owns it): the merge adds its term back from z_t
and keeps the mass of the other tokens, sum_{j != t} p_j = 1 - p_t, as a sum of its own. For a confident token
(p_t -> 1) the gradient of its logit is (p_t - 1)·g; formed as 1 - p_t from an fp32 p_t (spacing 6e-8 near 1) it
would keep a relative error of ~6e-8 / (1 - p_t) — 5e-4 at p_t = 1 - 1.2e-4, all of it at 1 - 1e-7. Summed
apart, it keeps fp32's relative rounding whatever p_t (``logprob_merge.py``, ``logprob_backward.py``).

With HAS_THRESHOLD (a sampling filter, ``mp_grpo/ops/sampling_filter.py``) only the columns whose raw
logit is >= ``threshold[row]`` count (the others are treated as -inf), and a target below the threshold
writes x_t = -inf, so that its merged log-prob is -inf. With HAS_SKIP the rows whose ``skip`` flag is set
read and write nothing (the sampling filter's candidate kernel wrote their statistics already).

``u`` is what the entropy needs: H = log S - U / S after the statistics of all shards are merged
(see ``logprob_merge.py``).

The loop is an online softmax over BLOCK_V-column chunks with a scalar running maximum: per element
one max, one subtract, one multiply, one exp2 and one add (two more for the entropy), which keeps
the kernel under the memory roofline rather than the FP32 pipe; only the chunk holding the target
compares its columns with the target's (that chunk is peeled off the loop). Two details keep it exact for
extreme logits: the maximum is tracked on the raw logits (so z_t - m is exact when the target is
the maximum), and each exponent is formed as (x - m) * log2(e) / T, subtracting before scaling.
"""

import triton
import triton.language as tl

# Initial running maximum. A finite sentinel rather than -inf: with -inf, a row (or a shard) whose
# logits are all -inf (a filtered vocabulary) would compute (-inf) - (-inf) = NaN. Far below any
# real logit.
MAX_SENTINEL = tl.constexpr(-1.0e30)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def online_sums(m, s, u, x, is_target, scale, HAS_ENTROPY: tl.constexpr, HAS_TARGET: tl.constexpr = True):
    """One block of the online softmax: the running maximum ``m`` (raw units) and the sums ``s``, ``u`` (relative to
    it, log2 units of z for ``u``) updated with the fp32 logits ``x`` of the block (-inf: not counted), the target's
    column (``is_target``; only with HAS_TARGET, a block that may hold it) counted in the maximum and left out of the
    sums. Shared with the captured-support kernel (``logprob_support.py``), which reads a row's support instead of its
    columns."""
    m_new = tl.maximum(m, tl.max(x, axis=0))
    shift = (m - m_new) * scale  # <= 0: rescales what was summed so far
    alpha = tl.exp2(shift)
    t = (x - m_new) * scale
    e = tl.exp2(t)
    if HAS_TARGET:
        # The target's own column counts in the maximum, not in the sums (the merge adds its term back).
        e = tl.where(is_target, 0.0, e)
    if HAS_ENTROPY:
        # A -inf logit gives e = 0 and t = -inf: select, since 0 * -inf is NaN.
        e_t = tl.where(e > 0.0, e * t, 0.0)
        # s is still the old sum here; the sentinel start has s = 0, so shift * s stays 0.
        u = alpha * (u + shift * s) + tl.sum(e_t, axis=0)
    s = s * alpha + tl.sum(e, axis=0)
    return m_new, s, u


@triton.jit
def load_block(x_row_ptr, cols, V_local, threshold, HAS_THRESHOLD: tl.constexpr):
    """The fp32 logits of one block of a row: -inf past the shard's end and (with HAS_THRESHOLD) below the kept set's
    threshold, so that they count neither in the maximum nor in the sums."""
    x = tl.load(x_row_ptr + cols, mask=cols < V_local, other=float("-inf")).to(tl.float32)
    if HAS_THRESHOLD:
        x = tl.where(x >= threshold, x, float("-inf"))
    return x


@triton.jit
def logprob_stats_kernel(
    # pointers
    x_ptr,  # [N, V_local] logits shard; fp32 / bf16 / fp16; last dim contiguous
    target_ptr,  # [N] int64 global token ids
    stats_ptr,  # [N_total + 1, 4] fp32 out: rows row_start .. row_start + n; row N_total = size row
    threshold_ptr,  # [N] fp32 raw-logit threshold of the kept set (only with HAS_THRESHOLD)
    skip_ptr,  # [N] int8: rows to leave alone (only with HAS_SKIP)
    # shapes
    n,  # rows of x in this launch (the grid is max(n, 1))
    row_start,  # first stats row written by this launch (chunked callers)
    N_total,  # rows of the whole stats buffer, less its size row
    V_local,
    vocab_start,  # first global id of this shard
    # strides
    stride_x_row,
    stride_stats_row,
    # scalars
    inv_temperature,  # fp32, 1 / temperature
    # meta-parameters
    HAS_ENTROPY: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    has_row = row < n  # false only for the single program of an empty launch
    if HAS_SKIP:
        has_row &= tl.load(skip_ptr + row, mask=has_row, other=1) == 0
    x_row_ptr = x_ptr + row * stride_x_row
    offs = tl.arange(0, BLOCK_V)
    scale = inv_temperature * LOG2E  # raw logit units -> log2 units of z
    v_end = tl.where(has_row, V_local, 0)

    # --- 1. the target logit, read once by the shard that owns it ---
    local_target = tl.load(target_ptr + row, mask=has_row, other=-1) - vocab_start
    owns_target = has_row & (local_target >= 0) & (local_target < V_local)
    x_target = tl.load(x_row_ptr + local_target, mask=owns_target, other=0.0).to(tl.float32)
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + row, mask=has_row, other=float("-inf"))
        # A target outside the kept set has probability 0: x_t = -inf makes the merged log-prob -inf.
        x_target = tl.where(owns_target & (x_target < threshold), float("-inf"), x_target)
    else:
        threshold = float("-inf")  # unread: load_block compares with it only under HAS_THRESHOLD

    # --- 2. one pass over the row: online max (raw units), sum of 2^t and (entropy) sum of 2^t * t, t's column apart ---
    # t = (x - m) * scale is z - m/T in log2 units; s, u are relative to the running maximum m.
    m = tl.full([], MAX_SENTINEL, dtype=tl.float32)
    s = tl.zeros([], dtype=tl.float32)
    u = tl.zeros([], dtype=tl.float32)
    # The block holding the target is peeled off the loop: the blocks before it and after it run the plain loop
    # body, and that one block alone compares its columns with the target's. A compare and a select per element in
    # every block cost the statistics pass 24 % at V_local = 151936 on an H200, a uniform branch inside the loop 9 %
    # (A/Bs against the kernels before; docs/benchmarks/logprob_exact_ab.md is the shipped one).
    target_block = tl.where(owns_target, (local_target // BLOCK_V) * BLOCK_V, v_end)
    for start in range(0, target_block, BLOCK_V):
        cols = start + offs
        x = load_block(x_row_ptr, cols, V_local, threshold, HAS_THRESHOLD)
        m, s, u = online_sums(m, s, u, x, cols, scale, HAS_ENTROPY, False)
    if owns_target:
        cols = target_block + offs
        x = load_block(x_row_ptr, cols, V_local, threshold, HAS_THRESHOLD)
        m, s, u = online_sums(m, s, u, x, cols == local_target, scale, HAS_ENTROPY, True)
    for start in range(target_block + BLOCK_V, v_end, BLOCK_V):
        cols = start + offs
        x = load_block(x_row_ptr, cols, V_local, threshold, HAS_THRESHOLD)
        m, s, u = online_sums(m, s, u, x, cols, scale, HAS_ENTROPY, False)

    # --- 3. store m and x_t in raw units, s, u * ln 2 (natural units); program 0 also writes the shard size ---
    stats_row_ptr = stats_ptr + (row_start + row) * stride_stats_row
    if row == 0:
        # The size row travels with the statistics through the all-gather, so the merge can check
        # that every TP rank holds a shard of the same size (exact in fp32 up to 2**24 columns).
        # Every chunk of a chunked caller writes the same value.
        size_row_ptr = stats_ptr + N_total * stride_stats_row
        tl.store(size_row_ptr + 0, V_local.to(tl.float32))
        tl.store(size_row_ptr + 1, 0.0)
        tl.store(size_row_ptr + 2, 0.0)
        tl.store(size_row_ptr + 3, 0.0)
    tl.store(stats_row_ptr + 0, m, mask=has_row)
    tl.store(stats_row_ptr + 1, s, mask=has_row)
    tl.store(stats_row_ptr + 2, u * LN2, mask=has_row)
    tl.store(stats_row_ptr + 3, x_target, mask=has_row)
