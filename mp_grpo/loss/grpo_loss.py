"""GRPOLoss: the GRPO-family loss of one micro-batch, as its share of the whole step's objective.

Schedule of :meth:`GRPOLoss.__call__`
    1. Check the inputs (shapes, dtypes, what the config needs); host-side only.
    2. The step's :class:`~mp_grpo.GlobalBatch`: the one given (checked against this micro-batch and the
       config), or — with ``batch=None`` — one built from this call alone (with its CP peers).
       With ``nll.positive_coef`` and ``batch=None``, the positive examples' token count likewise.
    3. Token stage: masked positions are replaced by 0 *before* any arithmetic (``torch.where``, so inf /
       NaN there never reach a value or a gradient); the clamped log-ratio ℓ = log π_θ − log π_old, the
       rollout-correction log-ratio d, the OPSM divergence, the trust region's divergence, M2PO's float64 d; the
       columns to sum per sequence. clip_cov / kl_cov: then their covariance selection over this call's valid tokens
       (:mod:`.covariance`; eager). A top-K trust region's divergence is taken before, for both backends
       (:func:`mp_grpo.loss.trust_region.topk_divergence`: torch, float64, from the ``topk_logprobs`` CSR input).
    4. Per-sequence sums of those columns over whole sequences (one all-reduce over the CP group under
       context parallelism, differentiable with a sum backward), broadcast back to the tokens.
    5. Combine stage: the objective's term; × the IS weight; zeroed where rejected (rollout correction,
       OPSM, top-entropy, the divergence trust region, M2PO against the GlobalBatch's threshold); + coef·KL and
       − bonus·entropy on every valid token (the bonus only on the selected ones with ``bonus_on_selected``);
       each divided by its aggregation's global divisor (``mode`` for the term, ``regularizer`` for KL / entropy);
       + the VAPO NLL on positive examples over their step count; zero when the step is skipped; summed → this
       micro-batch's share.
    6. Metrics (no gradient): ``[sum, count]`` means and min / max entries (see :mod:`.metrics`).

No host synchronization happens in steps 3–6 (the covariance selection included); with ``batch=None`` step 2
makes collectives (and one host read when the top-entropy quantile or M2PO's threshold is needed). ``compile=True`` compiles the
token and combine stages with ``torch.compile`` (the per-sequence sums, the covariance selection and the
collectives stay eager).

Backends (:class:`LossBackend`): steps 3–6 in plain torch (``TORCH``, the readable specification:
:mod:`.torch_path`), or as the fused Triton kernels of :mod:`mp_grpo.ops.grpo_loss` (``TRITON``: the same
results in 3–5 launches per call, forward and backward); ``AUTO`` (the default) takes ``TRITON`` for
CUDA tensors in padded or packed layouts and ``TORCH`` otherwise. Steps 1–2 are shared (step 1's checks:
:mod:`.input_checks`). The kernels do not
implement every option (:func:`fused_unsupported` names what they lack): such a config always takes the
torch path under ``AUTO`` and is refused under ``TRITON`` when the GRPOLoss is built.

Convention: summed over all micro-batches of all ranks of the data-parallel group (DP×CP), the returned
shares give the step objective and their gradients its gradient. Zero valid tokens in the whole step give
exactly 0 with a zero gradient.
"""

from __future__ import annotations

import weakref
from enum import Enum

import torch

from mp_grpo.collectives import group_size
from mp_grpo.config.loss import GSPOGradient, LossConfig, M2POScope, Objective, RatioLevel
from mp_grpo.loss import torch_path
from mp_grpo.loss.covariance import COVARIANCE_OBJECTIVES, covariance_selection
from mp_grpo.loss.global_batch import GlobalBatch
from mp_grpo.loss.input_checks import check_batch, check_float, check_is_weights, check_loss_call, checked_layout
from mp_grpo.loss.sequence import PackedSequences, PaddedSequences, SequenceLayout
from mp_grpo.loss.torch_path import StepValues, record_nonfinite, record_nonfinite_is_weights
from mp_grpo.loss.trust_region import TopKLogprobs, topk_divergence
from mp_grpo.ops.grpo_loss import FusedGRPOLoss, SequenceInfo, StepTensors
from mp_grpo.ops.checks import (
    CheckInputs,
    check_inputs_mode,
    check_logits_and_target,
    check_runs_here,
    check_temperature,
)
from mp_grpo.ops.logits_grpo_loss import LogitsSpec, logits_grpo_loss
from mp_grpo.ops.captured_support import check_replay
from mp_grpo.ops.sampling_filter import SamplingFilter
from mp_grpo.ops.token_ids import CapturedSupport
from mp_grpo.ops.vocab_parallel_logprobs import vocab_parallel_logprobs_unchecked


