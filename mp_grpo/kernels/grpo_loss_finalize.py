"""Fused GRPO loss: the loss and the metric entries from the combine pass's per-program partials (Triton).

Program 0 (the others, with FOLD_SEQ_GRAD only, see step 4). Schedule:
    1. Sum (float64) and take the extremes of the ``[programs, PARTIAL_COLS]`` partials, BLOCK_P rows at a time.
    2. The loss share (in the loss's dtype) = Σ of the share column.
    3. The metric pairs ``[NUM_PAIRS, 2]`` = (value, count): count 1 / M for the loss, the valid-token
       total and the non-finite total (M = the step's (rank, micro-batch) pairs), the sequence count for the per-sequence χ², (skip, 1)
       for the skip flag, the valid-token count for every other mean; and the extremes ``[NUM_EXTREMES]``
       (even slots minima, odd slots maxima; ±inf where nothing is valid). The per-input non-finite counts
       added into the deferred error ledger's int64 counters ``nonfinite_errors`` — none when the step is skipped
       (nothing of it is trained on: nothing wrong to raise).
    4. FOLD_SEQ_GRAD (gspo / gmpo without context parallelism): programs 1, 2, … each take BLOCK positions
       and add the path through the sequence mean into the per-token gradient the combine kernel wrote,
       ``grad_lp[t] += seq_grad[s(t)] · seq_factor[t]`` — the per-sequence sums ``seq_grad`` are complete only
       after every combine program ran, hence here. The gradient of the share w.r.t. each log-prob is then
       one per-token coefficient, and backward only multiplies it by the upstream gradient (inside the
       log-prob backward kernel for ``GRPOLoss.on_logits``). Under context parallelism the sums are
       all-reduced, scaled by each rank's upstream gradient, in backward instead.
Every slot is written; the host names only those the config and the inputs report.
"""

import triton
import triton.language as tl

from mp_grpo.kernels import grpo_loss_constants as K
from mp_grpo.kernels.grpo_loss_common import sequence_index


@triton.jit
def _pick(values, cols, col):
    """``values[col]`` of a 1-D block (a 0-dim value)."""
    return tl.sum(tl.where(cols == col, values, 0.0), axis=0)


@triton.jit
def grpo_loss_finalize_kernel(
    partial_ptr,  # [P, PARTIAL_COLS] float64
    micro_batches_ptr,  # 0-dim float64: M
    skip_ptr,  # 0-dim bool (only with HAS_SKIP)
    loss_ptr,  # 0-dim out, the loss's dtype
    pairs_ptr,  # [NUM_PAIRS, 2] float64 out
    extremes_ptr,  # [NUM_EXTREMES] float64 out
    nonfinite_errors_ptr,  # [NUM_NONFINITE_INPUTS] int64, added into: the ledger's counters (or fresh zeros)
    grad_lp_ptr,  # [N] compute dtype, in/out (FOLD_SEQ_GRAD only)
    seq_grad_ptr,  # [S] float64 (FOLD_SEQ_GRAD only)
    seq_factor_ptr,  # [N] compute dtype (FOLD_SEQ_GRAD only)
    cu_ptr,  # [S + 1] cu_seqlens (packed, FOLD_SEQ_GRAD only)
    P,
    N, T, S, search_steps,
    HAS_SKIP: tl.constexpr,
    FOLD_SEQ_GRAD: tl.constexpr,
    PACKED: tl.constexpr,
    COLS: tl.constexpr,  # power of two ≥ PARTIAL_COLS
    BLOCK_P: tl.constexpr,
    BLOCK: tl.constexpr,  # positions per folding program
    CONSTANTS_KEY: tl.constexpr,  # grpo_loss_constants.CONSTANTS_KEY: its constants' values in Triton's cache key
):
    pid = tl.program_id(0)
    if FOLD_SEQ_GRAD:
        if pid > 0:
            _fold_seq_grad(grad_lp_ptr, seq_grad_ptr, seq_factor_ptr, cu_ptr, pid - 1, N, T, S, search_steps,
                           PACKED, BLOCK)
    if pid == 0:
        _finalize(partial_ptr, micro_batches_ptr, skip_ptr, loss_ptr, pairs_ptr, extremes_ptr, nonfinite_errors_ptr,
                  P, HAS_SKIP, COLS, BLOCK_P)


