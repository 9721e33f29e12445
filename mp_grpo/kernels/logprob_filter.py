"""Sampling-filter threshold search: an exact radix select over the logits' order-preserving key (Triton).

The kept set of every filter (top-k, top-p) is ``{j : logit_j >= tau}`` for one raw-logit threshold per
row (``mp_grpo/ops/sampling_filter.py``). ``tau`` is a logit value, so it is found digit by digit on an
unsigned integer key whose order is the order of the logits:

    KEY_BITS = 16 for bf16 / fp16 logits (the stored 16 bits), 32 for fp32
    bits  = the logit's bit pattern as a signed integer (-0 first turned into +0)
    key   = (bits >= 0 ? bits : bits ^ (2^(KEY_BITS-1) - 1)) + 2^(KEY_BITS-1)     (unsigned, monotone)

Temperature divides every logit by the same T > 0: it does not change the order, only the masses.
Each pass looks at one digit ``(key >> shift) & (2^DIGIT_BITS - 1)`` of the columns whose higher key bits
equal the row's ``prefix`` (the digits chosen so far) and whose logit is >= ``tau_in`` (the thresholds of
the filters applied before: min-p, then top-k), and writes one histogram row per logits row:

    MODE_COUNT  int32 count per digit                       (top-k; DIGIT_BITS = 8, ``tl.histogram``)
    MODE_MASS   fp32 sum of exp((x - M) / T) per digit      (top-p; DIGIT_BITS = 4, a weighted one-hot on a
                                                             [BINS, BLOCK_V] tile)
    MODE_EXACT  fp32 count x exp((v - M) / T) per digit     (top-p, the last 8 key bits: each digit is
                                                             one exact logit value v, so counts suffice)

M is the row maximum over the whole vocabulary. ``logprob_radix_select_kernel`` then picks the digit
from the TP-summed histogram. Weighted sums cannot use ``tl.histogram`` (it counts), and a weighted
one-hot costs ~3 instructions per element per bin: hence 16 bins for masses, 256 for counts.

Summation order of the masses: each (digit, column-in-block) accumulator adds its column's blocks in order,
and one reduction over the BLOCK_V columns ends the row; BLOCK_V and the warps depend on V_local only
(``launch_config.py``), so the histogram of a row does not depend on the other rows (batch invariance).
Formulation: the tile is loaded as ``[1, BLOCK_V]`` and compared with a ``[BINS, 1]`` column of digits, a
broadcast in the load's own register layout (a ``[BLOCK_V]`` load compared as ``digit[:, None] == bins[None, :]``
made the compiler move both vectors through shared memory into the accumulator's layout every block: 6x slower).

These passes are the fallback of the search (``ops/sampling_filter.py``): the rows that the candidates of
``logprob_candidates.py`` cannot finish. With HAS_SKIP, the rows whose ``skip`` flag is set read nothing and
write nothing (their histogram rows are left as they are and never read). Under tensor parallelism each pass is
a launch (its histograms are all-reduced between the pass and the pick); at TP = 1
``logprob_radix_search_kernel`` runs a row's whole search in one program, the same passes and picks.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
MODE_COUNT = tl.constexpr(0)
MODE_MASS = tl.constexpr(1)
MODE_EXACT = tl.constexpr(2)


@triton.jit
def _order_key(x, KEY_BITS: tl.constexpr):
    """Unsigned order-preserving key of the logits ``x`` (in their stored dtype), as int32 (16 bits) or uint32."""
    if KEY_BITS == 16:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32)  # sign-extended
        bits = tl.where(bits == -32768, 0, bits)  # -0 is +0
        return tl.where(bits >= 0, bits, bits ^ 0x7FFF) + 32768
    else:
        bits = (x.to(tl.float32) + 0.0).to(tl.int32, bitcast=True)  # x + 0 turns -0 into +0
        signed = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        return signed.to(tl.uint32, bitcast=True) ^ 0x80000000


@triton.jit
def _key_value(key, dtype_ptr, KEY_BITS: tl.constexpr):
    """Inverse of ``_order_key``: the fp32 logit of ``key`` (an int32 / uint32 tensor); NaN for keys no value has."""
    if KEY_BITS == 16:
        signed = key.to(tl.int32) - 32768
        bits = tl.where(signed >= 0, signed, signed ^ 0x7FFF)
        return bits.to(tl.int16).to(dtype_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
    else:
        signed = (key.to(tl.uint32) ^ 0x80000000).to(tl.int32, bitcast=True)
        bits = tl.where(signed >= 0, signed, signed ^ 0x7FFFFFFF)
        return bits.to(tl.float32, bitcast=True)


@triton.jit
def _digit_and_member(x, in_row, tau, prefix, shift, KEY_BITS: tl.constexpr, DIGIT_BITS: tl.constexpr,
                      HAS_PREFIX: tl.constexpr):
    """fp32 logits, key digit at ``shift`` and membership (in the row, >= tau, higher digits == prefix) of a tile."""
    xf = x.to(tl.float32)
    key = _order_key(x, KEY_BITS)
    digit = ((key >> shift) & ((1 << DIGIT_BITS) - 1)).to(tl.int32)
    member = in_row & (xf >= tau)
    if HAS_PREFIX:
        # With a prefix, shift + DIGIT_BITS < KEY_BITS: a valid shift amount.
        member &= (key >> (shift + DIGIT_BITS)).to(tl.int32) == prefix
    return xf, digit, member


@triton.jit
def radix_histogram_row(
    row, run, x_ptr, tau_ptr, prefix_ptr, row_max_ptr, hist_ptr, row_max_out_ptr, V_local, stride_x_row,
    stride_hist_row, inv_temperature, shift,
    KEY_BITS: tl.constexpr, DIGIT_BITS: tl.constexpr, MODE: tl.constexpr, HAS_PREFIX: tl.constexpr,
    HAS_ROW_MAX_OUT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One pass of ``logprob_radix_hist_kernel`` for the row ``row`` (nothing read or written unless ``run``)."""
    BINS: tl.constexpr = 1 << DIGIT_BITS
    x_row_ptr = x_ptr + row * stride_x_row
    v_end = tl.where(run, V_local, 0)
    offs = tl.arange(0, BLOCK_V)
    bins = tl.arange(0, BINS)
    scale = inv_temperature * LOG2E

    # --- 1. per-row scalars ---
    tau = tl.load(tau_ptr + row)
    prefix = tl.load(prefix_ptr + row)
    if MODE != MODE_COUNT:
        row_max = tl.load(row_max_ptr + row)

    # --- 2. one pass over the row: key, digit, membership; accumulate the histogram ---
    if MODE == MODE_MASS:
        # Weighted one-hot on a [BINS, BLOCK_V] tile loaded as [1, BLOCK_V] rows: no layout conversion in the
        # loop (module docstring); one reduction over the columns at the end of the row.
        tl.static_assert(not HAS_ROW_MAX_OUT, "the row maximum is a by-product of counting passes only")
        offs_2d = tl.arange(0, BLOCK_V)[None, :]
        bins_2d = tl.arange(0, BINS)[:, None]
        masses = tl.zeros([BINS, BLOCK_V], dtype=tl.float32)
        for start in range(0, v_end, BLOCK_V):
            cols = start + offs_2d
            in_row = cols < V_local
            x = tl.load(x_row_ptr + cols, mask=in_row, other=float("-inf"))
            xf, digit, member = _digit_and_member(x, in_row, tau, prefix, shift, KEY_BITS, DIGIT_BITS, HAS_PREFIX)
            # A -inf logit weighs exp2(-inf) = 0.
            e = tl.where(member, tl.exp2((xf - row_max) * scale), 0.0)
            masses += tl.where(digit == bins_2d, e, 0.0)
    else:
        counts = tl.zeros([BINS], dtype=tl.int32)
        left_out = tl.zeros([BLOCK_V], dtype=tl.int32)
        if HAS_ROW_MAX_OUT:
            m = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
        for start in range(0, v_end, BLOCK_V):
            cols = start + offs
            in_row = cols < V_local
            x = tl.load(x_row_ptr + cols, mask=in_row, other=float("-inf"))
            xf, digit, member = _digit_and_member(x, in_row, tau, prefix, shift, KEY_BITS, DIGIT_BITS, HAS_PREFIX)
            if HAS_ROW_MAX_OUT:
                m = tl.maximum(m, xf)
            # Non-members are counted in digit 0 and taken out again below: on the H100 (Triton 3.6) within
            # run-to-run noise of tl.histogram(digit, BINS, mask=member) (8.7-9.2 vs 9.0-9.6 ms a pass at
            # N = 16384, V = 151936, two runs).
            counts += tl.histogram(tl.where(member, digit, 0), BINS)
            left_out += (~member).to(tl.int32)

    # --- 3. store the histogram row (and the shard's row maximum) ---
    hist_row_ptr = hist_ptr + row * stride_hist_row + bins
    if MODE == MODE_MASS:
        tl.store(hist_row_ptr, tl.sum(masses, axis=1), mask=tl.where(run, bins < BINS, False))
    else:
        counts -= tl.where(bins == 0, tl.sum(left_out, axis=0), 0)
        if MODE == MODE_COUNT:
            tl.store(hist_row_ptr, counts, mask=tl.where(run, bins < BINS, False))
        else:
            # Every digit of the last pass is one logit value v: its mass is count * exp((v - M) / T).
            if KEY_BITS == 16:
                last_keys = (prefix << DIGIT_BITS) | bins
            else:
                last_keys = ((prefix << DIGIT_BITS) | bins).to(tl.uint32, bitcast=True)
            v = _key_value(last_keys, x_ptr, KEY_BITS)
            # Keys no value has (NaN patterns) have count 0; select, since 0 * NaN is NaN.
            tl.store(hist_row_ptr, tl.where(counts > 0, counts.to(tl.float32) * tl.exp2((v - row_max) * scale), 0.0),
                     mask=tl.where(run, bins < BINS, False))
    if HAS_ROW_MAX_OUT:
        tl.store(row_max_out_ptr + row, tl.max(m, axis=0), mask=run)


