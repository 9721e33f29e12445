"""The log-prob kernels over a captured support: each token's distribution renormalized over the ids the rollout
engine sampled it from (``mp_grpo/ops/captured_support.py``), read as a gather of those ids, never the whole row.

The support is CSR over the token rows (vLLM's layout): row r's ids are ``ids[indptr[r] : indptr[r + 1]]`` (global
vocabulary ids, each row's strictly increasing — checked on the host side of the op). A row with no ids has no
support: the unrestricted kernels handle it (``HAS_SKIP`` in ``logprob_stats.py``, the flag written here).

``logprob_support_stats_kernel`` (forward, one program per row) writes the statistics of ``logprob_stats.py`` in its
exact form — (m, s, u, x_t): m and x_t in raw logit units, s and u summed over the support's columns of this shard
other than the target's — so that the all-gather, ``logprob_merge.py`` and the loss kernels that merge statistics
(``FROM_STATS``) run unchanged and keep the confident token's exact 1 - p_t and log p_t + H. A shard that holds none
of a row's ids writes m = the sentinel and s = u = 0 (no mass). A target outside its row's support: the shard that
owns it writes x_t = -inf (log-prob -inf, as a sampling filter's outside target).

Backward runs in three steps (``ops/captured_support.py``): ``logprob_support_grad_kernel`` computes the gradient
at each support id of this shard (``logprob_backward.gradient_values``, the unrestricted formula over the support's
statistics) into a ``[nnz]`` buffer, reading the logits before step 2 may overwrite them (in-place backward); the
unrestricted backward kernel writes every row (0 across a support row); ``logprob_support_scatter_kernel`` writes
the buffered values at the support's columns.

Reads: a support row costs a gather of its ids (8 bytes each) and of the logits at those in this shard (one 32-byte
sector each, for 2–4 bytes used), against a read of the whole shard for an unrestricted row.
"""

import triton
import triton.language as tl

from mp_grpo.kernels.logprob_backward import gradient_values, row_scalars
from mp_grpo.kernels.logprob_stats import LN2, LOG2E, MAX_SENTINEL, online_sums


@triton.jit
def support_range(indptr_ptr, row, nnz):
    """Row ``row``'s entries ``[start, end)`` of a CSR, clamped to ``[0, nnz]`` (a malformed ``indptr`` — counted on
    the host side — reads nothing out of bounds: a row whose end is not past its start has no entries)."""
    start = tl.load(indptr_ptr + row)
    end = tl.load(indptr_ptr + row + 1)
    start = tl.minimum(tl.maximum(start, 0), nnz)
    end = tl.minimum(tl.maximum(end, start), nnz)
    return start, end


@triton.jit
def shard_ids(ids_ptr, pos, end, V_local, vocab_start):
    """The CSR entries ``pos`` of a row ending at ``end``: (in the row, their ids — 0 past the end —, the ids'
    columns in this shard, whether this shard owns them)."""
    in_row = pos < end
    ids = tl.load(ids_ptr + pos, mask=in_row, other=0)
    local = ids - vocab_start
    return in_row, ids, local, in_row & (local >= 0) & (local < V_local)


