"""The GRPO-family loss through fused Triton kernels: host launches and the autograd Function.

Same results as the torch path of :class:`mp_grpo.GRPOLoss` (its readable specification), in a few
launches: every sequence-level quantity of the loss is detached except the gspo / gmpo sequence mean,
so the loss is a sum of per-token terms once the per-sequence sums are known, and each term's gradient
is written in the forward pass.

Schedule of :class:`FusedGRPOLossFunction` (one micro-batch: N token positions, S sequences)

Forward
    1. Two allocations: one float64 workspace — the metric pairs and extremes, the combine's per-program
       partials and, when the config needs per-sequence sums, the sums ``[S, K]`` and (gspo / gmpo) the
       per-sequence gradient ``[S]``, zeroed then (one memset) — and one compute-dtype buffer for the
       per-token gradients the forward writes (log-prob; entropy; gspo / gmpo sequence factor).
    2. ``grpo_loss_token_kernel``: the per-sequence sums (valid tokens, gspo / gmpo input, Σd, OPSM).
    3. Context parallelism only: all-reduce of the sums over the CP group (``all_reduce_sum``).
    4. ``grpo_loss_combine_kernel``: per token the share c_t / D_t and its gradient w.r.t. the log-prob
       (and the entropy); gspo / gmpo add ∂share/∂m_s per sequence; per program the metric partials.
    5. ``grpo_loss_finalize_kernel``: the loss (0-dim) and the metric pairs and extremes, and the per-input counts
       of non-finite inputs at trained positions added into the deferred error ledger (on the CPU read at once:
       ``mp_grpo.ops.checks.nonfinite_input_kinds``); gspo / gmpo without
       context parallelism: its other programs add ∂share/∂m_s · ∂m_s/∂log π_θ[t] into the per-token gradient
       (the per-sequence sums are complete only then), so that the gradient is one coefficient per token.
Backward
    1. gspo / gmpo under context parallelism only: all-reduce over the CP group of g · ∂share/∂m_s (each
       CP rank's share depends on the whole sequence's mean, like ``SumOverGroup``).
    2. ``grpo_loss_backward_kernel``: g × the forward's gradients (+ under context parallelism
       ∂share/∂m_s · ∂m_s/∂log π_θ[t], step 1's).

With :class:`FromStats` (``GRPOLoss.on_logits``, :mod:`mp_grpo.ops.logits_grpo_loss`) there are no log-prob
inputs: steps 2 and 4 merge them from the log-prob op's all-gathered statistics, and step 4 also writes M,
log S and the entropy for the log-prob backward (a third part of the compute-dtype buffer).

Launches per call: forward 2 (no per-sequence sums: combine, finalize) to 4 (memset, token, combine,
finalize), backward 1. No host synchronization; the step's counts and decisions are read by the kernels
from the GlobalBatch's device tensors. Per-sequence sums meet through float64 atomics, so their last
bits (far below the compute dtype's) depend on the order the programs run in.

Non-finite inputs: steps 2 and 4 drop a trained position whose log-prob, entropy, old / rollout / reference
log-prob or advantage is NaN or ±inf, as if it were masked (``grpo_loss_common.token_inputs``): no value, no
gradient, no per-sequence sum reads it. Step 4 counts them, step 5 reports the metric ``nonfinite_inputs`` and
adds the per-input counts into the ledger, raised by ``mp_grpo.check_errors()`` — none in a skipped step.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from mp_grpo.collectives import ProcessGroup, all_reduce_sum, group_size
from mp_grpo.config.loss import LossConfig
from mp_grpo.kernels.grpo_loss_backward import grpo_loss_backward_kernel
from mp_grpo.kernels.grpo_loss_combine import grpo_loss_combine_kernel
from mp_grpo.kernels.grpo_loss_constants import CONSTANTS_KEY, NUM_EXTREMES, NUM_PAIRS, PARTIAL_COLS
from mp_grpo.kernels.grpo_loss_finalize import grpo_loss_finalize_kernel
from mp_grpo.kernels.grpo_loss_token import grpo_loss_token_kernel
from mp_grpo.kernels.launch_config import INTERPRETER, ceil_div
from mp_grpo.ops.checks import (
    CheckInputs, check_runs_here, kernel_counters, nonfinite_input_kinds, raise_on_kernel_errors,
)
from mp_grpo.ops.grpo_loss_plan import FusedLossPlan, InputsKey, build_plan, config_parameters
from mp_grpo.ops.launcher import LaunchMeta, launch, launch_meta

_TRITON_DTYPES = {torch.float32: triton.language.float32, torch.float64: triton.language.float64}
_PARTIAL_COLS = int(PARTIAL_COLS.value)
_NUM_PAIRS = int(NUM_PAIRS.value)
_NUM_EXTREMES = int(NUM_EXTREMES.value)
_FINALIZE_COLS = triton.next_power_of_2(_PARTIAL_COLS)


class _LaunchConfig(NamedTuple):
    token_block: int
    token_warps: int
    combine_block: int
    combine_warps: int
    backward_block: int
    backward_warps: int
    finalize_block: int


_LAUNCH = _LaunchConfig(16, 1, 16, 1, 16, 1, 4) if INTERPRETER else _LaunchConfig(1024, 4, 256, 4, 1024, 4, 64)
"""Block sizes. Under the interpreter (CPU tests) small blocks, so that sequences span blocks; on a GPU
the combine pass keeps ~2 tokens a thread (it holds many values per token), the light passes 8."""


def _launch_config() -> _LaunchConfig:
    return _LAUNCH


class SequenceInfo(NamedTuple):
    """How the tokens form sequences, in the kernels' terms."""

    cu_seqlens: torch.Tensor | None
    """Packed: ``[S + 1]`` boundaries on the tokens' device; None: padded rows."""
    num_sequences: int
    """S."""
    row_length: int
    """Padded: T of ``[B, T]`` (unused when packed)."""
    cp_group: ProcessGroup | None
    """Context-parallel group of the per-sequence sums (None: none)."""
    owns_sequences: bool
    """This rank counts per-sequence metrics (CP rank 0)."""