@triton.jit
def logprob_radix_hist_kernel(
    # pointers
    x_ptr,  # [N, V_local] logits shard; fp32 / bf16 / fp16; last dim contiguous
    tau_ptr,  # [N] fp32 raw-logit threshold of the filters applied before (-inf: none)
    prefix_ptr,  # [N] int32 key digits chosen so far (the key's bits above shift + DIGIT_BITS)
    row_max_ptr,  # [N] fp32 raw-logit row maximum over the whole vocabulary (MODE_MASS / MODE_EXACT)
    hist_ptr,  # [N, 2**DIGIT_BITS] out: int32 (MODE_COUNT) or fp32
    row_max_out_ptr,  # [N] fp32 out: this shard's row maximum (only with HAS_ROW_MAX_OUT)
    skip_ptr,  # [N] int8: rows to leave alone (only with HAS_SKIP)
    # shapes
    V_local,
    # strides
    stride_x_row,
    stride_hist_row,
    # scalars
    inv_temperature,  # fp32, 1 / temperature
    shift,  # bit position of the digit in the key
    # meta-parameters
    KEY_BITS: tl.constexpr,
    DIGIT_BITS: tl.constexpr,
    MODE: tl.constexpr,
    HAS_PREFIX: tl.constexpr,  # False on a search's first pass (no digit chosen yet)
    HAS_ROW_MAX_OUT: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if HAS_SKIP:
        run = tl.load(skip_ptr + row) == 0
    else:
        run = tl.full([], 1, tl.int1)
    radix_histogram_row(row, run, x_ptr, tau_ptr, prefix_ptr, row_max_ptr, hist_ptr, row_max_out_ptr, V_local,
                        stride_x_row, stride_hist_row, inv_temperature, shift, KEY_BITS, DIGIT_BITS, MODE, HAS_PREFIX,
                        HAS_ROW_MAX_OUT, BLOCK_V)


@triton.jit
def radix_select_row(
    row, run, hist_ptr, x_ptr, prefix_ptr, budget_ptr, above_ptr, top_p_ptr, tau_ptr, stride_hist_row,
    KEY_BITS: tl.constexpr, DIGIT_BITS: tl.constexpr, IS_TOP_P: tl.constexpr, IS_FIRST: tl.constexpr,
    IS_LAST: tl.constexpr,
):
    """``logprob_radix_select_kernel`` for the row ``row`` (nothing written unless ``run``)."""
    BINS: tl.constexpr = 1 << DIGIT_BITS
    # Reversed digit order: r = 0 is the largest digit, so inclusive / exclusive scans from the top.
    r = tl.arange(0, BINS)
    digit = BINS - 1 - r
    hist_row_ptr = hist_ptr + row * stride_hist_row
    h = tl.load(hist_row_ptr + digit)
    # The histogram shifted by one digit: excl[r] = sum of the digits strictly above `digit`.
    h_above = tl.load(hist_row_ptr + digit + 1, mask=r > 0, other=0)
    prefix = tl.load(prefix_ptr + row)

    # --- 1. pick the digit holding the threshold ---
    if IS_TOP_P:
        p = tl.load(top_p_ptr + row)
        active = p < 1.0
        if IS_FIRST:
            # The first pass covers every kept key: its total is S, the kept mass.
            budget = p * tl.sum(h, axis=0)
            above = 0.0
        else:
            budget = tl.load(budget_ptr + row)
            above = tl.load(above_ptr + row)
        # F[r] = kept mass strictly above digit[r]; non-increasing in the digit. The threshold key is
        # the smallest with F < p * S: the lowest such digit, i.e. the last r from the top.
        f = above + tl.cumsum(h_above, axis=0)
        ok = f < budget
        chosen_r = tl.max(tl.where(ok, r, 0), axis=0)
        new_above = tl.sum(tl.where(r == chosen_r, f, 0.0), axis=0)
        tl.store(budget_ptr + row, budget, mask=run)
        tl.store(above_ptr + row, new_above, mask=run)
    else:
        k = tl.load(budget_ptr + row)
        # ge[r] = kept keys >= digit[r]; the k-th largest key is in the largest digit with ge >= k.
        ge = tl.cumsum(h, axis=0)
        active = (k > 0) & (k <= tl.sum(h, axis=0))  # fewer kept tokens than k: keep them all
        chosen_r = tl.min(tl.where(ge >= k, r, BINS - 1), axis=0)
        above_count = tl.sum(tl.where(r == chosen_r, ge - h, 0), axis=0)
        tl.store(budget_ptr + row, tl.where(active, k - above_count, 0), mask=run)
    new_prefix = (prefix << DIGIT_BITS) | (BINS - 1 - chosen_r)
    tl.store(prefix_ptr + row, new_prefix, mask=run)

    # --- 2. last pass: the prefix is the whole key of the threshold ---
    if IS_LAST:
        if KEY_BITS == 16:
            key = new_prefix
        else:
            key = new_prefix.to(tl.uint32, bitcast=True)
        v = _key_value(key, x_ptr, KEY_BITS)
        v = tl.where(v != v, float("-inf"), v)  # a key no value has (rounding at p ~ 1): keep all
        tau = tl.load(tau_ptr + row)
        tl.store(tau_ptr + row, tl.where(active, tl.maximum(tau, v), tau), mask=run)


@triton.jit
def logprob_radix_select_kernel(
    # pointers
    hist_ptr,  # [N, 2**DIGIT_BITS] TP-summed histogram: int32 counts (top-k) or fp32 masses (top-p)
    x_ptr,  # the logits (only their dtype is used: the key -> value map)
    prefix_ptr,  # [N] int32 in/out: key digits chosen so far
    budget_ptr,  # [N] in/out; top-k: int32 tokens still to keep (0: row off); top-p: fp32 target p * S
    above_ptr,  # [N] fp32 in/out (top-p): kept mass with a key above the current prefix's range
    top_p_ptr,  # [N] fp32 (top-p): p; rows with p >= 1 are off
    tau_ptr,  # [N] fp32 in/out: raw-logit threshold; raised on the last pass
    skip_ptr,  # [N] int8: rows to leave alone (only with HAS_SKIP)
    # shapes
    N,
    # strides
    stride_hist_row,
    # meta-parameters
    KEY_BITS: tl.constexpr,
    DIGIT_BITS: tl.constexpr,
    IS_TOP_P: tl.constexpr,
    IS_FIRST: tl.constexpr,
    IS_LAST: tl.constexpr,
    HAS_SKIP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if HAS_SKIP:
        run = tl.load(skip_ptr + row) == 0
    else:
        run = tl.full([], 1, tl.int1)
    radix_select_row(row, run, hist_ptr, x_ptr, prefix_ptr, budget_ptr, above_ptr, top_p_ptr, tau_ptr, stride_hist_row,
                     KEY_BITS, DIGIT_BITS, IS_TOP_P, IS_FIRST, IS_LAST)


@triton.jit
def logprob_radix_search_kernel(
    # pointers
    x_ptr,  # [N, V_local] logits (TP = 1: the whole vocabulary)
    tau_ptr,  # [N] fp32 in/out: the threshold of the filters applied before (min-p), raised by top-k, top-p
    row_max_ptr,  # [N] fp32 raw row maximum (top-p's masses)
    top_k_ptr,  # [N] int32 in/out (HAS_TOP_K): k, 0: off; the search's budget
    top_p_ptr,  # [N] fp32 (HAS_TOP_P): p, >= 1: off
    prefix_ptr,  # [N] int32 scratch: key digits chosen so far
    budget_ptr,  # [N] fp32 scratch (top-p): p * S
    above_ptr,  # [N] fp32 scratch (top-p): kept mass above the current prefix's range
    count_hist_ptr,  # [N, 256] int32 scratch: a counting pass's histogram
    mass_hist_ptr,  # [N, 256] fp32 scratch: a mass pass's histogram
    skip_ptr,  # [N] int8: rows to leave alone (the candidates finished them)
    # shapes
    V_local,
    # strides
    stride_x_row,
    # scalars
    inv_temperature,
    # meta-parameters
    KEY_BITS: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    COUNT_BLOCK_V: tl.constexpr,
    MASS_BLOCK_V: tl.constexpr,
):
    """The whole radix search of a row in one program (TP = 1: no histogram has to meet other ranks'): top-k's
    counting passes, then top-p's mass passes and its exact last pass, each pass a read of the row and a pick
    of the digit — the passes and picks of the two kernels above, one launch instead of two a pass. The
    histograms and the search state go through this row's scratch (a barrier between writing and reading)."""
    row = tl.program_id(0).to(tl.int64)
    run = tl.load(skip_ptr + row) == 0
    if run:
        if HAS_TOP_K:
            tl.store(prefix_ptr + row, 0)
            tl.debug_barrier()
            for i in tl.static_range(KEY_BITS // 8):
                radix_histogram_row(row, run, x_ptr, tau_ptr, prefix_ptr, row_max_ptr, count_hist_ptr, row_max_ptr,
                                    V_local, stride_x_row, 256, inv_temperature, KEY_BITS - 8 * (i + 1), KEY_BITS, 8,
                                    MODE_COUNT, i > 0, False, COUNT_BLOCK_V)
                tl.debug_barrier()
                radix_select_row(row, run, count_hist_ptr, x_ptr, prefix_ptr, top_k_ptr, above_ptr, top_p_ptr,
                                 tau_ptr, 256, KEY_BITS, 8, False, i == 0, i == KEY_BITS // 8 - 1)
                tl.debug_barrier()
        if HAS_TOP_P:
            tl.store(prefix_ptr + row, 0)
            tl.debug_barrier()
            for i in tl.static_range((KEY_BITS - 8) // 4):
                radix_histogram_row(row, run, x_ptr, tau_ptr, prefix_ptr, row_max_ptr, mass_hist_ptr, row_max_ptr,
                                    V_local, stride_x_row, 256, inv_temperature, KEY_BITS - 4 * (i + 1), KEY_BITS, 4,
                                    MODE_MASS, i > 0, False, MASS_BLOCK_V)
                tl.debug_barrier()
                radix_select_row(row, run, mass_hist_ptr, x_ptr, prefix_ptr, budget_ptr, above_ptr, top_p_ptr,
                                 tau_ptr, 256, KEY_BITS, 4, True, i == 0, False)
                tl.debug_barrier()
            radix_histogram_row(row, run, x_ptr, tau_ptr, prefix_ptr, row_max_ptr, mass_hist_ptr, row_max_ptr,
                                V_local, stride_x_row, 256, inv_temperature, 0, KEY_BITS, 8, MODE_EXACT, True, False,
                                COUNT_BLOCK_V)
            tl.debug_barrier()
            radix_select_row(row, run, mass_hist_ptr, x_ptr, prefix_ptr, budget_ptr, above_ptr, top_p_ptr, tau_ptr,
                             256, KEY_BITS, 8, True, False, True)
