"""GRPOLoss: the GRPO-family loss of one micro-batch, as its share of the whole step's objective.

Schedule of :meth:`GRPOLoss.__call__`
    1. Check the inputs (shapes, dtypes, what the config needs); host-side only.
    2. The step's :class:`~mp_grpo.GlobalBatch`: the one given (checked against this micro-batch and the
       config), or — with ``batch=None`` — one built from this call alone (with its CP peers).
       With ``nll.positive_coef`` and ``batch=None``, the positive examples' token count likewise.
    3. Token stage: masked positions are replaced by 0 *before* any arithmetic (``torch.where``, so inf /
       NaN there never reach a value or a gradient); the clamped log-ratio ℓ = log π_θ − log π_old, the
       rollout-correction log-ratio d, the OPSM divergence; the columns to sum per sequence. clip_cov /
       kl_cov: then their covariance selection over this call's valid tokens (:mod:`.covariance`; eager).
    4. Per-sequence sums of those columns over whole sequences (one all-reduce over the CP group under
       context parallelism, differentiable with a sum backward), broadcast back to the tokens.
    5. Combine stage: the objective's term; × the IS weight; zeroed where rejected (rollout correction,
       OPSM, top-entropy); + coef·KL and − bonus·entropy on every valid token (the bonus only on the selected
       ones with ``bonus_on_selected``); each divided by its aggregation's global divisor (``mode`` for the
       term, ``regularizer`` for KL / entropy); + the VAPO NLL on positive examples over their step count;
       zero when the step is skipped; summed → this micro-batch's share.
    6. Metrics (no gradient): ``[sum, count]`` means and min / max entries (see :mod:`.metrics`).

No host synchronization happens in steps 3–6 (the covariance selection included); with ``batch=None`` step 2
makes collectives (and one host read when the top-entropy quantile is needed). ``compile=True`` compiles the
token and combine stages with ``torch.compile`` (the per-sequence sums, the covariance selection and the
collectives stay eager).

Backends (:class:`LossBackend`): steps 3–6 as written here in plain torch (``TORCH``, the readable
specification), or as the fused Triton kernels of :mod:`mp_grpo.ops.grpo_loss` (``TRITON``: the same
results in 3–5 launches per call, forward and backward); ``AUTO`` (the default) takes ``TRITON`` for
CUDA tensors in padded or packed layouts and ``TORCH`` otherwise. Steps 1–2 are shared. The kernels do not
implement every option (:func:`fused_unsupported` names what they lack): such a config always takes the
torch path under ``AUTO`` and is refused under ``TRITON`` when the GRPOLoss is built.

Convention: summed over all micro-batches of all ranks of the data-parallel group (DP×CP), the returned
shares give the step objective and their gradients its gradient. Zero valid tokens in the whole step give
exactly 0 with a zero gradient.
"""

from __future__ import annotations

import weakref
from enum import Enum
from typing import NamedTuple

import torch