class StepTensors(NamedTuple):
    """The GlobalBatch's values the kernels read (0-dim device tensors; None where the config needs none)."""

    valid_tokens: torch.Tensor
    sequences: torch.Tensor
    micro_batches: torch.Tensor
    weight_mean: torch.Tensor | None
    entropy_threshold: torch.Tensor | None
    skip: torch.Tensor | None
    m2po_threshold: torch.Tensor | None = None


class _Call(NamedTuple):
    """Everything of one call besides the differentiable inputs (passed through ``Function.apply``)."""

    plan: FusedLossPlan
    params: torch.Tensor
    old: torch.Tensor | None
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    rollout: torch.Tensor | None
    ref: torch.Tensor | None
    step: StepTensors
    sequences: SequenceInfo
    check_inputs: CheckInputs = CheckInputs.DEFERRED
    """How the counts of non-finite inputs at trained positions are recorded (the positions are dropped always)."""
    divergence: torch.Tensor | None = None
    """The top-K trust region's divergence per token, float64 (``mp_grpo.loss.trust_region.topk_divergence``)."""


class FusedGRPOLoss:
    """The fused loss of one :class:`LossConfig`: caches its plans (per input combination) and its
    parameter vector (per device). Called by :class:`mp_grpo.GRPOLoss` after its input checks."""

    def __init__(self, config: LossConfig) -> None:
        self.config = config
        self._parameters = config_parameters(config)
        self._params_on: dict[torch.device, torch.Tensor] = {}
        self._plans: dict[tuple, FusedLossPlan] = {}

    def prepare(
        self,
        device: torch.device,
        old_logprobs: torch.Tensor | None,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        rollout_logprobs: torch.Tensor | None,
        ref_logprobs: torch.Tensor | None,
        has_entropy: bool,
        advantages_per_token: bool,
        step: StepTensors,
        sequences: SequenceInfo,
        check_inputs: CheckInputs = CheckInputs.DEFERRED,
        divergence: torch.Tensor | None = None,
    ) -> _Call:
        """Everything of one call besides the differentiable inputs: the plan (cached per input combination),
        the parameter vector on ``device`` (cached), the inputs."""
        key = (sequences.cu_seqlens is not None, old_logprobs is not None, rollout_logprobs is not None,
               ref_logprobs is not None, has_entropy, advantages_per_token)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = build_plan(self.config, InputsKey(*key))
        params = self._params_on.get(device)
        if params is None:
            params = self._params_on[device] = torch.tensor(self._parameters, dtype=torch.float64, device=device)
        return _Call(plan, params, old_logprobs, advantages, loss_mask, rollout_logprobs, ref_logprobs, step, sequences,
                     check_inputs, divergence)

    @staticmethod
    def metrics(plan: FusedLossPlan, pairs: torch.Tensor, extremes: torch.Tensor) -> dict[str, torch.Tensor]:
        """The metric dict of :meth:`mp_grpo.GRPOLoss.__call__` from the finalize kernel's outputs (views)."""
        pair_rows, extreme_rows = pairs.unbind(0), extremes.unbind(0)
        return {name: (pair_rows if is_pair else extreme_rows)[slot] for name, is_pair, slot in plan.metrics}

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor | None,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        rollout_logprobs: torch.Tensor | None,
        ref_logprobs: torch.Tensor | None,
        entropy: torch.Tensor | None,
        step: StepTensors,
        sequences: SequenceInfo,
        check_inputs: CheckInputs = CheckInputs.DEFERRED,
        divergence: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(this micro-batch's share, its metric dict) — the contract of :meth:`mp_grpo.GRPOLoss.__call__`;
        the inputs are already checked (shapes, dtypes, devices)."""
        check_runs_here(logprobs, "logprobs")
        call = self.prepare(logprobs.device, old_logprobs, advantages, loss_mask, rollout_logprobs, ref_logprobs,
                            entropy is not None, advantages.shape == logprobs.shape, step, sequences, check_inputs,
                            divergence)
        loss, pairs, extremes = FusedGRPOLossFunction.apply(logprobs, entropy, call)
        return loss, self.metrics(call.plan, pairs, extremes)


_ALIGN = 4
"""Elements a slice of a workspace is rounded up to: 16 bytes of fp32, 32 of fp64 (so that Triton's pointer
specialization, and with it the compiled kernel, does not change with the sizes before a slice)."""


@functools.lru_cache(maxsize=1024)
def _rounded(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """``sizes`` each rounded up to :data:`_ALIGN` (at least one element in all)."""
    rounded = tuple(-(-size // _ALIGN) * _ALIGN for size in sizes)
    return rounded if sum(rounded) else rounded[:-1] + (_ALIGN,)


def _workspace(sizes: tuple[int, ...], dtype: torch.dtype, device: torch.device, zeroed: bool) -> tuple[torch.Tensor, ...]:
    """One allocation split into consecutive 16-byte-aligned slices of at least ``sizes`` elements (one
    ``split``: views made in one call)."""
    rounded = _rounded(sizes)
    buffer = (torch.zeros if zeroed else torch.empty)(sum(rounded), dtype=dtype, device=device)
    return buffer.split(rounded)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous 1-D tensor (a view when it already is contiguous). ``reshape`` alone is not enough:
    it returns a strided view wherever one exists — ``x[:, :1]`` of a ``[B, T]`` tensor flattens to stride T —,
    and the kernels read their token inputs densely."""
    return x.reshape(-1).contiguous()


class FromStats(NamedTuple):
    """The log-probs as the log-prob op's statistics (:mod:`mp_grpo.ops.logits_grpo_loss`): the loss kernels merge
    them (``FROM_STATS``) instead of reading log-probs, and the combine kernel stores what the log-prob backward
    needs."""

    stats: torch.Tensor
    """[TP, N + 1, 4] fp32, all-gathered."""
    target: torch.Tensor
    """[N] int64."""
    errors: torch.Tensor
    """[2] int64 counters the merge adds into (``mp_grpo.ops.checks.kernel_counters``)."""
    v_global: int
    ignore_index: int
    inv_temperature: float


class LossSaved(NamedTuple):
    """What :func:`loss_forward` keeps for :func:`loss_backward`: the gradients it wrote in forward."""

    grad_lp: torch.Tensor
    """[N] compute dtype: ∂share/∂log π_θ[t] along each token's own path."""
    grad_ent: torch.Tensor | None
    """[N] compute dtype: ∂share/∂entropy[t] (entropy bonus only)."""
    seq_grad: torch.Tensor | None
    """[S] float64: Σ_{t ∈ s} ∂share/∂m_s (gspo / gmpo only)."""
    seq_factor: torch.Tensor | None
    """[N] compute dtype: ∂m_s/∂log π_θ[t] (gspo / gmpo only)."""
    cu: torch.Tensor
    """cu_seqlens (packed) or any tensor (padded: never read)."""
    sizes: tuple[int, int, int, int, bool]
    """(N, T, S, binary-search steps, packed)."""
    cp_group: ProcessGroup | None
    compute: object
    """The compute dtype as a Triton dtype."""
    rows: torch.Tensor | None = None
    """With :class:`FromStats`: [5, N] (M, log S, entropy, 1 - p_t, log p_t + H) of every position, for the log-prob
    backward (the entropy terms only where the plan has the entropy)."""


def _kept_meta(plan: FusedLossPlan, key: tuple, build) -> LaunchMeta:
    """The launch keywords of ``key`` for ``plan``: built once by ``build()``, kept in the plan."""
    meta = plan.launch_metas.get(key)
    if meta is None:
        meta = plan.launch_metas[key] = build()
    return meta


def _token_meta(plan: FusedLossPlan, compute, from_stats: bool) -> LaunchMeta:
    blocks = _launch_config()
    return _kept_meta(plan, ("token", compute, from_stats), lambda: LaunchMeta(
        FROM_STATS=from_stats, **plan.token_flags, COMPUTE=compute, BLOCK=blocks.token_block,
        num_warps=blocks.token_warps))


def _combine_meta(plan: FusedLossPlan, compute, from_stats: bool, owns_sequences: bool) -> LaunchMeta:
    blocks = _launch_config()
    return _kept_meta(plan, ("combine", compute, from_stats, owns_sequences), lambda: LaunchMeta(
        FROM_STATS=from_stats, **plan.combine_flags, OWNS_SEQUENCES=owns_sequences, COMPUTE=compute,
        BLOCK=blocks.combine_block, CONSTANTS_KEY=CONSTANTS_KEY, num_warps=blocks.combine_warps))


def _finalize_meta(plan: FusedLossPlan, fold: bool, packed: bool) -> LaunchMeta:
    blocks = _launch_config()
    return _kept_meta(plan, ("finalize", fold, packed), lambda: LaunchMeta(
        HAS_SKIP=plan.has_skip, FOLD_SEQ_GRAD=fold, PACKED=packed, COLS=_FINALIZE_COLS,
        BLOCK_P=blocks.finalize_block, BLOCK=blocks.backward_block, CONSTANTS_KEY=CONSTANTS_KEY,
        num_warps=blocks.backward_warps))


def loss_forward(
    lp: torch.Tensor | None, entropy: torch.Tensor | None, call: _Call, from_stats: FromStats | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, LossSaved]:
    """Forward steps 1–5 of the module docstring on flat ``[N]`` log-probs (and entropy), or with ``from_stats``
    on the log-prob op's statistics (``lp`` and ``entropy`` None): (loss, metric pairs, extremes, what backward
    needs). Shared by :class:`FusedGRPOLossFunction` and the loss from logits (:mod:`mp_grpo.ops.logits_grpo_loss`)."""
    plan, seqs, step = call.plan, call.sequences, call.step
    if from_stats is None:
        device, n = lp.device, lp.numel()
        compute = torch.promote_types(lp.dtype, torch.float32)
    else:
        device, n = from_stats.target.device, from_stats.target.numel()
        compute = torch.float32  # the log-prob op's outputs
    s = seqs.num_sequences
    packed = seqs.cu_seqlens is not None
    adv = _flat(call.advantages)
    mask = _flat(call.loss_mask)
    cu = seqs.cu_seqlens if packed else mask  # an unused pointer for padded rows
    row_length = max(seqs.row_length, 1)
    search_steps = s.bit_length() if packed else 0
    blocks = _launch_config()
    tl_compute = _TRITON_DTYPES[compute]
    placeholder = adv  # pointer of an absent optional input (never read: its flag is off)
    lp = placeholder if lp is None else lp
    old = placeholder if call.old is None else _flat(call.old)
    rollout = placeholder if call.rollout is None else _flat(call.rollout)
    ref = placeholder if call.ref is None else _flat(call.ref)
    ent = placeholder if entropy is None else entropy
    div = placeholder if call.divergence is None else _flat(call.divergence)
    if from_stats is None:
        stats = target = errors = placeholder
        stats_sizes = (1, 1, -100, 0, 0, 1.0)
    else:
        stats, target, errors = from_stats.stats, from_stats.target, from_stats.errors
        stats_sizes = (stats.shape[0], from_stats.v_global, from_stats.ignore_index, stats.stride(0), stats.stride(1),
                       from_stats.inv_temperature)

    # --- 1. workspace: one float64 buffer (zeroed when there are per-sequence sums), one compute-dtype one ---
    programs = max(ceil_div(n, blocks.combine_block), ceil_div(s, blocks.combine_block), 1)
    sums_size = s * plan.num_cols
    pairs_flat, extremes, partials_flat, seq_sums, seq_grad = _workspace(
        (_NUM_PAIRS * 2, _NUM_EXTREMES, programs * _PARTIAL_COLS, sums_size, s if plan.seq_grad else 0),
        torch.float64, device, zeroed=plan.num_cols > 0)
    pairs = pairs_flat[:_NUM_PAIRS * 2].view(_NUM_PAIRS, 2)  # slices are rounded up to 16 bytes
    partials = partials_flat[:programs * _PARTIAL_COLS].view(programs, _PARTIAL_COLS)
    row_values = 5 * n if from_stats is not None else 0  # (M, log S, H, 1 - p_t, log p_t + H) for the log-prob backward
    grad_lp, grad_ent, seq_factor, rows = _workspace(
        (n, n if plan.entropy_grad else 0, n if plan.seq_grad else 0, row_values), compute, device, zeroed=False)
    grad_ent = grad_ent if plan.entropy_grad else None
    seq_factor = seq_factor if plan.seq_grad else None
    if not plan.num_cols:
        seq_sums = seq_grad = call.params  # unused pointers without per-sequence sums
    elif not plan.seq_grad:
        seq_grad = call.params
    if plan.num_cols:
        # --- 2. per-sequence sums ---
        meta = _token_meta(plan, tl_compute, from_stats is not None)
        launch_meta(grpo_loss_token_kernel, (max(ceil_div(n, blocks.token_block), 1),), meta,
            lp, old, rollout, ref, ent, adv, mask, stats, target, cu, call.params, seq_sums,
            n, row_length, s, search_steps, *stats_sizes,
        )
        # --- 3. whole sequences under context parallelism ---
        if group_size(seqs.cp_group) > 1:
            seq_sums = all_reduce_sum(seq_sums, seqs.cp_group)

    # --- 4. per-token shares, gradients, metric partials ---
    unused = call.params
    meta = _combine_meta(plan, tl_compute, from_stats is not None, seqs.owns_sequences)
    launch_meta(grpo_loss_combine_kernel, (programs,), meta,
        lp, old, rollout, ref, ent, adv, mask, div,
        stats, target, placeholder if from_stats is None else rows, errors,
        cu, seq_sums, seq_grad,
        step.valid_tokens, step.sequences, unused if step.weight_mean is None else step.weight_mean,
        unused if step.entropy_threshold is None else step.entropy_threshold,
        unused if step.skip is None else step.skip,
        unused if step.m2po_threshold is None else step.m2po_threshold, call.params,
        grad_lp, grad_lp if grad_ent is None else grad_ent, grad_lp if seq_factor is None else seq_factor, partials,
        n, row_length, s, search_steps, *stats_sizes,
    )

    # --- 5. loss and metric entries ---
    loss = torch.empty((), dtype=compute, device=device)
    # gspo / gmpo without context parallelism: the sequence-mean path folded into grad_lp here (finalize step 4)
    fold = plan.seq_grad and group_size(seqs.cp_group) <= 1
    fold_programs = ceil_div(n, blocks.backward_block) if fold else 0
    kinds = nonfinite_input_kinds()
    nonfinite_errors, deferred = kernel_counters(kinds, device, call.check_inputs)
    launch_meta(grpo_loss_finalize_kernel, (1 + fold_programs,),
        _finalize_meta(plan, fold, packed),
        partials, step.micro_batches, unused if step.skip is None else step.skip, loss, pairs, extremes,
        nonfinite_errors, grad_lp, seq_grad, grad_lp if seq_factor is None else seq_factor, cu,
        programs, n, row_length, s, search_steps,
    )
    if not deferred and call.check_inputs is not CheckInputs.OFF:  # on the CPU or with SYNC: read at once
        raise_on_kernel_errors(nonfinite_errors, kinds, call.check_inputs)
    saved = LossSaved(grad_lp, grad_ent, seq_grad if plan.seq_grad and not fold else None, seq_factor, cu,
                      (n, row_length, s, search_steps, packed), seqs.cp_group, tl_compute,
                      rows[:row_values].view(5, n) if from_stats is not None else None)
    return loss, pairs, extremes, saved


def loss_backward(
    saved: LossSaved, grad_loss: torch.Tensor, lp_dtype: torch.dtype, ent_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Backward steps 1–2 of the module docstring: flat ``[N]`` gradients w.r.t. the log-probs and (with
    ``ent_dtype``, when the entropy bonus gives it one) the entropy, in those dtypes."""
    n, row_length, s, search_steps, packed = saved.sizes
    device = saved.grad_lp.device
    grad_loss = grad_loss.reshape(())
    entropy_grad = saved.grad_ent is not None and ent_dtype is not None
    seq_grad = saved.seq_grad
    # --- 1. whole sequences under context parallelism: Σ over CP ranks of g_r · ∂share_r/∂m_s ---
    seq_grad_scaled = False
    if seq_grad is not None and group_size(saved.cp_group) > 1:
        seq_grad = all_reduce_sum(seq_grad * grad_loss.to(torch.float64), saved.cp_group)
        seq_grad_scaled = True
    # --- 2. g × the forward's per-token gradients ---
    grad_lp = torch.empty(n, dtype=lp_dtype, device=device)
    grad_ent = torch.empty(n, dtype=ent_dtype, device=device) if entropy_grad else None
    blocks = _launch_config()
    fwd_lp = saved.grad_lp
    if n:
        launch(grpo_loss_backward_kernel, (ceil_div(n, blocks.backward_block),),
            grad_loss, fwd_lp, fwd_lp if saved.grad_ent is None else saved.grad_ent,
            fwd_lp if seq_grad is None else seq_grad, fwd_lp if saved.seq_factor is None else saved.seq_factor,
            saved.cu, grad_lp, grad_lp if grad_ent is None else grad_ent,
            n, row_length, s, search_steps,
            PACKED=packed, ENTROPY_GRAD=entropy_grad, ENTROPY_16BIT=entropy_grad and ent_dtype.itemsize == 2,
            SEQ_GRAD=seq_grad is not None, SEQ_GRAD_SCALED=seq_grad_scaled,
            COMPUTE=saved.compute, BLOCK=blocks.backward_block, num_warps=blocks.backward_warps,
        )
    return grad_lp, grad_ent


class FusedGRPOLossFunction(torch.autograd.Function):
    """Differentiable w.r.t. ``logprobs`` and ``entropy``; see the module docstring for the schedule."""

    @staticmethod
    def forward(ctx, logprobs: torch.Tensor, entropy: torch.Tensor | None, call: _Call):
        ctx.set_materialize_grads(False)  # the metric outputs get no gradient: no zeros made for them
        # --- 1.–5. ---
        loss, pairs, extremes, saved = loss_forward(_flat(logprobs), None if entropy is None else _flat(entropy), call)
        ctx.mark_non_differentiable(pairs, extremes)
        ctx.saved = saved  # the forward's own buffers (not inputs or outputs): kept on ctx, as autograd allows
        ctx.shapes = (logprobs.shape, logprobs.dtype, None if entropy is None else (entropy.shape, entropy.dtype))
        return loss, pairs, extremes

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor, _grad_pairs, _grad_extremes):
        if grad_loss is None:
            return None, None, None
        (lp_shape, lp_dtype), ent_meta = ctx.shapes[:2], ctx.shapes[2]
        ent_dtype = ent_meta[1] if ent_meta is not None and ctx.needs_input_grad[1] else None
        # --- 1.–2. ---
        grad_lp, grad_ent = loss_backward(ctx.saved, grad_loss, lp_dtype, ent_dtype)
        return grad_lp.view(lp_shape), None if grad_ent is None else grad_ent.view(ent_meta[0]), None