class LossBackend(str, Enum):
    """How :class:`GRPOLoss` computes steps 3–6 (``GRPOLoss(config, backend=...)``)."""

    AUTO = "auto"
    """TRITON for CUDA tensors in a padded or packed layout, TORCH otherwise (CPU tensors, other layouts)."""
    TORCH = "torch"
    """The plain torch stages of this module (with ``compile=True``: through ``torch.compile``)."""
    TRITON = "triton"
    """The fused kernels of :mod:`mp_grpo.ops.grpo_loss`: 3–5 launches per call; CUDA tensors (CPU tensors
    only under ``TRITON_INTERPRET=1``), :class:`PaddedSequences` or :class:`PackedSequences`; configs for
    which :func:`fused_unsupported` is None."""


def fused_unsupported(config: LossConfig) -> str | None:
    """What of ``config`` the fused kernels do not implement (None: they implement all of it).

    Those options exist in the torch path only; ``AUTO`` routes them there and ``TRITON`` refuses them.
    """
    p, kl, ent, agg = config.policy, config.kl, config.entropy, config.aggregation
    missing = []
    if p.objective in (Objective.VESPO, *COVARIANCE_OBJECTIVES):
        missing.append(f"policy.objective={p.objective.value}")
    if p.gspo_gradient != GSPOGradient.SEQUENCE:
        missing.append(f"policy.gspo_gradient={p.gspo_gradient.value}")
    if agg.regularizer_mode is not None and agg.regularizer_mode != agg.mode:
        missing.append(f"aggregation.regularizer_mode={agg.regularizer_mode.value}")
    if kl.bias_correction and kl.bias_correction_level != RatioLevel.TOKEN:
        missing.append(f"kl.bias_correction_level={kl.bias_correction_level.value}")
    if ent.bonus_on_selected:
        missing.append("entropy.bonus_on_selected=true")
    if ent.adaptive:
        missing.append("entropy.adaptive=true")
    if config.nll.positive_coef != 0.0:
        missing.append(f"nll.positive_coef={config.nll.positive_coef}")
    return ", ".join(missing) if missing else None


