"""Sampling-filter threshold from candidates gathered in one read of the logits (Triton).

The kept set of every filter is ``{j : logit_j >= tau}`` (``mp_grpo/ops/sampling_filter.py``). tau depends
only on the largest logits of a row: top-k on the k largest, top-p on the largest whose mass reaches p,
min-p on those within ``T log(1 / min_p)`` of the maximum. So one read of the shard keeps its largest logits
(the candidates) and a tiny per-row kernel finishes the search on them; the rows it cannot finish (a
top-p set larger than the candidates: flat rows) take the radix passes of ``logprob_filter.py``.

**Order key.** ``sort_key`` maps a logit (bf16 / fp16: its 16 stored bits; fp32: 32) to a signed int32 whose
order is the logits' order (-0 counts as +0): ``bits >= 0 ? bits : bits ^ 0x7F..F``. ``key_value`` inverts it.

The candidates of a row come from two kernels:

``logprob_group_max_kernel`` — the statistics-like read of the shard (one program a row, ``[BLOCK_V / GROUP,
GROUP]`` tiles): the raw row maximum m, with HAS_SUM the sum-exp s = sum_j exp((x_j - m) / T), and the maximum of
every GROUP consecutive columns (``[N, V_local / GROUP]`` in the logits' dtype: 1/GROUP of the logits' bytes).
Per element it costs what the statistics cost: the group maxima are the online maximum's first step, and no
decision is taken during the read.

``logprob_candidates_kernel`` — one small program a row: theta = the KEEP-th largest group maximum (a KEY_BITS-step
bisection on counts over the row's group maxima), then the groups whose maximum is >= theta (in column order) are
read again from the logits and their columns >= theta kept, compacted in column order, in a buffer of CAP.

Invariants: every column with logit >= value(theta) lies in a chosen group (its group's maximum is >= it), so
the buffer holds every column >= value(theta); at least KEEP columns are >= value(theta) (KEEP distinct group
maxima); with fewer than KEEP groups theta is the smallest key and every column is a candidate. If ties at theta
choose more than GROUPS_CAP groups or leave more than CAP candidates, the row reports ``count = -1`` and the
fallback takes it. The second read touches ~KEEP groups of GROUP columns: ~KEEP x GROUP / V_local of the row.

``logprob_candidate_select_kernel`` — one program a row, the TP ranks' candidates (all-gathered) in registers:

    theta* = max_r theta_r; the columns >= value(theta*) over the whole vocabulary are exactly the buffered
             columns >= value(theta*) (each rank buffered all of its columns >= theta_r <= theta*)
    M      = max_r m_r, the row maximum; S = sum_r s_r exp((m_r - M) / T)
    min-p  tau = M + T log(min_p)
    top-k  among the candidates >= tau: if at least k, tau = the k-th largest (the largest key kappa with
           count(key >= kappa) >= k, a bisection); fewer than k keeps all of {x >= tau} — known only when
           tau >= value(theta*) (or theta* never rose); else the row is not finished here
    top-p  on what is left: S_f = the candidates' mass >= tau when tau >= value(theta*), S when tau = -inf;
           tau = value of the largest key kappa with mass(key >= kappa) >= p S_f — vLLM's rule (keep j iff the
           mass of strictly larger logits is < p S_f) is exactly {key >= kappa}; fp32 sums of non-negative
           terms in a fixed tree are monotone in the set summed, so the bisection is exact on them. Known
           only when mass(candidates >= theta*) >= p S_f (then kappa >= theta*)
    finish a row is finished when tau >= value(theta*) at the end (its kept set lies among the candidates);
           the others (min-p reaching below the candidates, no filter active on the row) take the fallback
    stats  (WRITE_STATS) for a finished row, this rank's shard statistics over its kept candidates, as
           ``logprob_stats_kernel`` writes them (the target's column left out of the sums), so that the usual
           all-gather and merge follow

Every sum runs over a fixed ``[TP_PAD, CAP * GROUP]`` tile in a fixed tree: the results of a row depend on
the row alone (batch invariance).
"""

import triton
import triton.language as tl

from mp_grpo.kernels.logprob_stats import LN2, LOG2E, MAX_SENTINEL


