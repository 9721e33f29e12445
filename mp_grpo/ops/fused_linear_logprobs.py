"""Output layer and log-probs fused: ``log softmax(hidden @ weightᵀ / T)[target]`` without the logits.

At N = 16384 tokens and a 151936-token vocabulary the logits are 4.6 GiB in bf16 per TP rank, and
their gradient as much again. This op computes them one bounded chunk at a time, reusing the
kernels of :mod:`mp_grpo.ops.vocab_parallel_logprobs`, and recomputes them in backward: four GEMMs
(one forward, three backward) instead of the three of a plain output layer — 4/3 is this design's
time floor — plus the memory-bound Triton passes (one read of each chunk forward, one read and one
write backward: a few % of the GEMM time at H = 4096). At most one logits chunk
(≤ ``LOGITS_CHUNK_BYTES``) and one fp32 ``[rows, H]`` accumulator (≤ ``GRAD_HIDDEN_BLOCK_BYTES``)
are alive at any moment (the budgets and the chunk planning: :mod:`mp_grpo.ops.output_chunks`).

Schedule of :class:`FusedLinearLogProbs` (``N`` rows, ``H`` hidden, ``V_local`` columns on each of ``TP`` ranks)

Forward — chunks of whole rows, ``[rows, V_local]``
    1. For each token chunk: ``logits = hidden[chunk] @ weightᵀ`` (cuBLAS, fp32 accumulation, output
       in hidden's dtype — or, with ``logit_dtype=FP32``, the fp32 accumulator itself — into one reused buffer), then ``logprob_stats_kernel`` writes the chunk's
       per-row statistics into its rows of ONE ``[N + 1, 4]`` stats buffer; the chunk is overwritten
       by the next. Whole rows, because the statistics kernel reduces a row in one pass — that is what
       keeps a single stats buffer, so that
    2. one collective: all-gather of the ``[N + 1, 4]`` fp32 statistics over ``tp_group`` (skipped for
       a group of size 1; row N carries ``V_local``, so unequal shards are reported, not hung on);
    3. ``logprob_merge_kernel``: log-prob, entropy, and logZ as (M, log S) per row; with
       ``check_inputs`` the error counters go to the deferred ledger (``mp_grpo.ops.checks``): no host read.
    Saved for backward: ``hidden`` and ``weight`` (not copies), targets, M, log S, 1 - p_t, H, log p_t + H — 28 bytes
    a row; no logits.
    With a ``sampling_filter``, step 1's statistics count only each chunk's kept columns and give its per-row
    thresholds (``ops/sampling_filter.py``, ``filtered_statistics``: its collectives once per chunk); the thresholds (4 bytes a row) are saved for backward, whose
    kernel gives the columns below them no gradient. Backward's blocks are then forward's chunks (whole
    rows), so that the recomputed logits are bitwise forward's (see ``sampling_filter`` below).
    With a ``captured_support``, step 1's statistics are each row's support's (``ops/captured_support.py``: a gather
    of the chunk's logits at the support's ids, no collective); backward's step 2 is ``support_backward`` (the
    support is a set of ids: any backward chunk shape is exact). With ``top_k_ids``
    (:func:`fused_linear_logprobs_with_top_k`), step 1 also gathers each chunk's logits at the engine's top-K ids
    into a payload that step 2's all-gather carries, and step 3 turns them into log-probs (``ops/top_k_logprobs.py``):
    during the forward, no second pass over the logits.

Backward — token blocks of ``backward_rows`` rows, each cut into ``[rows, cols]`` vocabulary chunks
    1. Recompute the chunk's logits ``hidden[block] @ weight[cols]ᵀ`` into one reused buffer, in forward's
       logits dtype.
    2. ``logprob_backward_kernel`` IN PLACE: the buffer now holds d(loss)/d(logits) of the chunk, in
       hidden's dtype (the logits path's gradient dtype; with fp32 logits narrowed in place, in the front half
       of each row's storage: ``logprob_launch.narrowed_in_place``). M, log S and the entropy describe the whole
       vocabulary, so any column range is exact and no collective is needed.
    3. ``grad_hidden[block] (+)= grad_logits @ weight[cols]`` into an fp32 ``[rows, H]`` accumulator
       (cuBLAS writes fp32 directly, no upcast copy), rounded once to hidden's dtype after the block's
       last chunk. Skipped when ``hidden`` needs no gradient.
    4. ``grad_weight[cols] (+)= grad_logitsᵀ @ hidden[block]``: with one token block (the default
       whenever the fp32 accumulator of all N rows fits ``GRAD_HIDDEN_BLOCK_BYTES``: N·H·4 ≤ 512 MiB) every
       element of ``grad_weight`` is written once by one GEMM that sums all N tokens in fp32 — the
       same rounding as the logits path; with several token blocks later blocks add into it
       (one rounding per block in bf16). With ``accumulate_into_main_grad`` it is added to Megatron's
       fp32 ``weight.main_grad`` instead (exact fp32 accumulation). Skipped when ``weight`` needs no
       gradient.
    Why blocks of tokens × chunks of vocabulary rather than token chunks only: accumulating the
    ``[V_local, H]`` weight gradient over token chunks needs an fp32 buffer of ``V_local·H·4`` bytes
    (2.3 GiB at V = 151936, H = 4096) or one bf16 rounding per chunk, and reads and writes it once per
    chunk; the hidden gradient's accumulator is ``N·H·4`` (256 MiB at N = 16384), the smaller one
    whenever N < V_local (at N = 16384: every TP degree up to 8 of a 151936 vocabulary).

Tensor parallelism (Megatron's ColumnParallelLinear contract)
    ``hidden`` is the FULL hidden states on every TP rank (after the sequence-parallel all-gather) and
    ``weight`` this rank's vocabulary shard ``[V_local, H]``. The gradient w.r.t. ``hidden`` returned
    here is this shard's PARTIAL contribution; the true gradient is its sum over the TP group. This
    op makes no collective in backward: the sum is left to Megatron's mapping, applied to the input
    exactly as ColumnParallelLinear does for its own input::

        # sequence parallelism off: identity forward, all-reduce of the gradient backward
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden, group=tp_group)
        # sequence parallelism on: all-gather [S/TP, B, H] -> [S, B, H] forward, reduce-scatter backward
        hidden = tensor_parallel.gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=True, group=tp_group)
        logprobs = fused_linear_logprobs(hidden, output_layer.weight, target_sb, tp_group=tp_group,
                                         accumulate_into_main_grad=output_layer.gradient_accumulation_fusion)

    (``target_sb`` in the hidden states' ``[S, B]`` layout.) With TP = 1 neither mapping does anything.
    Unlike ColumnParallelLinear under sequence parallelism, which saves its local input and gathers it
    again in backward, this op saves the gathered ``hidden`` (N·H·2 bytes, 128 MiB at N = 16384,
    H = 4096): small next to the logits it replaces.

Megatron gradient-accumulation fusion (``accumulate_into_main_grad=True``)
    The weight gradient is added into ``weight.main_grad`` (fp32, or weight's dtype; read when
    forward runs, as Megatron's linear layer does), and what is returned as the weight's gradient follows megatron-core's
    ``LinearWithGradAccumulationAndAsyncCommunication``: when ``weight`` has the attribute
    ``grad_added_to_main_grad`` (Megatron's DDP sets it), it is set to True and a placeholder gradient
    is returned so that DDP's backward hook runs on the main thread; otherwise None. The placeholder
    is zeros (Megatron leaves it uninitialized unless ``weight.zero_out_wgrad``), one zero element
    allocated once and expanded (autograd materializes it as ``weight.grad``): the hook ignores it — or, under ``zero_out_wgrad`` (tied embeddings),
    adds it plus the embedding lookup's gradient into ``main_grad`` — and anything else that reads
    ``weight.grad`` sees a correct "nothing beyond main_grad".

Precision (``logit_dtype``, :class:`~mp_grpo.config.precision.LogitDtype`): with ``BF16`` the logits are rounded to
hidden's dtype before the statistics, as in the logits path ``vocab_parallel_logprobs(hidden @ weightᵀ)``. With
``FP32`` each chunk is the GEMM's fp32 accumulator, never rounded (twice the bytes per chunk: the byte budgets
then hold half the rows / columns); the log-probs and entropy carry the error of the fp32 accumulation only, and
backward recomputes the logits in fp32 too, so that its softmax is forward's. Backward's GEMMs of another shape
may tile differently: a recomputed logit can differ from forward's by one rounding step of the logits' dtype.
The logits' gradient enters the backward GEMMs in hidden's dtype with either setting.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal, overload

import torch

from mp_grpo.collectives import ProcessGroup, group_rank, group_size
from mp_grpo.config.precision import LogitDtype
from mp_grpo.ops.checks import (
    CheckInputs,
    check_chunk_size,
    check_hidden_weight_and_target,
    check_inputs_mode,
    check_main_grad,
    check_runs_here,
    check_temperature,
)
from mp_grpo.ops.captured_support import (
    check_replay,
    support_backward,
    support_statistics,
    targets_outside_support,
)
from mp_grpo.ops.logprob_launch import (
    flat_upstream_grads,
    gather_and_merge,
    logprob_backward,
    narrowed_in_place,
    new_stats_buffer_with,
    shard_statistics,
)
from mp_grpo.ops.output_chunks import (
    ChunkPlan,
    chunk_view,
    logits_dtype,
    main_grad_placeholder,
    matmul_into,
    plan_chunks,
)
from mp_grpo.ops.sampling_filter import SamplingFilter, filtered_statistics, targets_outside_filter
from mp_grpo.ops.token_ids import CapturedSupport, TokenIds, check_token_ids, record_token_ids_errors
from mp_grpo.ops.top_k_logprobs import TokenLogprobs, gather_logits_at_ids, top_k_outputs


def _forward_statistics(
    h: torch.Tensor,  # [N, H]
    w: torch.Tensor,  # [V_local, H]
    t: torch.Tensor,  # [N] int64
    stats: torch.Tensor,  # [N + 1, 4] fp32 out, from new_stats_buffer(N)
    plan: ChunkPlan,
    *,
    vocab_start: int,
    inv_temperature: float,
    with_entropy: bool,
    sampling_filter: SamplingFilter | None = None,
    captured_support: CapturedSupport | None = None,
    top_k_ids: TokenIds | None = None,
    payload: torch.Tensor | None = None,  # [nnz] fp32 out (with top_k_ids)
    tp_group: ProcessGroup | None = None,
    chunk_dtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Forward step 1: logits of ``plan.forward_rows`` rows at a time, into one reused buffer.

    With no rows there is still one (empty) launch: the statistics kernel writes the shard-size row.
    With a ``sampling_filter``, each chunk's statistics are those of its kept set (``filtered_statistics`` on
    the chunk: the threshold search's collectives once per chunk); with a ``captured_support``, of each row's
    support (``support_statistics``). With ``top_k_ids``, each chunk's logits at the ids its rows list (this
    shard's) into ``payload``. Returns ``(the [N] fp32 thresholds or None, the [N] int8 support flags or None)``."""
    n, v_local = h.shape[0], w.shape[0]
    chunk = torch.empty(plan.forward_rows * v_local, dtype=chunk_dtype, device=h.device)
    threshold = has_support = None
    if sampling_filter is not None:
        threshold = torch.empty(n, dtype=torch.float32, device=h.device)
        per_row = sampling_filter.flattened()
    if captured_support is not None:
        has_support = torch.empty(n, dtype=torch.int8, device=h.device)
    for r0 in range(0, max(n, 1), plan.forward_rows):
        r1 = min(r0 + plan.forward_rows, n)
        logits = chunk_view(chunk, r1 - r0, v_local)
        matmul_into(logits, h[r0:r1], w.t(), accumulate=False)
        if threshold is not None:
            threshold[r0:r1] = filtered_statistics(
                logits, t[r0:r1], stats, per_row.rows(r0, r1), torch.Size([r1 - r0]), row_start=r0, tp_group=tp_group,
                inv_temperature=inv_temperature, with_entropy=with_entropy,
            )
        elif has_support is not None:
            has_support[r0:r1] = support_statistics(
                logits, t[r0:r1], stats, captured_support, row_start=r0, csr_row_start=r0, vocab_start=vocab_start,
                inv_temperature=inv_temperature, with_entropy=with_entropy,
            )
        else:
            shard_statistics(
                logits, t[r0:r1], stats, row_start=r0,
                vocab_start=vocab_start, inv_temperature=inv_temperature, with_entropy=with_entropy,
            )
        if top_k_ids is not None:
            gather_logits_at_ids(logits, payload, top_k_ids, csr_row_start=r0, vocab_start=vocab_start,
                                 threshold=threshold[r0:r1] if threshold is not None else None,
                                 support=captured_support)
    return threshold, has_support