@triton.jit
def logprob_support_stats_kernel(
    # pointers
    x_ptr,  # [n, V_local] logits shard; fp32 / bf16 / fp16; last dim contiguous
    target_ptr,  # [n] int64 global token ids
    indptr_ptr,  # [N_csr + 1] int64 the support's row pointer (row r of x is CSR row csr_row_start + r)
    ids_ptr,  # [nnz] int64 global vocabulary ids, strictly increasing within a row
    stats_ptr,  # [N_total + 1, 4] fp32 out: rows row_start .. row_start + n (rows with a support only)
    has_support_ptr,  # [n] int8 out: 1 where the row's support is not empty (its statistics written here)
    # shapes
    csr_row_start,  # CSR row of x's first row (chunked callers)
    row_start,  # first stats row written by this launch (chunked callers)
    nnz,
    V_local,
    vocab_start,  # first global id of this shard
    # strides
    stride_x_row,
    stride_stats_row,
    # scalars
    inv_temperature,  # fp32, 1 / temperature
    # meta-parameters
    HAS_ENTROPY: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    scale = inv_temperature * LOG2E  # raw logit units -> log2 units of z

    # --- 1. the row's support, its target ---
    start, end = support_range(indptr_ptr, csr_row_start + row, nnz)
    has_support = end > start
    tl.store(has_support_ptr + row, has_support.to(tl.int8))
    target = tl.load(target_ptr + row)
    local_target = target - vocab_start
    owns_target = has_support & (local_target >= 0) & (local_target < V_local)
    x_row_ptr = x_ptr + row * stride_x_row

    # --- 2. one pass over the support's ids: this shard's logits gathered, the online sums (target's column apart) ---
    m = tl.full([], MAX_SENTINEL, dtype=tl.float32)
    s = tl.zeros([], dtype=tl.float32)
    u = tl.zeros([], dtype=tl.float32)
    found = tl.zeros([], dtype=tl.int32)  # the target among the row's ids (every shard sees every id)
    for k0 in range(start, end, BLOCK_K):
        in_row, ids, local, mine = shard_ids(ids_ptr, k0 + offs, end, V_local, vocab_start)
        found += tl.sum((in_row & (ids == target)).to(tl.int32), axis=0)
        x = tl.load(x_row_ptr + local, mask=mine, other=float("-inf")).to(tl.float32)
        m, s, u = online_sums(m, s, u, x, mine & (local == local_target), scale, HAS_ENTROPY)

    # --- 3. the target's logit (-inf outside the support: log-prob -inf), stored as logprob_stats_kernel stores ---
    x_target = tl.load(x_row_ptr + local_target, mask=owns_target, other=0.0).to(tl.float32)
    x_target = tl.where(owns_target & (found == 0), float("-inf"), x_target)
    stats_row_ptr = stats_ptr + (row_start + row) * stride_stats_row
    tl.store(stats_row_ptr + 0, m, mask=has_support)
    tl.store(stats_row_ptr + 1, s, mask=has_support)
    tl.store(stats_row_ptr + 2, u * LN2, mask=has_support)
    tl.store(stats_row_ptr + 3, x_target, mask=has_support)


@triton.jit
def logprob_support_grad_kernel(
    # pointers
    x_ptr,  # [n, V_local] logits shard (read before the unrestricted backward may overwrite it)
    values_ptr,  # [nnz] out, the gradient's dtype: the gradient at each support id of this shard
    target_ptr,  # [n] int64
    indptr_ptr,  # [N_csr + 1] int64
    ids_ptr,  # [nnz] int64
    row_max_ptr,  # [n] fp32 M of the support's distribution
    log_sum_ptr,  # [n] fp32 log S
    complement_ptr,  # [n] fp32 q_t = 1 - p_t
    centered_ptr,  # [n] fp32 c_t = log p_t + H (only with HAS_ENTROPY_GRAD)
    entropy_ptr,  # [n] fp32 H (only with HAS_ENTROPY_GRAD)
    grad_logprob_ptr,  # [n] fp32 upstream gradient of the log-probs
    grad_entropy_ptr,  # [n] fp32 upstream gradient of the entropy (only with HAS_ENTROPY_GRAD)
    grad_scale_ptr,  # 0-dim fp32 factor of both upstream gradients (only with HAS_GRAD_SCALE)
    # shapes
    csr_row_start,
    nnz,
    V_local,
    vocab_start,
    ignore_index,
    # strides
    stride_x_row,
    # scalars
    inv_temperature,
    # meta-parameters
    HAS_ENTROPY_GRAD: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)

    # --- 1. the row's support and its scalars (those of logprob_backward_kernel) ---
    start, end = support_range(indptr_ptr, csr_row_start + row, nnz)
    row_max, log_sum, complement, target, g_logprob, g_entropy, entropy, centered, row_ok = row_scalars(
        row, target_ptr, row_max_ptr, log_sum_ptr, complement_ptr, centered_ptr, entropy_ptr, grad_logprob_ptr,
        grad_entropy_ptr, grad_scale_ptr, ignore_index, HAS_ENTROPY_GRAD, HAS_GRAD_SCALE,
    )
    x_row_ptr = x_ptr + row * stride_x_row
    target_col = target - vocab_start

    # --- 2. the gradient at each of this shard's support ids, into the row's entries of the buffer ---
    for k0 in range(start, end, BLOCK_K):
        pos = k0 + offs
        _, _, local, mine = shard_ids(ids_ptr, pos, end, V_local, vocab_start)
        z = tl.load(x_row_ptr + local, mask=mine, other=float("-inf")).to(tl.float32)
        grad = gradient_values(z, local == target_col, row_max, log_sum, complement, centered, entropy, g_logprob,
                               g_entropy, row_ok, inv_temperature, HAS_ENTROPY_GRAD)
        tl.store(values_ptr + pos, grad.to(values_ptr.dtype.element_ty), mask=mine)


@triton.jit
def logprob_support_scatter_kernel(
    # pointers
    values_ptr,  # [nnz] the gradient at each support id (logprob_support_grad_kernel)
    grad_x_ptr,  # [n, V_local] the gradient (written by the unrestricted backward: 0 across a support row)
    indptr_ptr,  # [N_csr + 1] int64
    ids_ptr,  # [nnz] int64
    # shapes
    csr_row_start,
    nnz,
    V_local,
    vocab_start,
    # strides
    stride_grad_x_row,
    # meta-parameters
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    # --- 1. the row's support ---
    start, end = support_range(indptr_ptr, csr_row_start + row, nnz)
    grad_row_ptr = grad_x_ptr + row * stride_grad_x_row
    # --- 2. this shard's support ids: their buffered gradient into the row ---
    for k0 in range(start, end, BLOCK_K):
        pos = k0 + offs
        _, _, local, mine = shard_ids(ids_ptr, pos, end, V_local, vocab_start)
        tl.store(grad_row_ptr + local, tl.load(values_ptr + pos, mask=mine), mask=mine)


@triton.jit
def in_support(ids, indptr_ptr, support_ptr, row, support_nnz, BLOCK_S: tl.constexpr):
    """``[BLOCK_K]`` bool: which of ``ids`` lie in CSR row ``row`` of the support — True throughout where the row has
    no support (the whole vocabulary). A compare of the ``[BLOCK_K]`` ids with ``BLOCK_S`` support ids at a time."""
    start, end = support_range(indptr_ptr, row, support_nnz)
    member = tl.zeros(ids.shape, dtype=tl.int32)
    for s0 in range(start, end, BLOCK_S):
        pos = s0 + tl.arange(0, BLOCK_S)
        support = tl.load(support_ptr + pos, mask=pos < end, other=-1)
        member += tl.sum((ids[:, None] == support[None, :]).to(tl.int32), axis=1)
    return (member > 0) | (end <= start)