@triton.jit
def sort_key(x, KEY_BITS: tl.constexpr):
    """Signed int32 key of the logits ``x`` (in their stored dtype) in the logits' order; -0 is +0."""
    if KEY_BITS == 16:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32)  # sign-extended
        bits = tl.where(bits == -32768, 0, bits)
        return tl.where(bits >= 0, bits, bits ^ 0x7FFF)
    else:
        bits = (x.to(tl.float32) + 0.0).to(tl.int32, bitcast=True)  # x + 0 turns -0 into +0
        return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def key_value(key, x_ptr, KEY_BITS: tl.constexpr):
    """Inverse of :func:`sort_key`: the fp32 logit of ``key`` (int32), in the dtype of ``x_ptr``'s elements."""
    if KEY_BITS == 16:
        bits = tl.where(key >= 0, key, key ^ 0x7FFF)
        return bits.to(tl.int16).to(x_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
    else:
        bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
        return bits.to(tl.float32, bitcast=True)


@triton.jit
def _key_min(KEY_BITS: tl.constexpr):
    """The smallest key (int32 scalar): an admission threshold that admits everything."""
    if KEY_BITS == 16:
        return tl.full([], -32768, tl.int32)
    else:
        return tl.full([], -2147483648, tl.int32)


@triton.jit
def _total(x):
    """Sum of a 2-D tile in a fixed tree (rows, then the row sums)."""
    return tl.sum(tl.sum(x, axis=1), axis=0)


@triton.jit
def largest_key_reaching(keys, weights, target, KEY_BITS: tl.constexpr):
    """The largest key ``kappa`` (int32) with ``sum(weights[keys >= kappa]) >= target``, for a 2-D tile of keys
    and non-negative weights (0 for what does not count) whose total reaches ``target``: KEY_BITS bisection steps
    over the key range, each one masked sum."""
    lo = _key_min(KEY_BITS).to(tl.int64)
    hi = -lo - 1
    for _ in range(KEY_BITS):
        mid = lo + (hi - lo + 1) // 2
        reached = _total(tl.where(keys >= mid.to(tl.int32), weights, 0)) >= target
        lo = tl.where(reached, mid, lo)
        hi = tl.where(reached, hi, mid - 1)
    return lo.to(tl.int32)


@triton.jit
def _largest_key_reaching_1d(keys, weights, target, KEY_BITS: tl.constexpr):
    """:func:`largest_key_reaching` for a 1-D tile."""
    lo = _key_min(KEY_BITS).to(tl.int64)
    hi = -lo - 1
    for _ in range(KEY_BITS):
        mid = lo + (hi - lo + 1) // 2
        reached = tl.sum(tl.where(keys >= mid.to(tl.int32), weights, 0), axis=0) >= target
        lo = tl.where(reached, mid, lo)
        hi = tl.where(reached, hi, mid - 1)
    return lo.to(tl.int32)


@triton.jit
def logprob_group_max_kernel(
    # pointers
    x_ptr,  # [N, V_local] logits shard; fp32 / bf16 / fp16; last dim contiguous
    maxima_ptr,  # [N, n_groups] out, the logits' dtype: the maximum of each GROUP columns
    head_ptr,  # [N, 4] int32 out: words 0, 1 = the raw row maximum and (HAS_SUM) the sum-exp, fp32 bits
    # shapes
    V_local,
    n_groups,
    # strides
    stride_x_row,
    stride_maxima_row,
    stride_head_row,
    # scalars
    inv_temperature,  # fp32, 1 / temperature
    # meta-parameters
    GROUP: tl.constexpr,
    HAS_SUM: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    ROWS: tl.constexpr = BLOCK_V // GROUP
    row = tl.program_id(0).to(tl.int64)
    x_row_ptr = x_ptr + row * stride_x_row
    maxima_row_ptr = maxima_ptr + row * stride_maxima_row
    sub = tl.arange(0, ROWS)
    tile = sub[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    scale = inv_temperature * LOG2E
    m = tl.full([], MAX_SENTINEL, dtype=tl.float32)
    s = tl.zeros([], dtype=tl.float32)
    for start in range(0, V_local, BLOCK_V):
        # --- 1. the tile, its group maxima, the online maximum and sum ---
        cols = start + tile
        x = tl.load(x_row_ptr + cols, mask=cols < V_local, other=float("-inf"))
        xf = x.to(tl.float32)
        # A NaN logit counts as +inf in the maxima (tl.max skips NaN on the GPU, propagates it in the interpreter):
        # the row's maximum is then +inf on both, and the merge reports the row as it reports an unfiltered one.
        group_max = tl.max(tl.where(xf == xf, xf, float("inf")), axis=1)
        m_new = tl.maximum(m, tl.max(group_max, axis=0))
        if HAS_SUM:
            s = s * tl.exp2((m - m_new) * scale) + _total(tl.exp2((xf - m_new) * scale))
        m = m_new
        # --- 2. store the group maxima (exact: each is one of the logits) ---
        group = start // GROUP + sub
        tl.store(maxima_row_ptr + group, group_max.to(x.dtype), mask=group < n_groups)
    head_row_ptr = head_ptr + row * stride_head_row
    tl.store(head_row_ptr + 0, m.to(tl.int32, bitcast=True))
    tl.store(head_row_ptr + 1, s.to(tl.int32, bitcast=True))


@triton.jit
def logprob_candidates_kernel(
    # pointers
    x_ptr,  # [N, V_local] logits shard
    maxima_ptr,  # [N, n_groups] the group maxima of logprob_group_max_kernel
    index_ptr,  # [N, GROUPS_CAP] int32 scratch: the chosen groups
    head_ptr,  # [N, 4] int32 in/out: words 2, 3 = candidates kept (-1: overflow) and theta's key
    cand_ptr,  # [N, CAP] out, the logits' dtype: the candidates, in column order
    # shapes
    V_local,
    n_groups,
    # strides
    stride_x_row,
    stride_maxima_row,
    stride_index_row,
    stride_head_row,
    stride_cand_row,
    # meta-parameters
    KEY_BITS: tl.constexpr,
    GROUP: tl.constexpr,
    KEEP: tl.constexpr,  # groups at least: theta = the KEEP-th largest group maximum
    GROUPS_CAP: tl.constexpr,  # most groups read
    CAP: tl.constexpr,  # most candidates kept
    GROUPS_PAD: tl.constexpr,  # power of two >= n_groups
    CHUNK: tl.constexpr,  # groups read at a time
):
    row = tl.program_id(0).to(tl.int64)
    x_row_ptr = x_ptr + row * stride_x_row
    index_row_ptr = index_ptr + row * stride_index_row
    cand_row_ptr = cand_ptr + row * stride_cand_row
    lane = tl.arange(0, GROUP)

    # --- 1. theta: the KEEP-th largest group maximum (the smallest key when there are fewer groups: all) ---
    g = tl.arange(0, GROUPS_PAD)
    g_ok = g < n_groups
    g_key = sort_key(tl.load(maxima_ptr + row * stride_maxima_row + g, mask=g_ok, other=float("-inf")), KEY_BITS)
    theta = _largest_key_reaching_1d(g_key, g_ok.to(tl.int32), KEEP, KEY_BITS)

    # --- 2. the groups whose maximum reaches theta (every column >= theta lies in one), in column order ---
    chosen = g_ok & (g_key >= theta)
    n_chosen = tl.sum(chosen.to(tl.int32), axis=0)
    count = tl.full([], -1, dtype=tl.int32)  # -1: more than GROUPS_CAP groups or CAP candidates (ties)
    if n_chosen <= GROUPS_CAP:
        tl.store(index_row_ptr + tl.cumsum(chosen.to(tl.int32), axis=0) - 1, g, mask=chosen)
        tl.debug_barrier()  # every thread's indices are visible
        # --- 3. read the chosen groups, keep their columns >= theta, in column order ---
        kept = tl.zeros([], dtype=tl.int32)
        for c in range(0, n_chosen, CHUNK):
            j = c + tl.arange(0, CHUNK)
            j_ok = j < n_chosen
            group = tl.load(index_row_ptr + j, mask=j_ok, other=0)
            cols = group[:, None] * GROUP + lane[None, :]
            ok = j_ok[:, None] & (cols < V_local)
            v = tl.load(x_row_ptr + cols, mask=ok, other=float("-inf"))
            keep = ok & (sort_key(v, KEY_BITS) >= theta)
            per_group = tl.sum(keep.to(tl.int32), axis=1)
            pos = kept + (tl.cumsum(per_group, axis=0) - per_group)[:, None] + tl.cumsum(keep.to(tl.int32), axis=1) - 1
            tl.store(cand_row_ptr + pos, v, mask=keep & (pos < CAP))
            kept += tl.sum(per_group, axis=0)
        count = tl.where(kept <= CAP, kept, -1)
    head_row_ptr = head_ptr + row * stride_head_row
    tl.store(head_row_ptr + 2, count)
    tl.store(head_row_ptr + 3, theta)


@triton.jit
def logprob_candidate_select_kernel(
    # pointers
    head_ptr,  # [TP, N, 4] int32 gathered heads of logprob_candidates_kernel
    cand_ptr,  # [TP, N, CAP * GROUP] gathered candidates, the logits' dtype
    x_ptr,  # [N, V_local] this rank's logits shard (the target's logit; the key -> value map)
    target_ptr,  # [N] int64 global token ids (only with WRITE_STATS)
    top_k_ptr,  # [N] int32 k, 0: off (only with HAS_TOP_K)
    top_p_ptr,  # [N] fp32 p, >= 1: off (only with HAS_TOP_P)
    min_p_ptr,  # [N] fp32 min_p, 0: off (only with HAS_MIN_P)
    tau_ptr,  # [N] fp32 out: the threshold; where not finished, min-p's (the fallback goes on from it)
    row_max_ptr,  # [N] fp32 out: the raw row maximum over the whole vocabulary (>= MAX_SENTINEL)
    finished_ptr,  # [N] int8 out: 1 where this kernel found the threshold
    stats_ptr,  # [N_total + 1, 4] fp32 out (WRITE_STATS, finished rows): this shard's filtered statistics
    # shapes
    row_start,  # first stats row of this launch (chunked callers)
    V_local,
    vocab_start,  # first global id of this shard
    v_global,
    tp,
    rank,
    # strides
    stride_head_rank,
    stride_head_row,
    stride_cand_rank,
    stride_cand_row,
    stride_x_row,
    stride_stats_row,
    # scalars
    inv_temperature,  # fp32, 1 / temperature
    # meta-parameters
    KEY_BITS: tl.constexpr,
    GROUP: tl.constexpr,
    CAP: tl.constexpr,
    TP_PAD: tl.constexpr,  # next power of two >= tp
    HAS_MIN_P: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    WRITE_STATS: tl.constexpr,
):
    CAPG: tl.constexpr = CAP * GROUP
    row = tl.program_id(0).to(tl.int64)
    scale = inv_temperature * LOG2E
    ranks = tl.arange(0, TP_PAD)
    rank_ok = ranks < tp

    # --- 1. the ranks' heads: theta*, overflow, partial sums ---
    head = head_ptr + ranks * stride_head_rank + row * stride_head_row
    m_r = tl.where(rank_ok, tl.load(head + 0, mask=rank_ok, other=0).to(tl.float32, bitcast=True), MAX_SENTINEL)
    s_r = tl.where(rank_ok, tl.load(head + 1, mask=rank_ok, other=0).to(tl.float32, bitcast=True), 0.0)
    count_r = tl.load(head + 2, mask=rank_ok, other=0)
    theta = tl.max(tl.load(head + 3, mask=rank_ok, other=-2147483648), axis=0)
    finished = tl.max((rank_ok & (count_r < 0)).to(tl.int32), axis=0) == 0
    complete = theta == _key_min(KEY_BITS)  # no rank raised theta: every column is a candidate
    theta_value = key_value(theta, x_ptr, KEY_BITS)

    # --- 2. the candidates >= theta*, the row maximum M and the whole mass S ---
    slots = tl.arange(0, CAPG)
    c_ok = rank_ok[:, None] & (slots[None, :] < (tl.maximum(count_r, 0) * GROUP)[:, None])
    raw = tl.load(cand_ptr + ranks[:, None] * stride_cand_rank + row * stride_cand_row + slots[None, :],
                  mask=c_ok, other=float("nan"))
    v = raw.to(tl.float32)
    key = sort_key(raw, KEY_BITS)
    ok = c_ok & (v == v) & (key >= theta)
    # The online maxima (also known where a rank's buffer overflowed); MAX_SENTINEL: an all -inf row, whose
    # masses are then 0, not NaN.
    m_safe = tl.max(m_r, axis=0)
    row_max = tl.where(m_safe > MAX_SENTINEL, m_safe, float("-inf"))
    tau = tl.full([], float("-inf"), dtype=tl.float32)

    # --- 3. min-p: p_j >= min_p p_max  <=>  x_j >= M + T log(min_p) ---
    if HAS_MIN_P:
        tau = row_max + tl.log(tl.load(min_p_ptr + row)) / inv_temperature

    # --- 4. top-k: the k-th largest of the candidates >= tau ---
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + row)
        live = ok & (v >= tau)
        n_live = _total(live.to(tl.int32))
        if finished & (k > 0):
            if n_live >= k:
                kth = largest_key_reaching(key, live.to(tl.int32), k, KEY_BITS)
                tau = tl.maximum(tau, key_value(kth, x_ptr, KEY_BITS))
            else:
                # Fewer than k: top-k keeps all of {x >= tau}, known only when the candidates hold all of it.
                finished = complete | (tau >= theta_value)

    # --- 5. top-p on what min-p and top-k left ---
    if HAS_TOP_P:
        p = tl.load(top_p_ptr + row)
        e = tl.where(ok & (v >= tau), tl.exp2((v - m_safe) * scale), 0.0)
        mass = _total(e)
        if finished & (p < 1.0):
            covered = complete | (tau >= theta_value)
            # The kept mass S_f: all among the candidates when they cover {x >= tau}; the row's whole mass
            # when nothing cut it before (tau = -inf); otherwise unknown here.
            whole = tl.sum(s_r * tl.exp2((m_r - m_safe) * scale), axis=0)
            budget = p * tl.where(covered, mass, whole)
            finished = (covered | (tau == float("-inf"))) & (mass >= budget)
            if finished:
                kappa = largest_key_reaching(key, e, budget, KEY_BITS)
                tau = tl.maximum(tau, key_value(kappa, x_ptr, KEY_BITS))

    # The statistics below sum the candidates: they hold every kept column only when tau >= value(theta*).
    finished = finished & (complete | (tau >= theta_value))
    tl.store(tau_ptr + row, tau)
    tl.store(row_max_ptr + row, m_safe)
    tl.store(finished_ptr + row, finished.to(tl.int8))

    # --- 6. a finished row: this shard's statistics over its kept candidates (logprob_stats_kernel's form) ---
    if WRITE_STATS:
        mine = ok & (ranks[:, None] == rank) & (v >= tau)
        m_f = tl.maximum(tl.max(tl.max(tl.where(mine, v, float("-inf")), axis=1), axis=0), MAX_SENTINEL)
        local_target = tl.load(target_ptr + row) - vocab_start
        owns = (local_target >= 0) & (local_target < V_local)
        x_target = tl.load(x_ptr + row * stride_x_row + local_target, mask=owns, other=0.0).to(tl.float32)
        # The sums leave out the target's column, as logprob_stats_kernel's do. The candidates keep no column ids:
        # the first kept candidate of the target's value stands for it (equal values have equal terms), and a
        # kept target is among them (they hold every kept column of this shard).
        slot = ranks[:, None] * CAPG + slots[None, :]
        is_target = mine & owns & (v == x_target)
        target_slot = tl.min(tl.min(tl.where(is_target, slot, TP_PAD * CAPG), axis=1), axis=0)
        t = (v - m_f) * scale
        e_f = tl.where(mine & (slot != target_slot), tl.exp2(t), 0.0)
        s_f = _total(e_f)
        u_f = tl.zeros([], dtype=tl.float32)
        if HAS_ENTROPY:
            u_f = _total(tl.where(e_f > 0.0, e_f * t, 0.0))
        x_target = tl.where(owns & (x_target < tau), float("-inf"), x_target)
        out = stats_ptr + (row_start + row) * stride_stats_row
        tl.store(out + 0, m_f, mask=finished)
        tl.store(out + 1, s_f, mask=finished)
        tl.store(out + 2, u_f * LN2, mask=finished)
        tl.store(out + 3, x_target, mask=finished)