class GRPOLoss:
    """``loss, metrics = GRPOLoss(config)(logprobs, old_logprobs, advantages, loss_mask, ...)`` per micro-batch."""

    def __init__(self, config: LossConfig, *, backend: LossBackend = LossBackend.AUTO, compile: bool = False) -> None:
        """``config``: a validated :class:`LossConfig` (see :func:`mp_grpo.load_config`).

        ``backend``: see :class:`LossBackend`; ``AUTO`` picks per call from the tensors' device and layout.

        ``compile``: run the torch path's element-wise stages through ``torch.compile`` (fewer kernels; the
        first calls compile, a second shape recompiles once with dynamic shapes). Dynamo caches the stages of
        every GRPOLoss together, up to ``torch._dynamo.config.recompile_limit`` entries: meant for one config
        per process (beyond the limit, calls run eagerly). Only with backend ``TORCH`` (``AUTO`` then means
        ``TORCH``).
        """
        if not isinstance(config, LossConfig):
            raise TypeError(f"config must be a LossConfig (see mp_grpo.load_config), got {type(config).__name__}")
        if not isinstance(backend, LossBackend):
            allowed = ", ".join(b.name for b in LossBackend)
            raise TypeError(f"backend must be a LossBackend ({allowed}), got {backend!r}")
        if compile and backend == LossBackend.TRITON:
            raise ValueError("compile=True compiles the torch path; it cannot be used with backend=LossBackend.TRITON")
        unsupported = fused_unsupported(config)
        if backend == LossBackend.TRITON and unsupported is not None:
            raise ValueError(f"config: backend TRITON does not implement {unsupported}; use LossBackend.AUTO or "
                             "LossBackend.TORCH (the torch path implements every option)")
        self.config = config
        self.backend = LossBackend.TORCH if compile or unsupported is not None else backend
        self._fused = FusedGRPOLoss(config) if self.backend != LossBackend.TORCH else None
        self._last_step: tuple | None = None  # see _step_tensors_of
        # Two closures with their own code objects, so that torch.compile caches (and guards) them apart.
        def token_stage(*args):
            return torch_path.token_stage(config, *args)

        def combine_stage(*args):
            return torch_path.combine_stage(config, *args)

        self._token_stage = torch.compile(token_stage) if compile else token_stage
        self._combine_stage = torch.compile(combine_stage) if compile else combine_stage

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor | None,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        *,
        rollout_logprobs: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        batch: GlobalBatch | None = None,
        layout: SequenceLayout | None = None,
        kl_logprobs: torch.Tensor | None = None,
        entropy_coef: float | torch.Tensor | None = None,
        positive: torch.Tensor | None = None,
        positive_tokens: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        is_weights: torch.Tensor | None = None,
        topk_logprobs: TopKLogprobs | None = None,
        check_inputs: CheckInputs | bool = CheckInputs.DEFERRED,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the step objective (0-dim, differentiable) and its metrics.

        Args:
            logprobs: log π_θ of the sampled tokens, token-shaped (``[B, T]``; ``[T]`` / ``[1, T]`` packed).
            old_logprobs: log π_old (detached); None = on-policy (``logprobs.detach()``); must be None with
                ``rollout_correction.bypass`` (the rollout log-probs are the old ones then).
            advantages: per sequence ``[S]`` or per token (token-shaped). Flat packed tokens ``[T]`` with as many
                tokens as sequences make the two shapes one, and the call is refused: give such tokens as ``[1, T]``.
            loss_mask: nonzero where the token is trained on (completion tokens, tool outputs excluded).
            rollout_logprobs: the inference engine's log-probs (rollout correction, mismatch, OPSM).
            ref_logprobs: the reference policy's log-probs (KL).
            entropy: per-token entropy of π_θ, differentiable (entropy bonus, top-entropy selection).
            batch: the step's GlobalBatch; None: this call (with its CP peers) is the whole step.
            layout: how tokens form sequences (None: padded rows, no context parallelism).
            kl_logprobs: log π_θ the KL penalty is taken of, when it differs from ``logprobs`` — the unfiltered
                log-probs under top-k / top-p filtering (NeMo-RL ``curr_logprobs_unfiltered``); differentiable.
                None: ``logprobs``. The KL's ``score_function`` weight uses them too; the policy term never.
            entropy_coef: the step's entropy-bonus coefficient with ``entropy.adaptive`` (required then, and
                only allowed then): :attr:`AdaptiveEntropyCoefficient.applied`.
            positive: with ``nll.positive_coef``: nonzero for positive examples (NeMo-RL: reward > 0), per
                sequence ``[S]`` or per token.
            positive_tokens: with ``nll.positive_coef`` and a ``batch``: the step's count of valid tokens of
                positive examples, ``GlobalBatch.from_masks([mask · positive per token, ...], group=...)
                .valid_tokens``; with ``batch=None`` it is counted from this call (and its CP peers).
            generator: with ``policy.objective=clip_cov`` (only then): the generator of its random selection,
                on the tokens' device; the same generator state gives the same selection (pass one seeded per
                step and micro-batch for reproducible runs). None: the device's default generator, as verl.
            is_weights: a per-token importance weight computed by the caller (verl's ``rollout_is_weights``:
                its own rollout correction, truncated and normalized as it is configured), token-shaped; it
                multiplies the policy term where the computed rollout-correction weight would (step 5b), with
                no gradient. It takes the place of that weight: not with ``rollout_correction.weight_level``,
                nor with vespo (whose φ holds the IS weight inside). The rollout rejection, OPSM and the other
                selections still apply; the KL and entropy terms are not weighted. Torch path only (``AUTO``
                takes it; ``TRITON`` refuses).
            topk_logprobs: with ``trust_region.mode`` topk_tv / topk_kl (only then): the engine's top-K log-probs of
                every token position and the trainer's at the same ids, in CSR form over the flattened token
                positions (:class:`mp_grpo.loss.TopKLogprobs`); the trainer's values are read detached.
            check_inputs: how a NaN / ±inf input at a trained position is reported (the position is dropped from
                the loss and counted in the metric ``nonfinite_inputs`` whatever this is): ``DEFERRED`` (the
                default; ``True``) records it for ``mp_grpo.check_errors()`` (raised at once on the CPU), ``SYNC``
                raises at the call, ``OFF`` (``False``) records nothing.
        """
        # --- 1. check the inputs ---
        layout = checked_layout(layout)
        check_float("logprobs", logprobs)
        positive_mask = check_loss_call(
            self.config, layout, logprobs.shape, logprobs.device, "logprobs", old_logprobs, advantages, loss_mask,
            rollout_logprobs, ref_logprobs, entropy, kl_logprobs=kl_logprobs, entropy_coef=entropy_coef,
            generator=generator, positive=positive, positive_tokens=positive_tokens, topk_logprobs=topk_logprobs,
        )
        if is_weights is not None:
            check_is_weights(self.config, is_weights, logprobs.shape, logprobs.device)
        if batch is not None:
            check_batch(self.config, batch, loss_mask)
        return self.share_unchecked(
            logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs=rollout_logprobs, ref_logprobs=ref_logprobs,
            entropy=entropy, batch=batch, layout=layout, kl_logprobs=kl_logprobs, entropy_coef=entropy_coef,
            positive_mask=positive_mask, positive_tokens=positive_tokens, generator=generator, is_weights=is_weights,
            topk_logprobs=topk_logprobs, check_inputs=check_inputs_mode(check_inputs),
        )

    def share_unchecked(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor | None,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        *,
        layout: SequenceLayout,
        rollout_logprobs: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        batch: GlobalBatch | None = None,
        kl_logprobs: torch.Tensor | None = None,
        entropy_coef: float | torch.Tensor | None = None,
        positive_mask: torch.Tensor | None = None,
        positive_tokens: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        is_weights: torch.Tensor | None = None,
        topk_logprobs: TopKLogprobs | None = None,
        check_inputs: CheckInputs = CheckInputs.DEFERRED,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Steps 2–6 of :meth:`__call__`, for inputs its step 1 checked already — by the public entry point the
        micro-batch entered (:meth:`__call__`, :meth:`on_logits`, ``MegatronGRPO.loss_func``: ``check_loss_call``
        and, with a ``batch``, ``check_batch`` of :mod:`mp_grpo.loss.input_checks`). Internal: call
        ``GRPOLoss(...)`` itself. ``positive_mask``: what ``check_loss_call`` returned;
        ``check_inputs``: a :class:`CheckInputs` (``check_inputs_mode`` of the caller's value)."""
        cfg = self.config
        token_shape = logprobs.shape
        fused = self._use_fused(logprobs, layout)
        if kl_logprobs is not None and fused:
            if self.backend == LossBackend.TRITON:
                raise ValueError("kl_logprobs: backend TRITON does not implement a separate KL input; use "
                                 "LossBackend.AUTO or LossBackend.TORCH")
            fused = False  # AUTO: the torch path
        if is_weights is not None and fused:
            if self.backend == LossBackend.TRITON:
                raise ValueError("is_weights: backend TRITON does not implement a precomputed IS weight; use "
                                 "LossBackend.AUTO or LossBackend.TORCH")
            fused = False  # AUTO: the torch path
        # --- 2. the step's account ---
        if positive_mask is not None and positive_tokens is None:
            if batch is not None:
                raise ValueError("positive_tokens must be given with a batch: the step's count of valid tokens of "
                                 "positive examples, GlobalBatch.from_masks([...], group=...).valid_tokens")
            positive_tokens = GlobalBatch.from_masks(
                [torch.where(positive_mask, loss_mask, torch.zeros_like(loss_mask))], group=layout.cp_group,
                layouts=[layout]).valid_tokens
        if batch is None:
            old_for_batch = logprobs.detach() if old_logprobs is None else old_logprobs
            signs = cfg.m2po.bound is not None and cfg.m2po.scope != M2POScope.ALL
            batch = GlobalBatch.from_rollouts(
                cfg, [loss_mask], old_logprobs=[old_for_batch],
                rollout_logprobs=None if rollout_logprobs is None else [rollout_logprobs],
                entropies=None if entropy is None else [entropy], group=layout.cp_group, layouts=[layout],
                advantages=[advantages] if signs else None,
            )
        # the top-K trust region's divergence per token (torch, float64; both backends read it)
        divergence = None if topk_logprobs is None else topk_divergence(
            cfg.trust_region.mode, topk_logprobs, layout.valid_tokens(loss_mask), check_inputs)
        if fused:  # steps 3–6 in the fused kernels
            return self._fused(  # type: ignore[misc]
                logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs, ref_logprobs, entropy,
                self._step_tensors_of(batch, logprobs.device), _sequence_info(layout, token_shape, logprobs.device),
                check_inputs, divergence,
            )
        valid = layout.valid_tokens(loss_mask)
        if advantages.shape != token_shape:
            advantages = layout.broadcast(advantages, token_shape)
        # --- 3. token stage ---
        tokens = self._token_stage(
            logprobs, old_logprobs, advantages, valid, rollout_logprobs, ref_logprobs, entropy, kl_logprobs,
            positive_mask, is_weights, divergence,
        )
        if cfg.policy.objective in COVARIANCE_OBJECTIVES:  # per call = per micro-batch (verl), see .covariance
            tokens = tokens._replace(cov_selected=covariance_selection(
                cfg.policy, tokens.logprobs, tokens.log_ratio, tokens.advantages, tokens.valid, generator))
        # --- 4. per-sequence sums over whole sequences (summed in float64, as the fused kernels sum them: a float32
        #        sum of a long sequence's log-ratios would carry its length times their rounding into exp of it, and
        #        its order would depend on the batch's width), rounded to the compute dtype once, broadcast back ---
        columns = tokens.seq_columns
        seq_sums = layout.seq_sum(columns.to(torch.float64), token_shape).to(columns.dtype)
        seq_tokens = layout.broadcast(seq_sums, token_shape)
        # --- 5. + 6. combine stage and metrics ---
        step = StepValues(
            tokens=batch.valid_tokens, sequences=batch.sequences(cfg.aggregation.count_empty_sequences),
            micro_batches=batch.num_micro_batches, weight_mean=batch.weight_mean,
            entropy_threshold=batch.entropy_threshold, skip=batch.skip,
            entropy_coef=cfg.entropy.bonus_coef if entropy_coef is None else entropy_coef,
            positive_tokens=positive_tokens, m2po_threshold=batch.m2po_threshold,
        )
        share, metrics = self._combine_stage(tokens, seq_sums, seq_tokens, step, layout.owns_sequences)
        record_nonfinite(tokens.nonfinite, batch.skip, check_inputs)  # type: ignore[arg-type]
        if tokens.nonfinite_is_weights is not None:
            record_nonfinite_is_weights(tokens.nonfinite_is_weights, batch.skip, check_inputs)
        return share, metrics

    def on_logits(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        old_logprobs: torch.Tensor | None,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        *,
        tp_group=None,
        temperature: float = 1.0,
        with_entropy: bool = False,
        ignore_index: int = -100,
        inplace_backward: bool = False,
        check_inputs: CheckInputs | bool = CheckInputs.DEFERRED,
        sampling_filter: SamplingFilter | None = None,
        captured_support: CapturedSupport | None = None,
        rollout_logprobs: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        batch: GlobalBatch | None = None,
        layout: SequenceLayout | None = None,
        entropy_coef: float | torch.Tensor | None = None,
        positive: torch.Tensor | None = None,
        positive_tokens: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        topk_logprobs: TopKLogprobs | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share and metrics from a vocabulary shard of logits: what
        ``self(vocab_parallel_logprobs(logits, target, ...), ...)`` returns — with the entropy computed when the
        config reads it or ``with_entropy`` asks for it (then the metrics report it) —, its gradient w.r.t.
        ``logits``.

        ``logits``, ``target``, ``tp_group``, ``temperature``, ``ignore_index``, ``inplace_backward``,
        ``check_inputs``, ``sampling_filter`` and ``captured_support`` are those of
        :func:`mp_grpo.vocab_parallel_logprobs` (token
        shape = ``target.shape``; ``check_inputs`` also as in :meth:`__call__`); the other arguments those of
        :meth:`__call__`.

        The fused path (:mod:`mp_grpo.ops.logits_grpo_loss`: one autograd Function, the loss's backward inside
        the log-prob backward kernel) runs when the call would take the fused loss (:class:`LossBackend`), a
        ``batch`` is given (a training step has one; without it the step's account is built from this call's
        log-probs first), with or without a ``sampling_filter`` or ``captured_support``; otherwise the two ops run one
        after the other. Both
        give the same values, gradients and metrics, bit for bit (``tests/ops/test_logits_grpo_loss.py``,
        ``tests/ops/test_logits_grpo_loss_filter.py``).
        """
        cfg = self.config
        layout = checked_layout(layout)
        check_logits_and_target(logits, target)
        check_runs_here(logits, "logits")
        check_mode = check_inputs_mode(check_inputs)
        check_replay(sampling_filter, captured_support, target.shape, logits.device, check_mode)
        if sampling_filter is not None:
            # Fields that keep everything (top_p = 1, top_k >= V, min_p = 0) cost nothing.
            sampling_filter = sampling_filter.without_noops(logits.shape[-1] * group_size(tp_group))
        spec = LogitsSpec(tp_group, check_temperature(temperature), int(ignore_index), bool(inplace_backward),
                          check_mode, sampling_filter, captured_support)
        positive_mask = check_loss_call(
            cfg, layout, target.shape, logits.device, "target", old_logprobs, advantages, loss_mask, rollout_logprobs,
            ref_logprobs, None, entropy_computed=True, entropy_coef=entropy_coef, generator=generator,
            positive=positive, positive_tokens=positive_tokens, topk_logprobs=topk_logprobs,
        )
        if batch is not None:
            check_batch(cfg, batch, loss_mask)
        return self.on_logits_unchecked(
            logits, target, old_logprobs, advantages, loss_mask, spec=spec,
            with_entropy=bool(with_entropy) or cfg.needs_entropy,
            rollout_logprobs=rollout_logprobs, ref_logprobs=ref_logprobs, batch=batch, layout=layout,
            entropy_coef=entropy_coef, positive_mask=positive_mask, positive_tokens=positive_tokens, generator=generator,
            topk_logprobs=topk_logprobs,
        )

    def on_logits_unchecked(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        old_logprobs: torch.Tensor | None,
        advantages: torch.Tensor,
        loss_mask: torch.Tensor,
        *,
        spec: LogitsSpec,
        with_entropy: bool,
        layout: SequenceLayout,
        rollout_logprobs: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        batch: GlobalBatch | None = None,
        entropy_coef: float | torch.Tensor | None = None,
        positive_mask: torch.Tensor | None = None,
        positive_tokens: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        topk_logprobs: TopKLogprobs | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:meth:`on_logits` for arguments checked already by the public entry point the micro-batch entered
        (:meth:`on_logits`, ``MegatronGRPO.loss_func``): ``logits`` and ``target`` (and that the kernels run on
        their device), ``spec`` built from checked values (its ``sampling_filter`` checked for ``target``), the loss
        inputs by ``check_loss_call`` (``positive_mask``: what it returned) and ``batch`` by ``check_batch``.
        ``with_entropy`` already includes the config's need. Internal: call :meth:`on_logits` itself."""
        if batch is None or not self._use_fused(logits, layout):
            out = vocab_parallel_logprobs_unchecked(
                logits, target, tp_group=spec.tp_group, inv_temperature=spec.inv_temperature,
                with_entropy=with_entropy, ignore_index=spec.ignore_index, inplace_backward=spec.inplace_backward,
                check_inputs=spec.check_inputs, sampling_filter=spec.sampling_filter,
                captured_support=spec.captured_support,
            )
            logprobs, entropy = out if with_entropy else (out, None)
            return self.share_unchecked(
                logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs=rollout_logprobs,
                ref_logprobs=ref_logprobs, entropy=entropy, batch=batch, layout=layout, entropy_coef=entropy_coef,
                positive_mask=positive_mask, positive_tokens=positive_tokens, generator=generator,
                topk_logprobs=topk_logprobs, check_inputs=spec.check_inputs,
            )
        # --- the fused path: one autograd Function (the fused kernels implement no option that reads
        #     entropy_coef, positive or generator: check_loss_call refused them for this config) ---
        shape, device = target.shape, logits.device
        divergence = None if topk_logprobs is None else topk_divergence(
            self.config.trust_region.mode, topk_logprobs, layout.valid_tokens(loss_mask), spec.check_inputs)
        call = self._fused.prepare(  # type: ignore[union-attr]
            device, old_logprobs, advantages, loss_mask, rollout_logprobs, ref_logprobs, with_entropy,
            advantages.shape == shape, self._step_tensors_of(batch, device), _sequence_info(layout, shape, device),
            spec.check_inputs, divergence,
        )
        return logits_grpo_loss(self._fused, logits, target, spec, call)  # type: ignore[arg-type]

    def _step_tensors_of(self, batch: GlobalBatch, device: torch.device) -> StepTensors:
        """:func:`_step_tensors` of ``batch``, kept for the step's next micro-batches (a GlobalBatch is frozen: the
        tensors it holds are the ones the kernels read; one entry, the last batch, held by a weak reference)."""
        cached = self._last_step
        if cached is not None and cached[0]() is batch and cached[1] == device:
            return cached[2]
        step = _step_tensors(self.config, batch, device)
        self._last_step = (weakref.ref(batch), device, step)
        return step

    def _use_fused(self, logprobs: torch.Tensor, layout: SequenceLayout) -> bool:
        """Whether this call runs the fused kernels (see :class:`LossBackend`); raises when TRITON cannot (the
        fused path itself rejects CPU tensors outside the Triton interpreter)."""
        if self.backend == LossBackend.TORCH:
            return False
        supported_layout = isinstance(layout, (PaddedSequences, PackedSequences))
        if self.backend == LossBackend.AUTO:
            return logprobs.is_cuda and supported_layout
        if not supported_layout:
            raise ValueError(f"layout: backend TRITON supports PaddedSequences and PackedSequences, got {layout!r}")
        return True


def _step_tensors(cfg: LossConfig, batch: GlobalBatch, device: torch.device) -> StepTensors:
    """The GlobalBatch's device tensors the fused kernels read (checked to be on the tokens' device)."""
    step = StepTensors(
        valid_tokens=batch.valid_tokens, sequences=batch.sequences(cfg.aggregation.count_empty_sequences),
        micro_batches=batch.num_micro_batches, weight_mean=batch.weight_mean,
        entropy_threshold=batch.entropy_threshold, skip=batch.skip, m2po_threshold=batch.m2po_threshold,
    )
    for name, value in zip(StepTensors._fields, step):
        if value is not None and value.device != device:
            raise ValueError(f"batch.{name} is on {value.device} but logprobs is on {device}: build the GlobalBatch "
                             "from masks on the tokens' device")
    return step


def _sequence_info(layout: SequenceLayout, token_shape: torch.Size, device: torch.device) -> SequenceInfo:
    """The layout in the fused kernels' terms (padded rows or packed segments)."""
    packed = isinstance(layout, PackedSequences)
    return SequenceInfo(
        cu_seqlens=layout.cu_seqlens_on(device) if packed else None,  # type: ignore[attr-defined]
        num_sequences=layout.num_sequences(token_shape), row_length=1 if packed else int(token_shape[1]),
        cp_group=layout.cp_group, owns_sequences=layout.owns_sequences,
    )
