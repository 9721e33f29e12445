"""Output layer + token-separable loss fused: the loss's gradient produced in forward, three GEMMs, no logits kept.

:func:`fused_linear_loss` computes ``loss_fn(log softmax(hidden @ weightᵀ / T)[target], entropy)`` and
its gradients w.r.t. ``hidden`` and ``weight`` in ONE pass over row chunks: the per-token coefficients
d loss / d logp and d loss / d entropy are known as soon as a chunk's log-probs are, so the chunk's
logits gradient is formed in place and multiplied out right away — three GEMMs per chunk (the bare
output layer's three), no recompute (:mod:`mp_grpo.ops.fused_linear_logprobs` needs four, for callers
whose upstream gradient is unknown in forward). Backward only scales the stored gradients by the actual
upstream gradient (Megatron's loss scaling) and adds the weight's into ``main_grad`` when asked.

``loss_fn(logprobs, entropy) -> (loss, aux)`` must be TOKEN-SEPARABLE: the gradient at token t may
depend on token t's log-prob and entropy and on constants, never on another token's (the GRPO losses of
:func:`mp_grpo.loss.separable.token_separable`, given the step's :class:`~mp_grpo.GlobalBatch`). The op
calls it on full-size ``[...]`` log-prob / entropy tensors once per forward chunk, rows not yet computed
holding 0, and keeps the gradient of the chunk's rows only; the last call sees every row, and its
``(loss, aux)`` are returned. The loss maths is thereby defined once, in ``loss_fn`` (GRPOLoss).

Schedule of :class:`FusedLinearLoss` (``N`` rows, ``H`` hidden, ``V_local`` columns on each of ``TP`` ranks)

Forward — chunks of whole rows, ``[rows, V_local]`` (the plan of :func:`~mp_grpo.ops.fused_linear_logprobs.plan_chunks`)
    1. ``logits = hidden[chunk] @ weightᵀ`` (≤ ``LOSS_LOGITS_CHUNK_BYTES``; cuBLAS, fp32 accumulation, hidden's dtype —
       or with ``logit_dtype=FP32`` the fp32 accumulator itself, ≤ ``LOSS_LOGITS_CHUNK_BYTES_FP32``) into one reused
       buffer; ``logprob_stats_kernel`` writes the chunk's ``[rows + 1, 4]`` statistics.
    2. The TP merge: all-gather of the chunk's statistics over ``tp_group`` (one small collective per
       chunk; skipped for a group of size 1) and ``logprob_merge_kernel`` → the chunk's log-probs,
       entropy, M and log S.
    3. The coefficient: ``loss_fn`` under autograd on the detached full-size log-probs / entropy
       (the chunk's rows filled in); d loss / d logp and d loss / d entropy of the chunk's rows.
    4. ``logprob_backward_kernel`` IN PLACE: the chunk buffer becomes d loss / d logits, in hidden's dtype (fp32
       logits: narrowed in place, the front half of each row's storage — ``logprob_launch.narrowed_in_place``).
    5. ``grad_hidden[chunk] = grad_logits @ weight`` (fp32 accumulation, written once: the chunk spans
       this rank's whole vocabulary). Skipped when ``hidden`` needs no gradient.
    6. ``grad_weight (+)= grad_logitsᵀ @ hidden[chunk]`` into an fp32 ``[V_local, H]`` accumulator when
       there are several chunks and it fits ``WEIGHT_GRAD_FP32_BYTES``, else into a buffer of weight's
       dtype (cuBLAS sums each chunk in fp32 and rounds once per chunk; one chunk: rounded once, as an
       fp32 buffer would be). Skipped when ``weight`` needs no gradient.
    Saved for backward: the two gradients (no logits, no inputs).
    With a ``sampling_filter``: step 1's statistics are those of the chunk's kept set and give its per-row
    thresholds (``ops/sampling_filter.py``, ``filtered_statistics``: its collectives once per chunk); step 4
    then counts only the kept columns, and targets outside the kept set get no coefficient. With a
    ``captured_support``: step 1's statistics are each row's support's (``ops/captured_support.py``: a gather, no
    collective) and step 4 is ``support_backward`` (the gradient at the support's columns, 0 elsewhere).
    With ``top_k_ids``: step 1 also gathers the chunk's logits at the engine's top-K ids of its rows into a payload
    that travels in step 2's all-gather (the whole ``[nnz]`` payload each chunk: the chunk's range of it is known on
    the device only), step 2 turns them into log-probs (``ops/top_k_logprobs.py``), and step 3 calls
    ``loss_fn(logprobs, entropy, top_k_logprobs)`` — the ``[nnz]`` fp32 log-probs at the ids, the entries of rows
    not yet computed 0, as their log-probs.

Backward (``g`` = the upstream gradient of the loss, a 0-dim device tensor; no host read) — one pass of
:func:`~mp_grpo.ops.scale.scale_into` (``kernels/scale.py``, ``g`` read from its device pointer) per gradient:
    1. ``grad_hidden = g · grad_hidden`` (in place on the op's own buffer).
    2. ``grad_weight = g · grad_weight`` in weight's dtype (in place when the buffer has it, else written
       once into a new, unfilled tensor of weight's dtype); with ``accumulate_into_main_grad``:
       ``weight.main_grad += g · grad_weight`` (one read of each, one write) and Megatron's placeholder
       is returned (:func:`~mp_grpo.ops.fused_linear_logprobs.main_grad_placeholder`).

Tensor parallelism: as :func:`~mp_grpo.fused_linear_logprobs` (the returned hidden gradient is this
rank's partial sum; apply Megatron's input mapping). ``loss_fn`` runs on every TP rank on the same
log-probs; every rank must cut the same chunks (same ``N``), as the all-gather per chunk needs.

Memory beyond the inputs: one logits chunk (≤ ``LOSS_LOGITS_CHUNK_BYTES``), the ``[N, H]`` hidden gradient
and the ``[V_local, H]`` weight gradient (held from forward to backward — they are the outputs
backward returns; under gradient-accumulation fusion the weight buffer is extra: ``V_local·H`` in
weight's dtype, or fp32 for several chunks when that fits ``WEIGHT_GRAD_FP32_BYTES``).

Precision: with ``logit_dtype=BF16`` the logits are rounded to hidden's dtype as on the logits path; with ``FP32``
they are the GEMM's fp32 accumulator (log-probs, entropy and the loss's coefficients free of their bf16 rounding).
Their gradient is rounded to hidden's dtype for the GEMMs either way. The
weight gradient is summed over row chunks in fp32 when the fp32 buffer fits the budget, else rounded
to weight's dtype once per chunk (one chunk: once); the upstream scaling ``g`` (fp32 product) and the
cast to weight's dtype are one more rounding together (none for g = 1 into a buffer of weight's dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
    gather_and_merge,
    logprob_backward,
    narrowed_in_place,
    new_stats_buffer,
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
from mp_grpo.ops.top_k_logprobs import gather_logits_at_ids, logprobs_at_ids
from mp_grpo.ops.scale import scale_into_unchecked

LOSS_LOGITS_CHUNK_BYTES = 768 * 2**20
"""The one logits-chunk buffer of the forward pass. Larger than the per-token op's 512 MiB: every chunk
costs one call of ``loss_fn`` and one read-modify-write of the ``[V_local, H]`` weight gradient, and
nothing else is held. At N = 16384, H = 4096, bf16: 7 chunks of 2432 rows at V = 151936 (10 at 512 MiB),
one chunk at V = 18992 (2 at 512 MiB)."""

LOSS_LOGITS_CHUNK_BYTES_FP32 = 960 * 2**20
"""The same buffer holding fp32 logits (``logit_dtype=FP32``; their bf16 gradient is narrowed into it). Not
768 MiB: at half the rows per chunk the chunks would double (14 at V = 151936, N = 16384), and each one reads and
writes the whole ``[V_local, H]`` weight gradient once more (1.2 GiB each way in bf16 at H = 4096, ~0.8 ms on an
H100); 960 MiB gives 10 chunks of 1656 rows there, for 0.19 GiB more at the peak."""

WEIGHT_GRAD_FP32_BYTES = 512 * 2**20
"""The weight gradient is summed over several row chunks in an fp32 ``[V_local, H]`` buffer when it fits
this (V_local·H ≤ 128 Mi: V = 18992 at H = 4096 does, V = 151936 does not); else in weight's dtype. A
single chunk (V = 18992 at N = 16384) goes straight into weight's dtype: cuBLAS rounds its fp32 sum once
either way, and the bf16 buffer is half the memory and half the bytes for backward's scaling pass."""

