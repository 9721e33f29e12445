"""Shared Triton helpers of the fused GRPO loss kernels (``grpo_loss_token``, ``grpo_loss_combine``,
``grpo_loss_backward``, ``grpo_loss_finalize``).

- Token blocks: the sequence of each position (padded rows or packed segments), validity, inputs
  loaded as 0 on masked positions (never read there, so inf / NaN cannot reach a value); ``token_inputs``
  drops a valid position with a NaN / ±inf input as if it were masked, and flags it per input.
- ``segment_add``: one block's per-sequence sums added to a ``[S, NUM_COLS]`` float64 buffer with a
  float64 segmented scan (each sequence's sum of its own positions) and one atomic add per sequence end — a
  handful of atomics per block, whatever the sequence lengths.
- ``token_inputs`` / ``gmpo_clip``: the loads and config parameters around the per-token formulas of
  ``token_math`` (written once there, for these kernels and the torch path).

The codes, slots and floors they read are in :mod:`mp_grpo.kernels.grpo_loss_constants`.
"""

import triton
import triton.language as tl

from mp_grpo.kernels.grpo_loss_constants import P_GMPO_HIGH, P_GMPO_LOW, P_LOG_RATIO_CLAMP
from mp_grpo.kernels.logprob_merge import add_error_counts, merge_rows
from mp_grpo.kernels.token_math import clamp_sym, gmpo_log_clip


# ------------------------------------------------------------------------------------ helpers
@triton.jit
def sequence_index(offs, cu_ptr, T, S, search_steps, PACKED: tl.constexpr):
    """Sequence of each position: ``offs // T`` for padded rows; for packed segments the number of
    ``cu[1:]`` entries ≤ the position (``torch.bucketize(..., right=True)``; S past the last segment),
    by a branch-free binary search of ``search_steps`` = S.bit_length() steps."""
    if PACKED:
        lo = tl.zeros_like(offs)
        hi = tl.zeros_like(offs) + S
        for _ in range(search_steps):
            active = lo < hi
            mid = (lo + hi) // 2
            bound = tl.load(cu_ptr + mid + 1, mask=active, other=0)
            right = active & (bound <= offs)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(active & (bound > offs), mid, hi)
        seq = lo
    else:
        seq = offs // T
    return seq


@triton.jit
def token_block(pid, mask_ptr, cu_ptr, N, T, S, search_steps, PACKED: tl.constexpr, BLOCK: tl.constexpr):
    """(positions, their sequence, valid) of block ``pid``: valid = in range, loss mask ≠ 0, inside a sequence."""
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < N
    seq = sequence_index(offs, cu_ptr, T, S, search_steps, PACKED)
    mask = tl.load(mask_ptr + offs, mask=in_range, other=0)
    valid = in_range & (mask != 0) & (seq < S)
    return offs, seq, valid


@triton.jit
def load_clean(ptr, offs, valid, COMPUTE: tl.constexpr):
    """``ptr[offs]`` in the compute dtype where valid; 0 elsewhere, without reading it."""
    return tl.load(ptr + offs, mask=valid, other=0.0).to(COMPUTE)


@triton.jit
def param(params_ptr, slot, COMPUTE: tl.constexpr):
    """One config parameter, rounded to the compute dtype (as the torch path rounds a Python scalar)."""
    return tl.load(params_ptr + slot).to(COMPUTE)


@triton.jit
def nonfinite(x):
    """NaN or ±inf (a comparison with NaN is false)."""
    return ~(tl.abs(x) < float("inf"))