from mp_grpo.collectives import group_size
from mp_grpo.config.loss import GSPOGradient, LossConfig, Objective, RatioLevel
from mp_grpo.loss import metrics as M
from mp_grpo.loss.aggregation import token_divisor
from mp_grpo.loss.clamps import COUNT_FLOOR, symmetric_clamp
from mp_grpo.loss.covariance import COVARIANCE_OBJECTIVES, covariance_selection
from mp_grpo.loss.entropy import high_entropy
from mp_grpo.loss.global_batch import GlobalBatch
from mp_grpo.loss.kl import kl_penalty
from mp_grpo.loss.mismatch import chi2_sequence, chi2_token, k1, k3
from mp_grpo.loss.objectives import needs_sequence_sum, policy_term, sequence_input, sequence_value
from mp_grpo.loss.opsm import opsm_divergence, opsm_keep
from mp_grpo.loss.rollout_correction import kept, level_log_ratio, normalized_weight, token_log_ratio, weights
from mp_grpo.loss.sequence import PackedSequences, PaddedSequences, SequenceLayout
from mp_grpo.loss.vespo import vespo_token_input
from mp_grpo.ops.grpo_loss import FusedGRPOLoss, SequenceInfo, StepTensors
from mp_grpo.ops.checks import (
    CheckInputs,
    check_inputs_mode,
    check_logits_and_target,
    check_runs_here,
    check_temperature,
)
from mp_grpo.ops.logits_grpo_loss import LogitsSpec, logits_grpo_loss
from mp_grpo.ops.sampling_filter import SamplingFilter
from mp_grpo.ops.vocab_parallel_logprobs import vocab_parallel_logprobs


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
            return _token_stage(config, *args)

        def combine_stage(*args):
            return _combine_stage(config, *args)

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
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the step objective (0-dim, differentiable) and its metrics.

        Args:
            logprobs: log π_θ of the sampled tokens, token-shaped (``[B, T]``; ``[T]`` / ``[1, T]`` packed).
            old_logprobs: log π_old (detached); None = on-policy (``logprobs.detach()``); must be None with
                ``rollout_correction.bypass`` (the rollout log-probs are the old ones then).
            advantages: per sequence ``[S]`` or per token (token-shaped).
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
        """
        cfg = self.config
        # --- 1. check the inputs ---
        layout = PaddedSequences() if layout is None else layout
        if not isinstance(layout, SequenceLayout):
            raise TypeError(f"layout must be a SequenceLayout or None, got {type(layout).__name__}")
        _check_inputs(cfg, layout, logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs, ref_logprobs, entropy)
        if kl_logprobs is not None:
            _check_float("kl_logprobs", kl_logprobs)
            _check_like("kl_logprobs", kl_logprobs, logprobs.shape, logprobs.device)
        if cfg.entropy.adaptive != (entropy_coef is not None):
            raise ValueError("entropy_coef must be given exactly when entropy.adaptive is true (the step's coefficient "
                             f"from AdaptiveEntropyCoefficient.applied); entropy.adaptive is {cfg.entropy.adaptive}")
        _check_covariance(cfg, layout, generator, logprobs.device)
        token_shape = logprobs.shape
        positive_mask = _positive_tokens(cfg, layout, token_shape, positive, logprobs.device)
        fused = self._use_fused(logprobs, layout)
        if kl_logprobs is not None and fused:
            if self.backend == LossBackend.TRITON:
                raise ValueError("kl_logprobs: backend TRITON does not implement a separate KL input; use "
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
            batch = GlobalBatch.from_rollouts(
                cfg, [loss_mask], old_logprobs=[old_for_batch],
                rollout_logprobs=None if rollout_logprobs is None else [rollout_logprobs],
                entropies=None if entropy is None else [entropy], group=layout.cp_group, layouts=[layout],
            )
        elif not isinstance(batch, GlobalBatch):
            raise TypeError(f"batch must be a GlobalBatch or None, got {type(batch).__name__}")
        else:
            batch.check_micro_batch(loss_mask)
            batch.check_config(cfg)
        if fused:  # steps 3–6 in the fused kernels
            return self._fused(  # type: ignore[misc]
                logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs, ref_logprobs, entropy,
                self._step_tensors_of(batch, logprobs.device), _sequence_info(layout, token_shape, logprobs.device),
            )
        valid = layout.valid_tokens(loss_mask)
        if advantages.shape != token_shape:
            advantages = layout.broadcast(advantages, token_shape)
        # --- 3. token stage ---
        tokens = self._token_stage(
            logprobs, old_logprobs, advantages, valid, rollout_logprobs, ref_logprobs, entropy, kl_logprobs,
            positive_mask,
        )
        if cfg.policy.objective in COVARIANCE_OBJECTIVES:  # per call = per micro-batch (verl), see .covariance
            tokens = tokens._replace(cov_selected=covariance_selection(
                cfg.policy, tokens.logprobs, tokens.log_ratio, tokens.advantages, tokens.valid, generator))
        # --- 4. per-sequence sums over whole sequences, broadcast back ---
        seq_sums = layout.seq_sum(tokens.seq_columns, token_shape)
        seq_tokens = layout.broadcast(seq_sums, token_shape)
        # --- 5. + 6. combine stage and metrics ---
        step = _StepValues(
            tokens=batch.valid_tokens, sequences=batch.sequences(cfg.aggregation.count_empty_sequences),
            micro_batches=batch.num_micro_batches, weight_mean=batch.weight_mean,
            entropy_threshold=batch.entropy_threshold, skip=batch.skip,
            entropy_coef=cfg.entropy.bonus_coef if entropy_coef is None else entropy_coef,
            positive_tokens=positive_tokens,
        )
        return self._combine_stage(tokens, seq_sums, seq_tokens, step, layout.owns_sequences)

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
        rollout_logprobs: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
        batch: GlobalBatch | None = None,
        layout: SequenceLayout | None = None,
        entropy_coef: float | torch.Tensor | None = None,
        positive: torch.Tensor | None = None,
        positive_tokens: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share and metrics from a vocabulary shard of logits: what
        ``self(vocab_parallel_logprobs(logits, target, ...), ...)`` returns — with the entropy computed when the
        config reads it or ``with_entropy`` asks for it (then the metrics report it) —, its gradient w.r.t.
        ``logits``.

        ``logits``, ``target``, ``tp_group``, ``temperature``, ``ignore_index``, ``inplace_backward``,
        ``check_inputs`` and ``sampling_filter`` are those of :func:`mp_grpo.vocab_parallel_logprobs` (token
        shape = ``target.shape``); the other arguments those of :meth:`__call__`.

        The fused path (:mod:`mp_grpo.ops.logits_grpo_loss`: one autograd Function, the loss's backward inside
        the log-prob backward kernel) runs when the call would take the fused loss (:class:`LossBackend`), a
        ``batch`` is given (a training step has one; without it the step's account is built from this call's
        log-probs first) and there is no ``sampling_filter``; otherwise the two ops run one after the other. Both
        give the same values, gradients and metrics (``tests/ops/test_logits_grpo_loss.py``).
        """
        cfg = self.config
        layout = PaddedSequences() if layout is None else layout
        if not isinstance(layout, SequenceLayout):
            raise TypeError(f"layout must be a SequenceLayout or None, got {type(layout).__name__}")
        check_logits_and_target(logits, target)  # first: _use_fused reads logits.is_cuda
        with_entropy = bool(with_entropy) or cfg.needs_entropy
        if batch is None or sampling_filter is not None or not self._use_fused(logits, layout):
            out = vocab_parallel_logprobs(
                logits, target, tp_group=tp_group, temperature=temperature, with_entropy=with_entropy,
                ignore_index=ignore_index, inplace_backward=inplace_backward, check_inputs=check_inputs,
                sampling_filter=sampling_filter,
            )
            logprobs, entropy = out if with_entropy else (out, None)
            return self(
                logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs=rollout_logprobs,
                ref_logprobs=ref_logprobs, entropy=entropy, batch=batch, layout=layout, entropy_coef=entropy_coef,
                positive=positive, positive_tokens=positive_tokens, generator=generator,
            )
        # --- the fused path: check what the two ops would check, then one autograd Function ---
        check_runs_here(logits, "logits")
        spec = LogitsSpec(tp_group, check_temperature(temperature), int(ignore_index), bool(inplace_backward),
                          check_inputs_mode(check_inputs))
        shape, device = target.shape, logits.device
        _check_token_inputs(cfg, layout, shape, device, "target", old_logprobs, advantages, loss_mask,
                            rollout_logprobs, ref_logprobs, None, entropy_computed=True)
        for name, value in (("entropy_coef", entropy_coef), ("positive", positive),
                            ("positive_tokens", positive_tokens), ("generator", generator)):
            if value is not None:  # the fused kernels implement no config that reads them
                raise ValueError(f"{name} is not used by this config")
        if not isinstance(batch, GlobalBatch):
            raise TypeError(f"batch must be a GlobalBatch or None, got {type(batch).__name__}")
        batch.check_micro_batch(loss_mask)
        batch.check_config(cfg)
        call = self._fused.prepare(  # type: ignore[union-attr]
            device, old_logprobs, advantages, loss_mask, rollout_logprobs, ref_logprobs, with_entropy,
            advantages.shape == shape, self._step_tensors_of(batch, device), _sequence_info(layout, shape, device),
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
        entropy_threshold=batch.entropy_threshold, skip=batch.skip,
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


# ------------------------------------------------------------------------------------------------------
class _Tokens(NamedTuple):
    """Output of the token stage: sanitized per-token tensors (exactly 0 on masked positions)."""

    logprobs: torch.Tensor
    log_ratio: torch.Tensor
    advantages: torch.Tensor
    valid: torch.Tensor
    rollout_d: torch.Tensor | None
    ref: torch.Tensor | None
    entropy: torch.Tensor | None
    kl_logprobs: torch.Tensor
    """The log-probs the KL is taken of (``logprobs`` unless ``kl_logprobs`` was given)."""
    positive: torch.Tensor | None
    """Bool: valid tokens of positive examples (``nll.positive_coef`` only)."""
    seq_columns: torch.Tensor
    """``[*tokens, k]``: valid count, then (per config) the objective's sequence input, d, the OPSM divergence,
    ℓ for a sequence-level KL bias correction."""
    cov_selected: torch.Tensor | None = None
    """Bool: clip_cov / kl_cov's covariance selection of this call (set after the token stage)."""


class _StepValues(NamedTuple):
    """What the combine stage reads from the GlobalBatch."""

    tokens: torch.Tensor
    sequences: torch.Tensor
    micro_batches: torch.Tensor
    weight_mean: torch.Tensor | None
    entropy_threshold: torch.Tensor | None
    skip: torch.Tensor | None
    entropy_coef: float | torch.Tensor
    """The entropy-bonus coefficient of this step (``bonus_coef``, or the adaptive one)."""
    positive_tokens: torch.Tensor | None
    """The step's valid tokens of positive examples (``nll.positive_coef`` only)."""


def _token_stage(
    cfg: LossConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    kl_logprobs: torch.Tensor | None,
    positive: torch.Tensor | None,
) -> _Tokens:
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)

    def clean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x.to(dtype), zero)

    lp = clean(logprobs)
    rollout = None if rollout_logprobs is None else clean(rollout_logprobs).detach()
    if cfg.rollout_correction.bypass:
        old = rollout
    elif old_logprobs is None:
        old = lp.detach()
    else:
        old = clean(old_logprobs).detach()
    adv = clean(advantages).detach()
    log_ratio = symmetric_clamp(lp - old, cfg.policy.log_ratio_clamp)  # type: ignore[operator]
    d = None
    if rollout is not None:
        trainer = lp.detach() if cfg.rollout_correction.bypass else old
        d = token_log_ratio(trainer, rollout, valid, cfg.policy.log_ratio_clamp)  # type: ignore[arg-type]
    columns = [valid.to(dtype)]
    if cfg.policy.objective == Objective.VESPO:
        columns.append(vespo_token_input(log_ratio, d, valid, cfg.rollout_correction))
    else:
        seq_in = sequence_input(cfg.policy, log_ratio, adv)
        if seq_in is not None:
            columns.append(seq_in)
    if d is not None:
        columns.append(d)
    if cfg.opsm.delta is not None:
        behaviour = rollout if rollout is not None else old
        columns.append(opsm_divergence(behaviour, lp, valid))  # type: ignore[arg-type]
    if _sequence_bias_correction(cfg):
        columns.append(log_ratio)
    return _Tokens(
        logprobs=lp, log_ratio=log_ratio, advantages=adv, valid=valid, rollout_d=d,
        ref=None if ref_logprobs is None else clean(ref_logprobs).detach(),
        entropy=None if entropy is None else clean(entropy),
        kl_logprobs=lp if kl_logprobs is None else clean(kl_logprobs),
        positive=None if positive is None else valid & positive,
        seq_columns=torch.stack(columns, dim=-1),
    )