LossFn = Callable[..., "tuple[torch.Tensor, Any]"]
"""``loss_fn(logprobs, entropy or None) -> (0-dim loss, aux)``; with ``top_k_ids``
``loss_fn(logprobs, entropy or None, top_k_logprobs)``."""


class _Aux:
    """Carries ``loss_fn``'s non-differentiable second output out of the Function."""

    value: Any = None


def _coefficients(
    loss_fn: LossFn,
    logprobs: torch.Tensor,  # [N] fp32, rows so far filled in
    entropy: torch.Tensor | None,  # [N] fp32, or None
    token_shape: torch.Size,
    top_k: torch.Tensor | None = None,  # [nnz] fp32 the log-probs at the top-K ids, rows so far filled in
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, Any]:
    """Forward step 3: ``(d loss/d logp [N], d loss/d entropy [N] or None, loss, aux)`` of ``loss_fn`` here."""
    with torch.enable_grad():
        lp = logprobs.detach().requires_grad_()
        ent = entropy.detach().requires_grad_() if entropy is not None else None
        args = (lp.view(token_shape), ent.view(token_shape) if ent is not None else None)
        loss, aux = loss_fn(*args) if top_k is None else loss_fn(*args, top_k)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(f"loss_fn must return (a 0-dim loss tensor, aux), got {type(loss).__name__} as the loss")
        inputs = [lp] if ent is None else [lp, ent]
        if loss.requires_grad:
            grads = torch.autograd.grad(loss, inputs, allow_unused=True)
        else:  # a loss that reads neither (e.g. a skipped step): zero gradient
            grads = (None,) * len(inputs)
    grad_lp = grads[0] if grads[0] is not None else torch.zeros_like(logprobs)
    grad_ent = grads[1] if ent is not None else None
    return grad_lp.float().contiguous(), None if grad_ent is None else grad_ent.float().contiguous(), loss.detach(), aux