@triton.jit
def token_inputs(
    lp_ptr, ent_ptr, old_ptr, rollout_ptr, ref_ptr, adv_ptr, stats_ptr, target_ptr, row_out_ptr, errors_ptr,
    offs, seq, valid, params_ptr, N, TP, V_global, ignore_index, stride_stats_rank, stride_stats_row, inv_temperature,
    HAS_ENTROPY: tl.constexpr, FROM_STATS: tl.constexpr, STORE_ROWS: tl.constexpr, HAS_OLD: tl.constexpr,
    HAS_ROLLOUT: tl.constexpr, HAS_REF: tl.constexpr, BYPASS: tl.constexpr, ADV_PER_TOKEN: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    """Every token input of the block, loaded at the valid positions only, then checked and sanitized:

    1. log π_θ and the entropy, loaded from ``lp_ptr`` / ``ent_ptr`` or with FROM_STATS merged from the
       all-gathered ``[TP, N + 1, 4]`` log-prob statistics (``logprob_merge.merge_rows``, the log-prob op's merge)
       — then with STORE_ROWS also (M, log S, entropy, 1 - p_t, log p_t + H) of every position in range stored at
       ``row_out_ptr + {0, N, 2N, 3N, 4N}`` for the log-prob backward, and the merge's error counts added into
       ``errors_ptr``; log π_old, the rollout and reference log-probs, A (per token, or per sequence).
    2. ``kept`` = valid and every input given finite there: a position with a NaN or ±inf input is dropped, as
       if masked; ``bad_*`` flag, per input, the valid positions where it is not finite (both kernels compute the
       same ``kept``, so the per-sequence sums and the shares see the same positions).
    3. Every input 0 where not kept (``tl.where``: a NaN or inf never reaches a value or a gradient); the clamped
       log-ratio ℓ, its gradient mask and d = clamp(trainer − rollout) (0 without rollout log-probs). On-policy
       (no old log-probs) π_old = stopgrad π_θ: ℓ = 0 with gradient 1. Bypass: π_old = rollout and the trainer
       side of d is stopgrad π_θ.

    Returns (kept, lp, ent, old, rollout, ref, adv, ℓ, ℓ inside its clamp, d, bad_lp, bad_old, bad_rollout,
    bad_ref, bad_adv, bad_ent); entropy, reference and absent inputs are 0.
    """
    in_range = offs < N
    # --- 1. loads at the valid positions ---
    if FROM_STATS:
        merged, entropy, row_max, log_sum, complement, centered, shard_mismatches, out_of_range, bad_rows = merge_rows(
            stats_ptr, target_ptr, offs, in_range, N, TP, V_global, ignore_index, stride_stats_rank,
            stride_stats_row, inv_temperature, HAS_ENTROPY,
        )
        lp = tl.where(valid, merged, 0.0).to(COMPUTE)
        ent = tl.where(valid, entropy, 0.0).to(COMPUTE)
        if STORE_ROWS:
            tl.store(row_out_ptr + offs, row_max, mask=in_range)
            tl.store(row_out_ptr + N + offs, log_sum, mask=in_range)
            tl.store(row_out_ptr + 3 * N + offs, complement, mask=in_range)
            if HAS_ENTROPY:
                tl.store(row_out_ptr + 2 * N + offs, entropy, mask=in_range)
                tl.store(row_out_ptr + 4 * N + offs, centered, mask=in_range)
            add_error_counts(errors_ptr, shard_mismatches, out_of_range, bad_rows, in_range)
    else:
        lp = load_clean(lp_ptr, offs, valid, COMPUTE)
        ent = tl.zeros_like(lp)
        if HAS_ENTROPY:
            ent = load_clean(ent_ptr, offs, valid, COMPUTE)
    zero = tl.zeros_like(lp)
    rollout = zero
    if HAS_ROLLOUT:
        rollout = load_clean(rollout_ptr, offs, valid, COMPUTE)
    old = zero
    if HAS_OLD:
        old = load_clean(old_ptr, offs, valid, COMPUTE)
    ref = zero
    if HAS_REF:
        ref = load_clean(ref_ptr, offs, valid, COMPUTE)
    if ADV_PER_TOKEN:
        adv = load_clean(adv_ptr, offs, valid, COMPUTE)
    else:
        adv = tl.load(adv_ptr + seq, mask=valid, other=0.0).to(COMPUTE)
    # --- 2. the positions kept: every input finite (absent ones are 0) ---
    bad_lp = valid & nonfinite(lp)
    bad_ent = valid & nonfinite(ent)
    bad_old = valid & nonfinite(old)
    bad_rollout = valid & nonfinite(rollout)
    bad_ref = valid & nonfinite(ref)
    bad_adv = valid & nonfinite(adv)
    kept = valid & ~(bad_lp | bad_ent | bad_old | bad_rollout | bad_ref | bad_adv)
    # --- 3. sanitized inputs, log-ratios ---
    lp = tl.where(kept, lp, 0.0)
    ent = tl.where(kept, ent, 0.0)
    rollout = tl.where(kept, rollout, 0.0)
    ref = tl.where(kept, ref, 0.0)
    adv = tl.where(kept, adv, 0.0)
    if HAS_OLD:
        old = tl.where(kept, old, 0.0)
    elif BYPASS:
        old = rollout
    else:
        old = lp
    clamp = param(params_ptr, P_LOG_RATIO_CLAMP, COMPUTE)
    log_ratio, log_ratio_inside = clamp_sym(lp - old, clamp)
    d = zero
    if HAS_ROLLOUT:
        if BYPASS:
            d, _ = clamp_sym(lp - rollout, clamp)
        else:
            d, _ = clamp_sym(old - rollout, clamp)
    return (kept, lp, ent, old, rollout, ref, adv, log_ratio, log_ratio_inside, d,
            bad_lp, bad_old, bad_rollout, bad_ref, bad_adv, bad_ent)


@triton.jit
def gmpo_clip(log_ratio, adv, params_ptr, COMPUTE: tl.constexpr):
    """GMPO's one-sided clip in log space with the config's bounds (``token_math.gmpo_log_clip``):
    (clipped ℓ, lower clip active, upper clip active)."""
    high_bound = param(params_ptr, P_GMPO_HIGH, COMPUTE)
    low_bound = param(params_ptr, P_GMPO_LOW, COMPUTE)
    clipped, _, low, high = gmpo_log_clip(log_ratio, adv, low_bound, high_bound)
    return clipped, low, high


@triton.jit
def block_ends(offs, seq_next, seq, N, BLOCK: tl.constexpr):
    """(a sequence ends at this position within the block, the position is the block's last in range)."""
    last = (offs + 1 >= N) | (tl.arange(0, BLOCK) == BLOCK - 1)
    end = (offs < N) & (last | (seq != seq_next))
    return end, last


@triton.jit
def _same_sequence_sum(a, a_seq, b, b_seq):
    """Combine of the segmented scan: (Σ of the right range's last sequence, that sequence). Associative because
    the sequence of the positions never decreases along a block (padded rows, packed segments, then S)."""
    return tl.where(a_seq == b_seq, a + b, b), b_seq


@triton.jit
def segment_add(buf_ptr, x, seq, end, S, NUM_COLS: tl.constexpr, COL: tl.constexpr):
    """``buf[s, COL] += Σ x`` over this block's positions of every sequence s (float64 ``x``, 0 off-sequence).

    A segmented inclusive scan: at position e the sum of the positions ≤ e of e's own sequence; a sequence
    ending at e within the block (or running past the block's last position) adds it. Each sum holds only its
    sequence's terms — never the difference of two cumulative sums over the whole block, whose rounding is that
    of the block's running total: a sequence of terms ~1e30 before it left a neighbour's sum 0, and a one-token
    sequence's sum was its value ± an ulp of the block's total. Positions of no sequence (s = S) add nothing.
    """
    own, _ = tl.associative_scan((x, seq), 0, _same_sequence_sum)
    tl.atomic_add(buf_ptr + seq * NUM_COLS + COL, own, mask=end & (seq < S), sem="relaxed")


@triton.jit
def masked_sum(x, valid):
    """Σ x where valid, in float64 (a 0-dim value)."""
    return tl.sum(tl.where(valid, x.to(tl.float64), 0.0), axis=0)


@triton.jit
def masked_min(x, valid):
    """min x where valid, float64; +inf when nothing is valid."""
    return tl.min(tl.where(valid, x.to(tl.float64), float("inf")), axis=0)


@triton.jit
def masked_max(x, valid):
    """max x where valid, float64; −inf when nothing is valid."""
    return tl.max(tl.where(valid, x.to(tl.float64), float("-inf")), axis=0)