def _sequence_bias_correction(cfg: LossConfig) -> bool:
    """Whether the KL's bias correction needs the per-sequence Σℓ (geometric / sequence level)."""
    return cfg.kl.bias_correction and cfg.kl.bias_correction_level != RatioLevel.TOKEN


def _combine_stage(
    cfg: LossConfig,
    t: _Tokens,
    seq_sums: torch.Tensor,
    seq_tokens: torch.Tensor,
    step: _StepValues,
    owns_sequences: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    valid, lp, adv = t.valid, t.logprobs, t.advantages
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    clamp = cfg.policy.log_ratio_clamp
    rc = cfg.rollout_correction
    # Columns of the per-sequence sums, in the order of the token stage.
    column = iter(range(1, seq_tokens.shape[-1]))
    seq_count = seq_tokens[..., 0]
    seq_in_col = next(column) if needs_sequence_sum(cfg.policy) else None
    d_col = next(column) if t.rollout_d is not None else None
    opsm_col = next(column) if cfg.opsm.delta is not None else None
    kl_col = next(column) if _sequence_bias_correction(cfg) else None

    # --- 5a. the objective ---
    seq_value = None if seq_in_col is None else sequence_value(cfg.policy, seq_tokens[..., seq_in_col], seq_count)
    pt = policy_term(cfg.policy, lp, t.log_ratio, adv, seq_value, t.cov_selected)
    policy = pt.term
    # --- 5b. rollout correction: weight and rejection (vespo folds them into φ in the token stage) ---
    raw_weight = weight = truncated = None
    keep_rc = keep_opsm = keep_ent = None
    folded = cfg.policy.objective == Objective.VESPO
    if rc.weight_level is not None and not folded:
        w_log = level_log_ratio(rc.weight_level, t.rollout_d, seq_tokens[..., d_col], seq_count, clamp)  # type: ignore[arg-type,index]
        raw_weight, truncated = weights(w_log, rc)
        weight = truncated
        if rc.normalize_weights:
            weight = normalized_weight(truncated, step.weight_mean)  # type: ignore[arg-type]
        policy = policy * weight
    if rc.reject_level is not None and not folded:
        r_log = level_log_ratio(rc.reject_level, t.rollout_d, seq_tokens[..., d_col], seq_count, clamp)  # type: ignore[arg-type,index]
        keep_rc = kept(r_log, rc)
    # --- 5c. OPSM, top-entropy selection and clip_cov's selection ---
    keep_cov = ~t.cov_selected if cfg.policy.objective == Objective.CLIP_COV else None  # type: ignore[operator]
    if cfg.opsm.delta is not None:
        keep_opsm = opsm_keep(adv, seq_tokens[..., opsm_col], seq_count, cfg.opsm.delta)  # type: ignore[index]
    if cfg.entropy.top_quantile < 1.0:
        keep_ent = high_entropy(t.entropy, step.entropy_threshold)  # type: ignore[arg-type]
    keep = valid
    for mask in (keep_rc, keep_opsm, keep_ent, keep_cov):
        if mask is not None:
            keep = keep & mask
    policy = torch.where(keep, policy, zero)
    # --- 5d. KL and entropy bonus on every valid token (the bonus only on kept ones with bonus_on_selected) ---
    regularizer = torch.zeros_like(policy)
    kl = None
    if t.ref is not None:
        kl_log_ratio = t.log_ratio
        if kl_col is not None:
            kl_log_ratio = level_log_ratio(cfg.kl.bias_correction_level, t.log_ratio, seq_tokens[..., kl_col],
                                           seq_count, clamp)
        kl = kl_penalty(t.kl_logprobs, t.ref, kl_log_ratio, cfg.kl)
        if cfg.kl.coef != 0.0:
            regularizer = regularizer + cfg.kl.coef * kl
    bonus_entropy = None
    if cfg.entropy.bonus_coef != 0.0 or cfg.entropy.adaptive:
        bonus_entropy = t.entropy
        if cfg.entropy.bonus_on_selected:
            bonus_entropy = torch.where(keep_ent, t.entropy, zero)  # type: ignore[arg-type]
        regularizer = regularizer - step.entropy_coef * bonus_entropy  # type: ignore[operator]
    # --- 5e. aggregation: this micro-batch's share (KL / entropy with aggregation.regularizer) ---
    agg = cfg.aggregation
    tokens_, sequences_ = step.tokens.to(lp.dtype), step.sequences.to(lp.dtype)
    divisor = token_divisor(agg.mode, agg.norm_constant, tokens_, sequences_, seq_count)
    if agg.regularizer == agg.mode:
        contribution = (policy + regularizer) / divisor
    else:
        reg_divisor = token_divisor(agg.regularizer, agg.norm_constant, tokens_, sequences_, seq_count)
        contribution = policy / divisor + regularizer / reg_divisor
    if t.positive is not None:  # VAPO: coef · mean over the step's positive tokens of −log π_θ
        nll_divisor = step.positive_tokens.to(lp.dtype).clamp(min=COUNT_FLOOR)  # type: ignore[union-attr]
        contribution = contribution + cfg.nll.positive_coef * torch.where(t.positive, -lp, zero) / nll_divisor
    if step.skip is not None:
        contribution = torch.where(step.skip, zero, contribution)
    share = torch.where(valid, contribution, zero).sum()

    # --- 6. metrics ---
    with torch.no_grad():
        out: dict[str, torch.Tensor] = {
            "loss": M.total_entry(share, step.micro_batches),
            "valid_tokens": M.total_entry(valid.sum(), step.micro_batches),
            "policy_loss": M.mean_entry(policy, valid),
        }
        out.update(M.stats_entries("ratio", pt.ratio, valid))
        if pt.coefficient is not None:
            out.update(M.stats_entries("vespo_phi", pt.coefficient, valid))
        if t.cov_selected is not None:
            out["cov/selected_frac"] = M.mean_entry(t.cov_selected.to(lp.dtype), valid)
        for name, flag in (("low", pt.clipped_low), ("high", pt.clipped_high), ("dual", pt.dual_clipped)):
            if flag is not None:
                out[f"clip_frac/{name}"] = M.mean_entry(flag.to(lp.dtype), valid)
        if weight is not None:
            out.update(M.stats_entries("is_weight/raw", raw_weight, valid))  # type: ignore[arg-type]
            out.update(M.stats_entries("is_weight/truncated", truncated, valid))  # type: ignore[arg-type]
            if rc.normalize_weights:
                out.update(M.stats_entries("is_weight/applied", weight, valid))
        for name, mask in (("rollout", keep_rc), ("opsm", keep_opsm), ("entropy", keep_ent)):
            if mask is not None:
                out[f"rejected_frac/{name}"] = M.mean_entry((~mask).to(lp.dtype), valid)
        if t.rollout_d is not None:
            d = t.rollout_d
            out["mismatch/k1"] = M.mean_entry(k1(d), valid)
            out["mismatch/k3"] = M.mean_entry(k3(d), valid)
            out["mismatch/chi2_token"] = M.mean_entry(chi2_token(d), valid)
            seq_has = (seq_sums[:, 0] > 0) & owns_sequences
            out["mismatch/chi2_seq"] = M.mean_entry(chi2_sequence(seq_sums[:, d_col], clamp), seq_has)  # type: ignore[index]
        if step.skip is not None:
            out["mismatch/skipped"] = torch.stack([step.skip.to(torch.float64), torch.ones_like(step.tokens)])
        if kl is not None:
            out["kl"] = M.mean_entry(kl, valid)
        if t.positive is not None:
            out["nll/positive"] = M.mean_entry(-lp, t.positive)
        if t.entropy is not None:
            out["entropy"] = M.mean_entry(t.entropy, valid)
            if cfg.entropy.adaptive and keep_ent is not None:  # what the controller reads (TRL's measure)
                out["entropy/selected"] = M.mean_entry(t.entropy, valid & keep_ent)
    return share, out


# ------------------------------------------------------------------------------------------------------
def _check_inputs(
    cfg: LossConfig,
    layout: SequenceLayout,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> None:
    """Host-side checks; every error names the argument."""
    _check_float("logprobs", logprobs)
    _check_token_inputs(cfg, layout, logprobs.shape, logprobs.device, "logprobs", old_logprobs, advantages, loss_mask,
                        rollout_logprobs, ref_logprobs, entropy)


def _check_token_inputs(
    cfg: LossConfig,
    layout: SequenceLayout,
    shape: torch.Size,
    device: torch.device,
    reference: str,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    *,
    entropy_computed: bool = False,
) -> None:
    """The checks of :func:`_check_inputs` against the token shape and device of ``reference`` (the argument that
    sets them: ``logprobs``, or ``target`` for :meth:`GRPOLoss.on_logits`, which computes the entropy itself)."""
    layout.check_tokens(shape, reference)
    if not isinstance(loss_mask, torch.Tensor) or loss_mask.is_complex():
        raise TypeError(f"loss_mask must be a bool, integer or floating tensor, got {_kind(loss_mask)}")
    _check_like("loss_mask", loss_mask, shape, device, reference)
    rc = cfg.rollout_correction
    if rc.bypass and old_logprobs is not None:
        raise ValueError("old_logprobs must be None with rollout_correction.bypass: the rollout log-probs are the old ones")
    needs = {
        "rollout_logprobs": (cfg.needs_rollout_logprobs, "rollout_correction / mismatch settings"),
        "ref_logprobs": (cfg.kl.coef != 0.0, "kl.coef != 0"),
        "entropy": (cfg.needs_entropy and not entropy_computed,
                    "entropy.bonus_coef / entropy.top_quantile / entropy.adaptive"),
    }
    given = {"old_logprobs": old_logprobs, "rollout_logprobs": rollout_logprobs, "ref_logprobs": ref_logprobs,
             "entropy": entropy}
    for name, value in given.items():
        if value is None:
            needed, why = needs.get(name, (False, ""))
            if needed:
                raise ValueError(f"{name} must be given: the config's {why} need it")
            continue
        _check_float(name, value)
        _check_like(name, value, shape, device, reference)
    _check_float("advantages", advantages)
    num_sequences = layout.num_sequences(shape)
    if advantages.shape not in (shape, torch.Size([num_sequences])):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}; expected one per sequence [{num_sequences}] or one per "
            f"token {tuple(shape)}"
        )
    if advantages.device != device:
        raise ValueError(f"advantages is on {advantages.device} but {reference} is on {device}")


