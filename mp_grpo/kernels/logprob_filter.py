"""Top-p search step: per-row probability mass in equal sub-ranges of a key interval (Triton).

The top-p threshold of a row is the smallest logit whose "mass strictly above" is < p * S
(``mp_grpo/ops/sampling_filter.py``). It is found by a radix search over an order-preserving integer
key of the fp32 logit: each round splits the current key interval ``[lo, lo + BINS << shift)`` into
BINS equal sub-ranges, this kernel sums exp(z - M) of this shard's kept columns falling in each, the
host all-reduces the ``[N, BINS]`` masses over the TP group and keeps the sub-range where the
cumulative mass from the top crosses p * S. Each round reads the shard once.

    key(x) = bits(x + 0)            if bits(x + 0) >= 0 (as int32)
             bits(x + 0) ^ 0x7FFFFFFF  otherwise        (monotone in x; x + 0 turns -0 into +0)
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
# Flips the magnitude bits of a negative float's int32 pattern so that the integer order is the float order.
NEG_KEY_FLIP = tl.constexpr(0x7FFFFFFF)


@triton.jit
def logprob_filter_bins_kernel(
    # pointers
    x_ptr,  # [N, V_local] logits shard; fp32 / bf16 / fp16; last dim contiguous
    threshold_ptr,  # [N] fp32 raw-logit threshold of the set searched (min-p / top-k already applied)
    row_max_ptr,  # [N] fp32 raw-logit maximum over the whole vocabulary
    key_lo_ptr,  # [N] int64 lowest key of the current interval
    bins_ptr,  # [N, BINS] fp32 out: sum of exp(z - M) over this shard's kept columns per sub-range
    # shapes
    V_local,
    # strides
    stride_x_row,
    stride_bins_row,
    # scalars
    inv_temperature,  # fp32, 1 / temperature
    shift,  # log2 of the sub-range width in keys
    # meta-parameters
    BINS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row_ptr = x_ptr + row * stride_x_row
    offs = tl.arange(0, BLOCK_V)
    bin_ids = tl.arange(0, BINS)
    scale = inv_temperature * LOG2E

    # --- 1. per-row scalars ---
    threshold = tl.load(threshold_ptr + row)
    row_max = tl.load(row_max_ptr + row)
    key_lo = tl.load(key_lo_ptr + row)

    # --- 2. one pass: key, sub-range and weight of every column; one-hot sums into BINS accumulators ---
    acc = tl.zeros([BINS], dtype=tl.float32)
    for start in range(0, V_local, BLOCK_V):
        cols = start + offs
        x = tl.load(x_row_ptr + cols, mask=cols < V_local, other=float("-inf")).to(tl.float32)
        bits = (x + 0.0).to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ NEG_KEY_FLIP, bits).to(tl.int64)
        rel = key - key_lo
        bin_of = rel >> shift
        in_range = (x >= threshold) & (rel >= 0) & (bin_of < BINS)
        # A -inf logit weighs exp2(-inf) = 0.
        e = tl.where(in_range, tl.exp2((x - row_max) * scale), 0.0)
        one_hot = bin_of[:, None] == bin_ids[None, :]
        acc += tl.sum(tl.where(one_hot, e[:, None], 0.0), axis=0)

    # --- 3. store ---
    tl.store(bins_ptr + row * stride_bins_row + bin_ids, acc)