class FusedLinearLoss(torch.autograd.Function):
    """Differentiable w.r.t. ``hidden`` and ``weight``; see the module docstring for the schedule."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,  # [..., H]
        weight: torch.Tensor,  # [V_local, H]
        target: torch.Tensor,  # [...]
        loss_fn: LossFn,
        aux_out: _Aux,
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
        v_local, hidden_size = weight.shape
        h = hidden.reshape(-1, hidden_size).contiguous()
        w = weight.contiguous()
        t = target.reshape(-1).to(torch.int64).contiguous()
        n = h.shape[0]
        vocab_start = group_rank(tp_group) * v_local
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]

        logprobs = torch.zeros(n, dtype=torch.float32, device=h.device)
        entropy = torch.zeros(n, dtype=torch.float32, device=h.device) if with_entropy else None
        grad_h = torch.empty_like(h) if need_hidden else None
        grad_w = None
        if need_weight:
            fp32_sum = n > plan.forward_rows and v_local * hidden_size * 4 <= WEIGHT_GRAD_FP32_BYTES
            # The first chunk's GEMM overwrites it (step 6); only an empty batch leaves it as allocated.
            alloc = torch.empty if n > 0 else torch.zeros
            grad_w = alloc(w.shape, dtype=torch.float32 if fp32_sum else w.dtype, device=w.device)
        chunk = torch.empty(plan.forward_rows * v_local, dtype=chunk_dtype, device=h.device)
        stats_buffer = new_stats_buffer(min(plan.forward_rows, max(n, 1)), h.device)
        v_global = v_local * group_size(tp_group)
        if captured_support is not None:
            record_token_ids_errors(captured_support, "captured_support", v_global, check_inputs,
                                    strictly_increasing=True)
        top_k = None
        if top_k_ids is not None:
            record_token_ids_errors(top_k_ids, "top_k_ids", v_global, check_inputs, strictly_increasing=False)
            top_k = torch.zeros(top_k_ids.nnz, dtype=torch.float32, device=h.device)

        per_row = sampling_filter.flattened() if sampling_filter is not None else None
        loss = aux = None
        for r0 in range(0, max(n, 1), plan.forward_rows):
            r1 = min(r0 + plan.forward_rows, n)
            rows = r1 - r0
            x = chunk_view(chunk, rows, v_local)
            if top_k is None:
                stats, payload, payload_rows = stats_buffer[: rows + 1], None, 0  # row `rows` carries V_local
            else:  # the statistics and the whole payload, one buffer for the all-gather
                buffer = new_stats_buffer_with(rows, top_k.numel(), h.device)
                stats, payload, payload_rows = buffer.stats, buffer.payload, buffer.payload_rows

            # --- 1. the chunk's logits and their shard statistics (and its rows' logits at the top-K ids) ---
            matmul_into(x, h[r0:r1], w.t(), accumulate=False)
            threshold = has_support = None
            if per_row is not None:  # the statistics of the chunk's kept set, and its per-row thresholds
                threshold = filtered_statistics(x, t[r0:r1], stats, per_row.rows(r0, r1), torch.Size([rows]),
                                                tp_group=tp_group, inv_temperature=inv_temperature,
                                                with_entropy=with_entropy)
            elif captured_support is not None:  # the statistics of each row's support
                has_support = support_statistics(x, t[r0:r1], stats, captured_support, csr_row_start=r0,
                                                 vocab_start=vocab_start, inv_temperature=inv_temperature,
                                                 with_entropy=with_entropy)
            else:
                shard_statistics(x, t[r0:r1], stats, vocab_start=vocab_start, inv_temperature=inv_temperature,
                                 with_entropy=with_entropy)
            if payload is not None:
                gather_logits_at_ids(x, payload, top_k_ids, csr_row_start=r0, vocab_start=vocab_start,
                                     threshold=threshold, support=captured_support)
            # --- 2. the TP merge (one all-gather of the chunk's statistics, the payload with them) ---
            merged, gathered = gather_and_merge(
                stats if payload is None else buffer.buffer, t[r0:r1], tp_group=tp_group, v_local=v_local,
                ignore_index=ignore_index, inv_temperature=inv_temperature, with_entropy=with_entropy,
                check_inputs=check_inputs, payload_rows=payload_rows,
            )
            logprobs[r0:r1] = merged.logprobs
            if entropy is not None:
                entropy[r0:r1] = merged.entropy
            if top_k is not None:
                logprobs_at_ids(gathered, t[r0:r1], top_k_ids, top_k, csr_row_start=r0, v_local=v_local,
                                ignore_index=ignore_index, inv_temperature=inv_temperature)
            outside = None
            if threshold is not None:
                # As vocab_parallel_logprobs: a target outside the kept set has log-prob -inf, no gradient.
                outside = targets_outside_filter(merged.logprobs, t[r0:r1], ignore_index, check_inputs)
            elif has_support is not None:
                outside = targets_outside_support(merged.logprobs, t[r0:r1], ignore_index, check_inputs)

            # --- 3. the coefficients d loss / d logp, d loss / d entropy of the chunk's rows ---
            grad_lp, grad_ent, loss, aux = _coefficients(loss_fn, logprobs, entropy, target.shape, top_k)
            if outside is not None:
                grad_lp[r0:r1] = torch.where(outside, 0.0, grad_lp[r0:r1])
            if rows == 0 or not (need_hidden or need_weight):
                continue

            # --- 4. the chunk's logits gradient, in place (narrowed to hidden's dtype for fp32 logits) ---
            g = x if x.dtype == h.dtype else narrowed_in_place(x, h.dtype)
            chunk_rows = (x, g, t[r0:r1], merged.row_max, merged.log_sum, merged.complement, merged.entropy,
                          merged.centered, grad_lp[r0:r1], grad_ent[r0:r1] if grad_ent is not None else None)
            if has_support is not None:
                support_backward(*chunk_rows, captured_support, has_support, csr_row_start=r0, vocab_start=vocab_start,
                                 ignore_index=ignore_index, inv_temperature=inv_temperature)
            else:
                logprob_backward(*chunk_rows, vocab_start=vocab_start, ignore_index=ignore_index,
                                 inv_temperature=inv_temperature, threshold=threshold)
            # --- 5. hidden gradient of the chunk's rows (whole local vocabulary: written once) ---
            if grad_h is not None:
                matmul_into(grad_h[r0:r1], g, w, accumulate=False)
            # --- 6. weight gradient, summed over row chunks ---
            if grad_w is not None:
                matmul_into(grad_w, g.t(), h[r0:r1], accumulate=r0 > 0)

        ctx.save_for_backward(grad_h, grad_w)
        # Like Megatron's linear layer: main_grad is kept on ctx, not saved (DDP writes into it).
        ctx.main_grad = weight.main_grad if accumulate_into_main_grad else None
        ctx.weight = weight if accumulate_into_main_grad else None
        ctx.hidden_shape = hidden.shape
        ctx.weight_dtype = weight.dtype
        aux_out.value = aux
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        not_differentiable = (None,) * 14
        grad_hidden = grad_weight = None
        g = grad_loss.float()  # 0-dim on the device; a no-op for the fp32 loss
        # One pass of kernels/scale.py per gradient; it reads g from the device (no host read, nothing zero-filled).
        # --- 1. the hidden gradient, scaled by the upstream gradient (in place) ---
        # Forward made these buffers (contiguous, on one device) and checked main_grad: scale_into's checks are skipped.
        if grad_h is not None:
            grad_hidden = scale_into_unchecked(grad_h, g, grad_h, accumulate=False).view(ctx.hidden_shape)
        # --- 2. the weight gradient: scaled (in place, or cast into weight's dtype), or added into main_grad ---
        if grad_w is not None:
            if ctx.main_grad is not None:
                scale_into_unchecked(grad_w, g, ctx.main_grad, accumulate=True)
                grad_weight = main_grad_placeholder(ctx.weight, ctx.weight_dtype)
            elif grad_w.dtype == ctx.weight_dtype:
                grad_weight = scale_into_unchecked(grad_w, g, grad_w, accumulate=False)
            else:
                cast = torch.empty(grad_w.shape, dtype=ctx.weight_dtype, device=grad_w.device)
                grad_weight = scale_into_unchecked(grad_w, g, cast, accumulate=False)
        return (grad_hidden, grad_weight, *not_differentiable)


def fused_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    loss_fn: LossFn,
    *,
    tp_group: ProcessGroup | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    accumulate_into_main_grad: bool = False,
    check_inputs: CheckInputs | bool = CheckInputs.DEFERRED,
    sampling_filter: SamplingFilter | None = None,
    logit_dtype: LogitDtype = LogitDtype.BF16,
    captured_support: CapturedSupport | None = None,
    top_k_ids: TokenIds | None = None,
) -> tuple[torch.Tensor, Any]:
    """``loss_fn(log-probs, entropy)`` of ``log softmax(hidden @ weightᵀ / T)[target]``, its gradient made in forward.

    Args:
        hidden, weight, target, tp_group, temperature, ignore_index, accumulate_into_main_grad,
        check_inputs: as in :func:`~mp_grpo.fused_linear_logprobs`.
        loss_fn: ``(logprobs [...] fp32, entropy [...] fp32 or None) -> (0-dim loss, aux)``, token-separable
            (see the module docstring); called once per forward chunk.
        with_entropy: pass the entropy to ``loss_fn`` (else None).
        chunk_tokens: rows per forward chunk; None: the largest within ``LOSS_LOGITS_CHUNK_BYTES``.
        sampling_filter: as in :func:`~mp_grpo.vocab_parallel_logprobs`; the threshold search runs on each
            forward chunk (its passes and collectives once per chunk). The gradient is formed from the same
            logits the thresholds were found on (no recompute), so the kept set is the same in both.
        logit_dtype: as in :func:`~mp_grpo.fused_linear_logprobs`; with ``FP32`` the chunks are the fp32 logits
            (``LOSS_LOGITS_CHUNK_BYTES_FP32``).
        captured_support: as in :func:`~mp_grpo.vocab_parallel_logprobs` — each token's distribution renormalized
            over the rollout engine's captured support (:class:`mp_grpo.CapturedSupport`); the gradient is written
            at the support's columns of each chunk. Not with ``sampling_filter``.
        top_k_ids: the rollout engine's top-K ids of every token (:class:`mp_grpo.TokenIds`, CSR over the flattened
            targets): ``loss_fn`` is then called as ``loss_fn(logprobs, entropy, top_k_logprobs)`` with the
            trainer's log-probs at those ids, ``[nnz]`` fp32 aligned with ``top_k_ids.ids`` (normalized as the
            targets' log-probs; not differentiable; the entries of rows not yet computed 0), gathered from each
            chunk's logits (module docstring).

    Returns:
        ``(loss, aux)``: the loss (0-dim, differentiable w.r.t. ``hidden`` and ``weight``) and ``loss_fn``'s
        aux of its last call (every row filled in).
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (logprobs, entropy) -> (loss, aux), got {type(loss_fn).__name__}")
    check_hidden_weight_and_target(hidden, weight, target)
    check_runs_here(hidden, "hidden")
    inv_temperature = check_temperature(temperature)
    chunk_tokens = check_chunk_size(chunk_tokens, "chunk_tokens")
    if accumulate_into_main_grad:
        check_main_grad(weight)
    check_inputs = check_inputs_mode(check_inputs)
    check_replay(sampling_filter, captured_support, target.shape, hidden.device, check_inputs)
    if top_k_ids is not None:
        check_token_ids(top_k_ids, "top_k_ids", target.shape, hidden.device)
    logits_dtype(logit_dtype, hidden)  # refused here, before any work, where it cannot be honoured
    return fused_linear_loss_unchecked(
        hidden, weight, target, loss_fn, tp_group=tp_group, inv_temperature=inv_temperature,
        with_entropy=bool(with_entropy), ignore_index=int(ignore_index), chunk_tokens=chunk_tokens,
        accumulate_into_main_grad=bool(accumulate_into_main_grad), check_inputs=check_inputs,
        sampling_filter=sampling_filter, logit_dtype=logit_dtype, captured_support=captured_support,
        top_k_ids=top_k_ids,
    )