def _backward_chunks(
    h: torch.Tensor,  # [N, H]
    w: torch.Tensor,  # [V_local, H]
    t: torch.Tensor,  # [N] int64
    row_max: torch.Tensor,  # [N] fp32
    log_sum: torch.Tensor,  # [N] fp32
    complement: torch.Tensor,  # [N] fp32 1 - p_t
    entropy: torch.Tensor,  # [N] fp32 (read only with grad_entropy)
    centered: torch.Tensor,  # [N] fp32 log p_t + H (read only with grad_entropy)
    grad_logprobs: torch.Tensor,  # [N] fp32
    grad_entropy: torch.Tensor | None,  # [N] fp32, or None
    grad_h: torch.Tensor | None,  # [N, H] out, or None when hidden needs no gradient
    grad_w: torch.Tensor | None,  # [V_local, H] out (or main_grad), or None
    plan: ChunkPlan,
    *,
    weight_grad_accumulates: bool,
    vocab_start: int,
    ignore_index: int,
    inv_temperature: float,
    threshold: torch.Tensor | None = None,  # [N] fp32 sampling-filter thresholds
    support: CapturedSupport | None = None,
    has_support: torch.Tensor | None = None,  # [N] int8 (with support)
    chunk_dtype: torch.dtype,
) -> None:
    """Backward steps 1-4 over token blocks x vocabulary chunks (see the module docstring)."""
    n, hidden_size = h.shape
    v_local = w.shape[0]
    # fp32 accumulator of one block's hidden gradient; fp32 inputs accumulate in grad_h directly.
    acc = None
    if grad_h is not None and h.dtype != torch.float32:
        acc = torch.empty(plan.backward_rows, hidden_size, dtype=torch.float32, device=h.device)
    chunk = torch.empty(plan.backward_rows * plan.backward_cols, dtype=chunk_dtype, device=h.device)

    for b0 in range(0, n, plan.backward_rows):
        b1 = min(b0 + plan.backward_rows, n)
        h_block = h[b0:b1]
        acc_block = None
        if grad_h is not None:
            acc_block = acc[: b1 - b0] if acc is not None else grad_h[b0:b1]
        for c0 in range(0, v_local, plan.backward_cols):
            c1 = min(c0 + plan.backward_cols, v_local)
            w_cols = w[c0:c1]
            x = chunk_view(chunk, b1 - b0, c1 - c0)

            # --- 1. recompute the chunk's logits ---
            matmul_into(x, h_block, w_cols.t(), accumulate=False)

            # --- 2. their gradient, in place (narrowed to hidden's dtype for fp32 logits) ---
            g = x if x.dtype == h.dtype else narrowed_in_place(x, h.dtype)
            block = (x, g, t[b0:b1], row_max[b0:b1], log_sum[b0:b1], complement[b0:b1], entropy[b0:b1],
                     centered[b0:b1], grad_logprobs[b0:b1], grad_entropy[b0:b1] if grad_entropy is not None else None)
            if support is not None:  # the support's columns of this chunk (ids c0 .. c1 of the shard)
                support_backward(*block, support, has_support[b0:b1], csr_row_start=b0, vocab_start=vocab_start + c0,
                                 ignore_index=ignore_index, inv_temperature=inv_temperature)
            else:
                logprob_backward(*block, vocab_start=vocab_start + c0, ignore_index=ignore_index,
                                 inv_temperature=inv_temperature,
                                 threshold=threshold[b0:b1] if threshold is not None else None)

            # --- 3. hidden gradient of the block, summed over vocabulary chunks in fp32 ---
            if acc_block is not None:
                matmul_into(acc_block, g, w_cols, accumulate=c0 > 0)

            # --- 4. weight gradient of the columns: written by the first block, then added ---
            if grad_w is not None:
                matmul_into(grad_w[c0:c1], g.t(), h_block, accumulate=b0 > 0 or weight_grad_accumulates)
        if acc is not None:
            grad_h[b0:b1].copy_(acc_block)