@triton.jit
def _fold_seq_grad(grad_lp_ptr, seq_grad_ptr, seq_factor_ptr, cu_ptr, block, N, T, S, search_steps,
                   PACKED: tl.constexpr, BLOCK: tl.constexpr):
    # --- 4. the path through the sequence mean, into the per-token gradient ---
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < N
    seq = sequence_index(offs, cu_ptr, T, S, search_steps, PACKED)
    factor = tl.load(seq_factor_ptr + offs, mask=in_range, other=0.0)
    seq_grad = tl.load(seq_grad_ptr + seq, mask=in_range & (seq < S), other=0.0)
    grad = tl.load(grad_lp_ptr + offs, mask=in_range, other=0.0)
    grad += seq_grad.to(factor.dtype) * factor
    tl.store(grad_lp_ptr + offs, grad, mask=in_range)


@triton.jit
def _finalize(partial_ptr, micro_batches_ptr, skip_ptr, loss_ptr, pairs_ptr, extremes_ptr, nonfinite_errors_ptr, P,
              HAS_SKIP: tl.constexpr, COLS: tl.constexpr, BLOCK_P: tl.constexpr):
    cols = tl.arange(0, COLS)
    is_sum = cols < K.NUM_SUMS
    is_extreme = (cols >= K.NUM_SUMS) & (cols < K.PARTIAL_COLS)
    is_min = is_extreme & ((cols - K.NUM_SUMS) % 2 == 0)
    # --- 1. reduce the partials ---
    sums = tl.zeros([COLS], dtype=tl.float64)
    lows = tl.full([COLS], float("inf"), dtype=tl.float64)
    highs = tl.full([COLS], float("-inf"), dtype=tl.float64)
    for start in range(0, P, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        inside = (rows[:, None] < P) & (cols[None, :] < K.PARTIAL_COLS)
        block = tl.load(partial_ptr + rows[:, None] * K.PARTIAL_COLS + cols[None, :], mask=inside, other=0.0)
        sums += tl.sum(tl.where(inside & is_sum[None, :], block, 0.0), axis=0)
        lows = tl.minimum(lows, tl.min(tl.where(inside & is_extreme[None, :], block, float("inf")), axis=0))
        highs = tl.maximum(highs, tl.max(tl.where(inside & is_extreme[None, :], block, float("-inf")), axis=0))
    # --- 2. the loss ---
    tl.store(loss_ptr, _pick(sums, cols, K.SUM_SHARE).to(loss_ptr.dtype.element_ty))
    # --- 3. metric pairs and extremes ---
    inv_micro_batches = 1.0 / tl.load(micro_batches_ptr).to(tl.float64)
    counts = tl.zeros([COLS], dtype=tl.float64) + _pick(sums, cols, K.SUM_VALID)
    counts = tl.where((cols == K.PAIR_LOSS) | (cols == K.PAIR_VALID_TOKENS) | (cols == K.PAIR_NONFINITE),
                      inv_micro_batches, counts)
    counts = tl.where(cols == K.PAIR_CHI2_SEQ, _pick(sums, cols, K.SUM_CHI2_SEQ_COUNT), counts)
    values = sums
    trained = 1.0  # the step is not skipped
    if HAS_SKIP:
        skip = tl.load(skip_ptr).to(tl.float64)
        values = tl.where(cols == K.PAIR_SKIPPED, skip, values)
        trained = 1.0 - skip
    counts = tl.where(cols == K.PAIR_SKIPPED, 1.0, counts)
    is_pair = cols < K.NUM_PAIRS
    tl.store(pairs_ptr + 2 * cols, values, mask=is_pair)
    tl.store(pairs_ptr + 2 * cols + 1, counts, mask=is_pair)
    is_nonfinite = (cols >= K.SUM_NONFINITE_LOGPROBS) & (cols < K.SUM_NONFINITE_LOGPROBS + K.NUM_NONFINITE_INPUTS)
    tl.atomic_add(nonfinite_errors_ptr + (cols - K.SUM_NONFINITE_LOGPROBS), (sums * trained).to(tl.int64),
                  mask=is_nonfinite)
    extremes = tl.where(is_min, lows, highs)
    tl.store(extremes_ptr + (cols - K.NUM_SUMS), extremes, mask=is_extreme & (cols - K.NUM_SUMS < K.NUM_EXTREMES))