def fused_linear_loss_unchecked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    loss_fn: LossFn,
    *,
    tp_group: ProcessGroup | None,
    inv_temperature: float,
    with_entropy: bool,
    ignore_index: int,
    chunk_tokens: int | None,
    accumulate_into_main_grad: bool,
    check_inputs: CheckInputs,
    sampling_filter: SamplingFilter | None,
    logit_dtype: LogitDtype = LogitDtype.BF16,
    captured_support: CapturedSupport | None = None,
    top_k_ids: TokenIds | None = None,
) -> tuple[torch.Tensor, Any]:
    """:func:`fused_linear_loss` without its argument checks, for a caller that made them once at its own boundary
    (``MegatronGRPO.loss_func``, through :func:`mp_grpo.megatron.fused_output.fused_output_loss`): the arguments
    as :func:`~mp_grpo.ops.fused_linear_logprobs.fused_linear_logprobs_unchecked` takes them, ``loss_fn``
    callable."""
    chunk_dtype = logits_dtype(logit_dtype, hidden)
    budget = LOSS_LOGITS_CHUNK_BYTES if chunk_dtype == hidden.dtype else LOSS_LOGITS_CHUNK_BYTES_FP32
    plan = plan_chunks(
        target.numel(), weight.shape[1], weight.shape[0], chunk_dtype, chunk_tokens=chunk_tokens,
        logits_chunk_bytes=budget,
    )
    if sampling_filter is not None:
        sampling_filter = sampling_filter.without_noops(weight.shape[0] * group_size(tp_group))
    aux = _Aux()
    loss = FusedLinearLoss.apply(
        hidden, weight, target, loss_fn, aux, tp_group, inv_temperature, with_entropy, ignore_index, plan,
        accumulate_into_main_grad, check_inputs, sampling_filter, chunk_dtype, captured_support, top_k_ids,
    )
    return loss, aux.value