class FusedLinearLogProbs(torch.autograd.Function):
    """Differentiable w.r.t. ``hidden`` and ``weight``; see the module docstring for the schedule."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,  # [..., H]
        weight: torch.Tensor,  # [V_local, H]
        target: torch.Tensor,  # [...]
        tp_group: ProcessGroup | None,
        inv_temperature: float,
        with_entropy: bool,
        ignore_index: int,
        plan: ChunkPlan,
        accumulate_into_main_grad: bool,
        check_inputs: CheckInputs,
        sampling_filter: SamplingFilter | None,
        chunk_dtype: torch.dtype,
        captured_support: CapturedSupport | None = None,
        top_k_ids: TokenIds | None = None,
    ):
        ctx.set_materialize_grads(False)
        v_local, hidden_size = weight.shape
        h = hidden.reshape(-1, hidden_size).contiguous()  # a view for Megatron's contiguous [S, B, H]
        w = weight.contiguous()
        t = target.reshape(-1).to(torch.int64).contiguous()
        n = h.shape[0]
        vocab_start = group_rank(tp_group) * v_local
        v_global = v_local * group_size(tp_group)
        if captured_support is not None:
            record_token_ids_errors(captured_support, "captured_support", v_global, check_inputs,
                                    strictly_increasing=True)
        if top_k_ids is not None:
            record_token_ids_errors(top_k_ids, "top_k_ids", v_global, check_inputs, strictly_increasing=False)

        # --- 1. per token chunk: logits (one GEMM) -> this chunk's rows of ONE stats buffer (and payload) ---
        buffer = new_stats_buffer_with(n, top_k_ids.nnz if top_k_ids is not None else 0, h.device)
        threshold, has_support = _forward_statistics(
            h, w, t, buffer.stats, plan, vocab_start=vocab_start, inv_temperature=inv_temperature,
            with_entropy=with_entropy, sampling_filter=sampling_filter, captured_support=captured_support,
            top_k_ids=top_k_ids, payload=buffer.payload, tp_group=tp_group, chunk_dtype=chunk_dtype,
        )

        # --- 2.–3. the one collective (all-gather of the [N + 1, 4] statistics, the payload with them) and the
        #          merge into log-prob, entropy, logZ = M + log S; raise on bad input ---
        merged, gathered = gather_and_merge(
            buffer.buffer, t, tp_group=tp_group, v_local=v_local, ignore_index=ignore_index,
            inv_temperature=inv_temperature, with_entropy=with_entropy, check_inputs=check_inputs,
            payload_rows=buffer.payload_rows,
        )

        outside = None
        if threshold is not None:
            # As vocab_parallel_logprobs: a target outside the kept set has log-prob -inf, no gradient.
            outside = targets_outside_filter(merged.logprobs, t, ignore_index, check_inputs)
        elif has_support is not None:
            outside = targets_outside_support(merged.logprobs, t, ignore_index, check_inputs)
        ctx.save_for_backward(h, w, t, merged.row_max, merged.log_sum, merged.complement, merged.entropy,
                              merged.centered, threshold, outside)
        ctx.support, ctx.has_support = captured_support, has_support
        # Like Megatron's linear layer: main_grad is kept on ctx, not saved (no version-counter checks,
        # since DDP writes into it between forward and backward).
        ctx.main_grad = weight.main_grad if accumulate_into_main_grad else None
        ctx.weight = weight if accumulate_into_main_grad else None
        ctx.hidden_shape = hidden.shape
        ctx.vocab_start = vocab_start
        ctx.inv_temperature = inv_temperature
        ctx.ignore_index = ignore_index
        ctx.plan = plan
        ctx.chunk_dtype = chunk_dtype
        logprobs = merged.logprobs.view(target.shape)
        if top_k_ids is not None:
            # --- 4. the log-probs at the engine's top-K ids (not differentiable) ---
            return top_k_outputs(ctx, merged, gathered, t, top_k_ids, target.shape, v_local=v_local,
                                 ignore_index=ignore_index, inv_temperature=inv_temperature, with_entropy=with_entropy)
        if with_entropy:
            return logprobs, merged.entropy.view(target.shape)
        return logprobs

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None = None, _grad_top_k=None):
        h, w, t, row_max, log_sum, complement, entropy, centered, threshold, outside = ctx.saved_tensors
        not_differentiable = (None,) * 12
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logprobs is None and grad_entropy is None) or not (need_hidden or need_weight):
            return (None, None, *not_differentiable)
        if entropy.numel() == 0:  # the entropy was not asked for (with top-K its output is an empty placeholder)
            grad_entropy = None
        grad_logprobs, grad_entropy = flat_upstream_grads(grad_logprobs, grad_entropy, row_max.shape[0], row_max.device)
        if outside is not None:
            grad_logprobs = torch.where(outside, 0.0, grad_logprobs)
        n = h.shape[0]
        main_grad = ctx.main_grad

        grad_h = torch.empty_like(h) if need_hidden else None
        grad_w = None
        if need_weight:
            # Every element is written by the first token block; with no rows there is none.
            grad_w = main_grad if main_grad is not None else (torch.empty_like(w) if n else torch.zeros_like(w))
        _backward_chunks(
            h, w, t, row_max, log_sum, complement, entropy, centered, grad_logprobs,
            grad_entropy,
            grad_h, grad_w, ctx.plan,
            weight_grad_accumulates=main_grad is not None, vocab_start=ctx.vocab_start,
            ignore_index=ctx.ignore_index, inv_temperature=ctx.inv_temperature, threshold=threshold,
            support=ctx.support, has_support=ctx.has_support, chunk_dtype=ctx.chunk_dtype,
        )

        grad_hidden = grad_h.view(ctx.hidden_shape) if need_hidden else None
        grad_weight = grad_w
        if need_weight and main_grad is not None:
            grad_weight = main_grad_placeholder(ctx.weight, h.dtype)
        return (grad_hidden, grad_weight, *not_differentiable)


@overload
def fused_linear_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, tp_group: ProcessGroup | None = ...,
    temperature: float = ..., with_entropy: Literal[False] = ..., ignore_index: int = ...,
    chunk_tokens: int | None = ..., chunk_vocab: int | None = ..., accumulate_into_main_grad: bool = ...,
    check_inputs: CheckInputs | bool = ..., sampling_filter: SamplingFilter | None = ...,
    logit_dtype: LogitDtype = ..., captured_support: CapturedSupport | None = ...,
) -> torch.Tensor: ...
@overload
def fused_linear_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, tp_group: ProcessGroup | None = ...,
    temperature: float = ..., with_entropy: Literal[True], ignore_index: int = ...,
    chunk_tokens: int | None = ..., chunk_vocab: int | None = ..., accumulate_into_main_grad: bool = ...,
    check_inputs: CheckInputs | bool = ..., sampling_filter: SamplingFilter | None = ...,
    logit_dtype: LogitDtype = ..., captured_support: CapturedSupport | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: ProcessGroup | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
    accumulate_into_main_grad: bool = False,
    check_inputs: CheckInputs | bool = CheckInputs.DEFERRED,
    sampling_filter: SamplingFilter | None = None,
    logit_dtype: LogitDtype = LogitDtype.BF16,
    captured_support: CapturedSupport | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What ``vocab_parallel_logprobs(hidden @ weight.T, target, ...)`` returns, without the logits.

    Args:
        hidden: ``[..., H]`` fp32 / bf16 / fp16 — the full hidden states on every TP rank (after
            Megatron's sequence-parallel gather); any leading shape (``[S, B]``, ``[B, S]``, ``[N]``).
        weight: ``[V_local, H]``, hidden's dtype — this rank's output-layer shard; rank r of
            ``tp_group`` owns global ids ``[r * V_local, (r + 1) * V_local)`` (Megatron's layout).
        target: ``[...]`` integer global token ids, ``hidden.shape[:-1]``.
        tp_group: the tensor-parallel process group; ``None`` means no tensor parallelism. The
            gradient w.r.t. ``hidden`` is this rank's partial sum: apply the op to the output of
            Megatron's ``copy_to_tensor_model_parallel_region`` (or ``gather_from_sequence_parallel_region``
            with sequence parallelism), as ColumnParallelLinear does — see the module docstring.
        temperature: logits are divided by it inside the kernels.
        with_entropy: also return the entropy of the whole distribution (differentiable).
        ignore_index: rows with this target get log-prob 0 and no gradient from it.
        chunk_tokens: rows per forward chunk and per backward token block; None picks them from
            ``LOGITS_CHUNK_BYTES`` and ``GRAD_HIDDEN_BLOCK_BYTES``. Forward holds
            ``chunk_tokens x V_local`` logits at a time.
        chunk_vocab: columns per backward chunk (backward holds ``[token block, chunk_vocab]``
            logits); None picks it from ``LOGITS_CHUNK_BYTES``. Forward chunks are whole rows.
        accumulate_into_main_grad: Megatron's gradient-accumulation fusion — add the weight gradient
            into ``weight.main_grad`` (fp32, or weight's dtype) and return Megatron's placeholder as
            the weight's gradient. Pass the output layer's ``gradient_accumulation_fusion``.
        check_inputs: as in :func:`~mp_grpo.vocab_parallel_logprobs` (a ``CheckInputs``; ``True``:
            ``DEFERRED``): raise on a target outside ``[0, V_global)`` or on unequal shards (at once on
            the CPU, at the next ``mp_grpo.check_errors()`` on a GPU: no host read per call; ``SYNC``: at
            the call); with ``OFF`` / ``False`` nothing is recorded, and such outputs are NaN instead.
        sampling_filter: as in :func:`~mp_grpo.vocab_parallel_logprobs` — the log-probs, entropy and
            gradients of the rollout's filtered, renormalized distribution. The threshold search runs on
            each forward chunk (whole rows; its passes and collectives once per chunk, so every TP rank must
            cut the same chunks) and its ``[N]`` fp32 thresholds are saved for backward. Backward then
            recomputes the logits in forward's chunks (whole rows; ``chunk_vocab`` is not used), with the
            same GEMMs and so the same bits: a logit sits on the same side of the threshold in both — a
            recompute in other shapes can differ by one rounding step, and the top-k threshold is itself
            a logit.
        logit_dtype: ``LogitDtype.BF16`` (default): the logits in hidden's dtype, as the logits path makes them;
            ``LogitDtype.FP32``: kept as the GEMM's fp32 accumulator (bf16 GEMMs, fp32 output; refused where
            the torch has no such GEMM) — log-probs and entropy free of the logits' bf16 rounding, at the
            cost of twice the bytes per chunk (see the module docstring, "Precision").
        captured_support: as in :func:`~mp_grpo.vocab_parallel_logprobs` — each token's distribution renormalized
            over the rollout engine's captured support (:class:`mp_grpo.CapturedSupport`): each forward chunk's
            statistics gather the chunk's logits at the support's ids; backward writes the gradient at them (any
            chunk shape). Not with ``sampling_filter``.

    Returns:
        fp32 log-probs ``[...]``; with ``with_entropy=True`` the pair ``(logprobs, entropy)``.

    One all-gather of a ``[N + 1, 4]`` fp32 tensor per call. No collective in backward.
    """
    inv_temperature, chunk_tokens, chunk_vocab, check_inputs = _checked(
        hidden, weight, target, temperature, chunk_tokens, chunk_vocab, accumulate_into_main_grad, check_inputs,
        sampling_filter, captured_support, logit_dtype)
    return fused_linear_logprobs_unchecked(
        hidden, weight, target, tp_group=tp_group, inv_temperature=inv_temperature, with_entropy=bool(with_entropy),
        ignore_index=int(ignore_index), chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab,
        accumulate_into_main_grad=bool(accumulate_into_main_grad), check_inputs=check_inputs,
        sampling_filter=sampling_filter, logit_dtype=logit_dtype, captured_support=captured_support,
    )