def _check_covariance(
    cfg: LossConfig, layout: SequenceLayout, generator: torch.Generator | None, device: torch.device
) -> None:
    """clip_cov / kl_cov: no context parallelism; ``generator`` only with clip_cov, on the tokens' device."""
    objective = cfg.policy.objective
    if objective in COVARIANCE_OBJECTIVES and group_size(layout.cp_group) > 1:
        raise ValueError(
            f"layout: policy.objective={objective.value} selects tokens by their covariance over the micro-batch's "
            f"valid tokens (verl), but under context parallelism (cp_group of size {group_size(layout.cp_group)}) "
            "this rank holds only part of them and the selection is not made CP-invariant; use context parallel "
            "size 1 with this objective")
    if generator is None:
        return
    if objective != Objective.CLIP_COV:
        raise ValueError(f"generator is only used by policy.objective=clip_cov, not {objective.value}")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type != device.type:
        raise ValueError(f"generator is on {generator.device} but logprobs is on {device}")


def _positive_tokens(
    cfg: LossConfig, layout: SequenceLayout, shape: torch.Size, positive: torch.Tensor | None,
    layout_device: torch.device,
) -> torch.Tensor | None:
    """Bool token mask of the positive examples (``nll.positive_coef`` only); checks ``positive``."""
    if cfg.nll.positive_coef == 0.0:
        if positive is not None:
            raise ValueError("positive is only used by nll.positive_coef != 0")
        return None
    if positive is None:
        raise ValueError("positive must be given: the config's nll.positive_coef needs it")
    if not isinstance(positive, torch.Tensor):
        raise TypeError(f"positive must be a tensor, got {type(positive).__name__}")
    if positive.device != layout_device:
        raise ValueError(f"positive is on {positive.device} but logprobs is on {layout_device}")
    num_sequences = layout.num_sequences(shape)
    if positive.shape == torch.Size([num_sequences]):
        positive = layout.broadcast(positive.to(torch.float64), shape)
    elif positive.shape != shape:
        raise ValueError(f"positive has shape {tuple(positive.shape)}; expected one per sequence [{num_sequences}] "
                         f"or one per token {tuple(shape)}")
    return positive != 0


def _kind(x: object) -> str:
    return str(x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__


def _check_float(name: str, x: object) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {_kind(x)}")


def _check_like(
    name: str, x: torch.Tensor, shape: torch.Size, device: torch.device, reference: str = "logprobs"
) -> None:
    if x.shape != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, {reference} has {tuple(shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but {reference} is on {device}")
