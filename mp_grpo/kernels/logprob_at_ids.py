"""The trainer's log-probs at given vocabulary ids of each token (the rollout engine's top-K ids), vocab-parallel.

The ids are CSR over the token rows (vLLM's layout): row r's ids are ``ids[indptr[r] : indptr[r + 1]]``, global
vocabulary ids in any order. The log-prob of id j in row r is ``(x_j - M) / T - log S`` with the row's merged
(M, log S) — of the whole vocabulary, of a sampling filter's kept set, or of a captured support, as the row's
statistics were taken — and -inf where j lies outside that kept set or support (probability 0).

Two kernels around the statistics' one all-gather (``mp_grpo/ops/top_k_logprobs.py``):

1. ``logprob_gather_ids_kernel``, one program per row, with the statistics' pass (the logits are at hand: a fused
   op's chunk, before it becomes its gradient): the raw logit of every id this shard owns into the row's entries of
   a ``[nnz]`` fp32 payload (-inf outside the kept set or the support, 0 at the ids of other shards). The payload
   travels in the statistics' all-gather, after their rows: no collective of its own.
2. ``logprob_at_ids_kernel``, one program per row, after the all-gather: each entry's logit from its owner's
   payload (owner = id // V_local) and the row's (M, log S) merged from the gathered statistics by
   ``logprob_merge.merge_rows`` (the merge's own arithmetic: NaN for every entry of a row when the TP ranks' shards
   differ in size, as for its log-prob).
"""

import triton
import triton.language as tl

from mp_grpo.kernels.logprob_merge import merge_rows
from mp_grpo.kernels.logprob_support import in_support, shard_ids, support_range


@triton.jit
def logprob_gather_ids_kernel(
    # pointers
    x_ptr,  # [n, V_local] logits shard; last dim contiguous
    indptr_ptr,  # [N_csr + 1] int64 the ids' row pointer (row r of x is CSR row csr_row_start + r)
    ids_ptr,  # [nnz] int64 global vocabulary ids
    payload_ptr,  # [nnz] fp32 out: this shard's raw logit at each id it owns (0 elsewhere)
    threshold_ptr,  # [n] fp32 raw-logit threshold of a sampling filter (only with HAS_THRESHOLD)
    support_indptr_ptr,  # [N_csr + 1] int64 a captured support's row pointer (only with HAS_SUPPORT)
    support_ids_ptr,  # [support_nnz] int64 (only with HAS_SUPPORT)
    # shapes
    csr_row_start,
    nnz,
    support_nnz,
    V_local,
    vocab_start,
    # strides
    stride_x_row,
    # meta-parameters
    HAS_THRESHOLD: tl.constexpr,
    HAS_SUPPORT: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    # --- 1. the row's ids (and the kept set's threshold) ---
    start, end = support_range(indptr_ptr, csr_row_start + row, nnz)
    x_row_ptr = x_ptr + row * stride_x_row
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + row)
    # --- 2. the logit of each id this shard owns; -inf outside the kept set or the support ---
    for k0 in range(start, end, BLOCK_K):
        pos = k0 + offs
        in_row, ids, local, mine = shard_ids(ids_ptr, pos, end, V_local, vocab_start)
        x = tl.load(x_row_ptr + local, mask=mine, other=0.0).to(tl.float32)
        if HAS_THRESHOLD:
            x = tl.where(x >= threshold, x, float("-inf"))
        if HAS_SUPPORT:
            x = tl.where(in_support(ids, support_indptr_ptr, support_ids_ptr, csr_row_start + row, support_nnz,
                                    BLOCK_S), x, float("-inf"))
        tl.store(payload_ptr + pos, tl.where(mine, x, 0.0), mask=in_row)


@triton.jit
def logprob_at_ids_kernel(
    # pointers
    stats_ptr,  # [TP, N + 1, 4] fp32 the all-gathered statistics (row N: each rank's V_local)
    target_ptr,  # [N] int64
    payload_ptr,  # [TP, nnz] fp32 the all-gathered payloads (rank-strided)
    indptr_ptr,  # [N_csr + 1] int64
    ids_ptr,  # [nnz] int64
    out_ptr,  # [nnz] fp32 out: the log-prob at each id (this launch's rows' entries)
    # shapes
    N,  # rows of the statistics
    TP,
    V_local,
    ignore_index,
    csr_row_start,  # CSR row of the statistics' first row
    nnz,
    # strides
    stride_stats_rank,
    stride_stats_row,
    stride_payload_rank,
    # scalars
    inv_temperature,
    # meta-parameters
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    # --- 1. the row's (M, log S) from every shard's statistics (the merge's arithmetic) ---
    rows = row + tl.zeros([1], dtype=tl.int64)
    _, _, m_max, log_s, _, _, shard_mismatches, _, _ = merge_rows(
        stats_ptr, target_ptr, rows, rows < N, N, TP, V_local * TP, ignore_index, stride_stats_rank, stride_stats_row,
        inv_temperature, False,
    )
    # --- 2. each id's logit from the shard that owns it; its log-prob ---
    start, end = support_range(indptr_ptr, csr_row_start + row, nnz)
    for k0 in range(start, end, BLOCK_K):
        pos = k0 + offs
        in_row = pos < end
        ids = tl.load(ids_ptr + pos, mask=in_row, other=0)
        owner = ids // V_local
        owned = in_row & (ids >= 0) & (owner < TP)
        x = tl.load(payload_ptr + owner * stride_payload_rank + pos, mask=owned, other=float("nan"))
        logprob = (x - m_max) * inv_temperature - log_s
        logprob = tl.where(shard_mismatches > 0, float("nan"), logprob)
        tl.store(out_ptr + pos, logprob, mask=in_row)