def fused_linear_logprobs_with_top_k(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    top_k_ids: TokenIds,
    *,
    tp_group: ProcessGroup | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
    accumulate_into_main_grad: bool = False,
    check_inputs: CheckInputs | bool = CheckInputs.DEFERRED,
    sampling_filter: SamplingFilter | None = None,
    logit_dtype: LogitDtype = LogitDtype.BF16,
    captured_support: CapturedSupport | None = None,
) -> TokenLogprobs:
    """:func:`fused_linear_logprobs`, and during its forward the log-probs at ``top_k_ids`` (the rollout engine's
    top-K ids of every token: :class:`mp_grpo.TokenIds`, CSR over the flattened targets) — each forward chunk's
    logits gathered at its rows' ids before the chunk is overwritten, no second pass over the logits. Arguments and
    result as :func:`mp_grpo.vocab_parallel_logprobs_with_top_k`'s (``ops/top_k_logprobs.py``)."""
    inv_temperature, chunk_tokens, chunk_vocab, check_inputs = _checked(
        hidden, weight, target, temperature, chunk_tokens, chunk_vocab, accumulate_into_main_grad, check_inputs,
        sampling_filter, captured_support, logit_dtype)
    check_token_ids(top_k_ids, "top_k_ids", target.shape, hidden.device)
    return fused_linear_logprobs_unchecked(
        hidden, weight, target, tp_group=tp_group, inv_temperature=inv_temperature, with_entropy=bool(with_entropy),
        ignore_index=int(ignore_index), chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab,
        accumulate_into_main_grad=bool(accumulate_into_main_grad), check_inputs=check_inputs,
        sampling_filter=sampling_filter, logit_dtype=logit_dtype, captured_support=captured_support,
        top_k_ids=top_k_ids,
    )


def _checked(hidden, weight, target, temperature, chunk_tokens, chunk_vocab, accumulate_into_main_grad, check_inputs,
             sampling_filter, captured_support, logit_dtype) -> tuple[float, int | None, int | None, CheckInputs]:
    """The public entries' argument checks: ``(1 / temperature, chunk_tokens, chunk_vocab, check_inputs)``."""
    check_hidden_weight_and_target(hidden, weight, target)
    check_runs_here(hidden, "hidden")
    inv_temperature = check_temperature(temperature)
    chunk_tokens = check_chunk_size(chunk_tokens, "chunk_tokens")
    chunk_vocab = check_chunk_size(chunk_vocab, "chunk_vocab")
    if accumulate_into_main_grad:
        check_main_grad(weight)
    check_inputs = check_inputs_mode(check_inputs)
    check_replay(sampling_filter, captured_support, target.shape, hidden.device, check_inputs)
    logits_dtype(logit_dtype, hidden)  # refused here, before any work, where it cannot be honoured
    return inv_temperature, chunk_tokens, chunk_vocab, check_inputs


def fused_linear_logprobs_unchecked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: ProcessGroup | None,
    inv_temperature: float,
    with_entropy: bool,
    ignore_index: int,
    chunk_tokens: int | None,
    chunk_vocab: int | None,
    accumulate_into_main_grad: bool,
    check_inputs: CheckInputs,
    sampling_filter: SamplingFilter | None,
    logit_dtype: LogitDtype = LogitDtype.BF16,
    captured_support: CapturedSupport | None = None,
    top_k_ids: TokenIds | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | TokenLogprobs:
    """:func:`fused_linear_logprobs` (with ``top_k_ids``: :func:`fused_linear_logprobs_with_top_k`) without its
    argument checks, for a caller that made them once at its own boundary (``MegatronGRPO.loss_func``): ``hidden``,
    ``weight`` and ``target`` as :func:`~mp_grpo.ops.checks.check_hidden_weight_and_target` and
    :func:`~mp_grpo.ops.checks.check_runs_here` accept them, ``weight.main_grad`` checked when accumulating into it,
    ``inv_temperature`` from :func:`~mp_grpo.ops.checks.check_temperature`, chunk sizes None or positive ints,
    ``check_inputs`` a :class:`CheckInputs`, ``sampling_filter`` and ``captured_support`` passed by
    :func:`~mp_grpo.ops.captured_support.check_replay` for ``target``, ``top_k_ids`` by
    :func:`~mp_grpo.ops.token_ids.check_token_ids`."""
    chunk_dtype = logits_dtype(logit_dtype, hidden)
    plan = plan_chunks(
        target.numel(), weight.shape[1], weight.shape[0], chunk_dtype,
        chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab,
    )
    if sampling_filter is not None:
        sampling_filter = sampling_filter.without_noops(weight.shape[0] * group_size(tp_group))
    if sampling_filter is not None:
        # Backward recomputes exactly forward's logits (the same GEMMs: whole-row chunks of the same rows), so
        # every column falls on the same side of its row's threshold — the k-th largest logit IS the threshold.
        plan = replace(plan, backward_rows=plan.forward_rows, backward_cols=weight.shape[0])
    out = FusedLinearLogProbs.apply(
        hidden, weight, target, tp_group, inv_temperature, with_entropy, ignore_index, plan,
        accumulate_into_main_grad, check_inputs, sampling_filter, chunk_dtype, captured_support, top_k_ids,
    )
    if top_k_ids is None:
        return out
    logprobs, entropy, top_k = out
    return TokenLogprobs(logprobs, entropy if with_entropy else None, top_k)
