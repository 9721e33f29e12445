"""A ``forward_step`` for Megatron-LM's ``train_rl.py``: sharded logits, mp_grpo's log-probs and loss.

The lines a user changes, in ``train_rl.py``'s ``__main__`` (``pretrain(..., forward_step, ...)``)::

    from mp_grpo.integrations.megatron_rl import GRPOForwardStep
    forward_step = GRPOForwardStep.from_args()      # Megatron-LM's loss, from the run's --grpo-* arguments
    # or GRPOForwardStep("trl_dapo") / GRPOForwardStep(load_config(...)) for any mp_grpo loss

Schedule of :meth:`GRPOForwardStep.__call__` (Megatron's schedule calls it M times per optimizer step, on every
pipeline stage)

1. **Pre-step hook** (:meth:`GRPOForwardStep.pre_step`), at the first call of each iteration
   (``args.curr_iteration`` changed): pull this rank's M micro-batches of the step from the data iterator
   (M = ``get_num_microbatches()``), cut their loss masks like the logits (CP), and build the step's
   :class:`~mp_grpo.GlobalBatch` — ONE all-reduce over the DP×CP group (``from_masks``; ``from_rollouts`` when
   the config has step-level features: IS-weight normalization, the mismatch skip). The later calls of the
   iteration serve the stored micro-batches in order.
2. The model on this rank's tokens — under context parallelism Megatron-LM's own THD scatter
   (``_scatter_for_context_parallel``) — with ``runtime_gather_output=False``: the logits stay
   ``[B, S/CP, V/TP]`` (Megatron-LM gathers the whole vocabulary on every TP rank). With
   ``output_rows=OutputRows.LOSS`` (the default) or ``logit_dtype=FP32`` (``--output-logit-dtype fp32``) the
   output layer's GEMM is mp_grpo's (:func:`~mp_grpo.megatron.logits_output.call_for_logits`): on the loss rows
   alone, ``[1, K, V/TP]`` (the rows found at the pre-step hook: one host read per micro-batch there, none here),
   and with ``FP32`` its fp32 accumulator is the logits, never rounded to bf16; a GPTModel that has its own
   ``logit_dtype`` must agree with it.
3. Last pipeline stage: ``GRPOLoss.on_logits`` on the TP group (one collective of 16 bytes a row; fused on a GPU)
   — or, with ``entropy_term=SAMPLED_TOKEN`` or the loss rows' logits, the log-probs (scattered back to the
   micro-batch's positions) then GRPOLoss (with Megatron-LM's −p·log p term for ``SAMPLED_TOKEN``).
4. ``loss_func`` returns what Megatron's schedule turns back into the step objective's gradient
   (:class:`~mp_grpo.megatron.scaling.MegatronScaling`: ``(G·ℓ, local tokens, metrics)`` with
   ``--calculate-per-token-loss``, ``(M·DP·ℓ, metrics)`` without) and the metrics as ``[sum, count]`` pairs,
   which Megatron-LM's ``train_step`` reduces exactly over DP×CP: ``lm loss`` = the step objective,
   ``rl/kl_term``, ``rl/pi_over_pi_old``, ``rl/entropy_term`` (Megatron-LM's keys), and mp_grpo's own under
   ``mp_grpo/…``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from mp_grpo.config import load_config
from mp_grpo.config.job import OutputRows
from mp_grpo.config.loss import LossConfig
from mp_grpo.config.precision import LogitDtype
from mp_grpo.integrations.megatron_rl.batch import LossInputs, RLMicroBatch, loss_inputs
from mp_grpo.integrations.megatron_rl.config import EntropyTerm, loss_config_from_args
from mp_grpo.loss.entropy import sampled_token_entropy
from mp_grpo.loss.global_batch import GlobalBatch
from mp_grpo.loss.grpo_loss import GRPOLoss
from mp_grpo.megatron.groups import ParallelGroups
from mp_grpo.megatron.scaling import MegatronScaling
from mp_grpo.ops.loss_rows import LossRows, loss_rows
from mp_grpo.ops.vocab_parallel_logprobs import vocab_parallel_logprobs

MEGATRON_KEYS = {"loss": "lm loss", "kl": "rl/kl_term", "ratio/mean": "rl/pi_over_pi_old", "entropy": "rl/entropy_term"}
"""mp_grpo metric → Megatron-LM's ``loss_func`` key (the rest keep their names under ``mp_grpo/``)."""


@dataclass
class StepMicroBatches:
    """The stored micro-batches of one iteration and their account (the pre-step hook's result)."""

    step: int
    micro_batches: list[RLMicroBatch]
    inputs: list[LossInputs]
    batch: GlobalBatch
    rows: list[LossRows | None]
    """Per micro-batch the loss rows the output layer computes (``OutputRows.LOSS``), else None."""
    served: int = 0

    def next(self) -> tuple[RLMicroBatch, LossInputs, LossRows | None]:
        i = self.served % len(self.micro_batches)  # a rerun of the iteration serves them again, in order
        self.served += 1
        return self.micro_batches[i], self.inputs[i], self.rows[i]


class GRPOForwardStep:
    """Megatron-LM RL's ``forward_step(data_iterator, model, loss_only=False)`` with mp_grpo's loss."""

    def __init__(
        self,
        config: LossConfig | str | Path,
        *,
        overrides: list[str] | None = None,
        entropy_term: EntropyTerm = EntropyTerm.FULL,
        calculate_per_token_loss: bool | None = None,
        groups: ParallelGroups | None = None,
        temperature: float = 1.0,
        logit_dtype: LogitDtype = LogitDtype.BF16,
        output_rows: OutputRows = OutputRows.LOSS,
    ) -> None:
        """
        Args:
            config: the loss: a LossConfig, or a preset name / YAML path (with ``overrides``).
            entropy_term: what ``entropy.bonus_coef`` multiplies (:class:`EntropyTerm`; Megatron-LM's is
                ``SAMPLED_TOKEN``).
            calculate_per_token_loss: the model config's ``calculate_per_token_loss``; None reads
                ``args.calculate_per_token_loss`` at the first step.
            groups: TP, CP, DP×CP and PP groups; None: megatron-core's ``parallel_state`` at the first step.
            temperature: the logits are divided by it before the log-probs (Megatron-LM's own training log-probs
                use 1).
            logit_dtype: the precision of the logits (:class:`~mp_grpo.config.precision.LogitDtype`, Megatron-LM's
                ``--output-logit-dtype``): ``FP32`` computes the output layer's GEMM with an fp32 output (step 2).
            output_rows: ``OutputRows.LOSS`` (default): the output layer's GEMM, the log-probs and their backward on
                each micro-batch's loss rows alone (step 2; the same loss, metrics and gradients); ``ALL``: every row.
        """
        if not isinstance(config, LossConfig):
            config = load_config(config, overrides)
        elif overrides:
            raise ValueError("overrides apply to a preset name or YAML path, not to a LossConfig")
        if not isinstance(entropy_term, EntropyTerm):
            raise TypeError(f"entropy_term must be an EntropyTerm (FULL or SAMPLED_TOKEN), got {entropy_term!r}")
        if not isinstance(logit_dtype, LogitDtype):
            raise TypeError(f"logit_dtype must be a LogitDtype (BF16 or FP32), got {logit_dtype!r}")
        if not isinstance(output_rows, OutputRows):
            raise TypeError(f"output_rows must be an OutputRows (LOSS or ALL), got {output_rows!r}")
        if config.entropy.top_quantile < 1.0 or config.entropy.adaptive:
            raise ValueError("config: entropy.top_quantile < 1 / entropy.adaptive need the step's entropies before "
                             "its first micro-batch, which Megatron-LM's RL loop does not compute; switch them off")
        self.config = config
        self.entropy_term = entropy_term
        self.calculate_per_token_loss = calculate_per_token_loss
        self.temperature = float(temperature)
        self.logit_dtype = logit_dtype
        self.output_rows = output_rows
        self.loss = GRPOLoss(config)
        self._groups = groups
        self._step: StepMicroBatches | None = None

    @classmethod
    def from_args(cls, args: Any = None, **kwargs: Any) -> GRPOForwardStep:
        """Megatron-LM's own loss (:func:`loss_config_from_args`) with its −p·log p entropy term: the same
        objective as ``calculate_grpo_loss`` with ``--calculate-per-token-loss``, on sharded logits; the logits'
        precision from ``--output-logit-dtype`` (:func:`logit_dtype_from_args`)."""
        if args is None:
            from megatron.training import get_args

            args = get_args()
        kwargs.setdefault("entropy_term", EntropyTerm.SAMPLED_TOKEN)
        kwargs.setdefault("logit_dtype", logit_dtype_from_args(args))
        return cls(loss_config_from_args(args), **kwargs)

    @property
    def groups(self) -> ParallelGroups:
        if self._groups is None:
            self._groups = ParallelGroups.from_parallel_state()
        return self._groups

    # ------------------------------------------------------------------------------------- 1. pre-step
    def pre_step(self, micro_batches: Sequence[RLMicroBatch], step: int) -> StepMicroBatches:
        """The step's account from this rank's micro-batches (every rank of the DP×CP group calls it)."""
        micro_batches = list(micro_batches)
        if not micro_batches:
            raise ValueError("micro_batches must hold this rank's micro-batches of the step (at least one)")
        groups = self.groups
        inputs = [loss_inputs(mb, groups.cp) for mb in micro_batches]
        masks, layouts = [x.mask for x in inputs], [x.layout for x in inputs]
        cfg = self.config
        if cfg.rollout_correction.normalize_weights or cfg.mismatch.skip_threshold is not None or cfg.m2po.bound is not None:
            if any(x.inference_logprobs is None for x in inputs):
                raise ValueError("config: rollout_correction.normalize_weights / mismatch.skip_threshold / m2po.bound need "
                                 "the inference log-probs (--rl-inference-logprobs-is-correction)")
            # No collective over PP here: this runs inside Megatron's schedule, where the first stage's first forward
            # step comes before the last stage's (which waits in its first p2p receive), so a broadcast from the last
            # stage would deadlock. Every stage has the same micro-batches, log-probs included: each decides itself.
            batch = GlobalBatch.from_rollouts(cfg, masks, old_logprobs=[x.old_logprobs for x in inputs],
                                              rollout_logprobs=[x.inference_logprobs for x in inputs],
                                              advantages=[x.advantages for x in inputs],
                                              group=groups.dp_cp, layouts=layouts, step=step, pp_group=None)
        else:
            batch = GlobalBatch.from_masks(masks, group=groups.dp_cp, layouts=layouts, step=step)
        # The loss rows (a host read of each mask: here, once per step, not in the micro-batch loop).
        rows = [LossRows(loss_rows(m), m.shape) if self.output_rows is OutputRows.LOSS else None for m in masks]
        return StepMicroBatches(step, micro_batches, inputs, batch, rows)

    # ------------------------------------------------------------------------------------- 3. + 4. the loss
    def loss_on_logits(self, logits: torch.Tensor, x: LossInputs, batch: GlobalBatch,
                       rows: LossRows | None = None) -> tuple[torch.Tensor, dict]:
        """This micro-batch's share of the step objective and mp_grpo's metrics, from this rank's logits — of every
        position, or with ``rows`` of the loss rows alone (``[1, K, V/TP]``, what step 2 makes under
        ``OutputRows.LOSS``; their log-probs scattered back to the micro-batch's positions, 0 elsewhere)."""
        cfg, tp = self.config, self.groups.tp
        rollout = x.inference_logprobs if cfg.needs_rollout_logprobs else None
        if cfg.needs_rollout_logprobs and rollout is None:
            raise ValueError("config: the rollout correction needs the inference log-probs "
                             "(--rl-inference-logprobs-is-correction)")
        if rows is not None and logits.shape[:-1] != x.target.shape:
            return self._loss_on_rows(logits, x, batch, rows)
        if self.entropy_term == EntropyTerm.SAMPLED_TOKEN and cfg.needs_entropy:
            lp = vocab_parallel_logprobs(logits, x.target, tp_group=tp, temperature=self.temperature)
            return self.loss_on_logprobs(lp, x, batch)
        return self.loss.on_logits(
            logits, x.target, _old_logprobs(cfg, x), x.advantages, x.mask, tp_group=tp, temperature=self.temperature,
            with_entropy=self.entropy_term == EntropyTerm.FULL, rollout_logprobs=rollout, ref_logprobs=x.ref_logprobs if cfg.kl.coef != 0.0 else None,
            batch=batch, layout=x.layout)

    def loss_on_logprobs(self, logprobs: torch.Tensor, x: LossInputs, batch: GlobalBatch,
                         entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """The same from log-probs at the logit positions (the ``SAMPLED_TOKEN`` path and the loss rows' path; tests
        feed it float64); ``entropy``: the full entropy at those positions (``FULL``, from the loss rows' logits)."""
        cfg = self.config
        if cfg.needs_entropy and entropy is None:
            if self.entropy_term != EntropyTerm.SAMPLED_TOKEN:
                raise ValueError("entropy_term FULL needs the logits (loss_on_logits)")
            entropy = sampled_token_entropy(logprobs)
        return self.loss(
            logprobs, _old_logprobs(cfg, x), x.advantages, x.mask,
            rollout_logprobs=x.inference_logprobs if cfg.needs_rollout_logprobs else None,
            ref_logprobs=x.ref_logprobs if cfg.kl.coef != 0.0 else None, entropy=entropy, batch=batch, layout=x.layout)

    def _loss_on_rows(self, logits: torch.Tensor, x: LossInputs, batch: GlobalBatch,
                      rows: LossRows) -> tuple[torch.Tensor, dict]:
        """Step 3 on the loss rows' logits ``[1, K, V/TP]``: their log-probs (and entropy) scattered to the
        micro-batch's positions (0 elsewhere: the rows are the mask's own), then GRPOLoss on them."""
        if logits.shape[:-1] != rows.compact_shape:
            raise ValueError(f"logits must be [{', '.join(map(str, x.target.shape))}, V_local] or, on the loss rows, "
                             f"[1, {rows.count}, V_local], got {tuple(logits.shape)}")
        fill = rows.fill_outside(x.mask)[0]
        full_entropy = self.entropy_term == EntropyTerm.FULL  # as on_logits: its metrics report the entropy
        out = vocab_parallel_logprobs(logits, rows.select(x.target), tp_group=self.groups.tp,
                                      temperature=self.temperature, with_entropy=full_entropy)
        lp, ent = out if full_entropy else (out, None)
        return self.loss_on_logprobs(rows.scatter(lp, fill), x, batch,
                                     entropy=rows.scatter(ent, fill) if full_entropy else None)

    def loss_func(self, x: LossInputs, batch: GlobalBatch, scaling: MegatronScaling, logits: torch.Tensor,
                  rows: LossRows | None = None):
        """Megatron's ``loss_func``: the scaled share (step 4) and the metrics as ``[sum, count]`` pairs."""
        share, metrics = self.loss_on_logits(logits, x, batch, rows)
        loss = scaling.megatron_loss(share, batch.valid_tokens)
        reported = megatron_metrics(metrics, sampled_entropy=self.entropy_term == EntropyTerm.SAMPLED_TOKEN)
        if scaling.calculate_per_token_loss:
            return loss, x.mask.sum().to(torch.int), reported
        return loss, reported

    # ------------------------------------------------------------------------------------- forward_step
    def __call__(self, data_iterator: Iterator, model: Any, loss_only: bool = False):
        """Megatron-LM's ``forward_step`` (module docstring)."""
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.core.parallel_state import is_pipeline_last_stage
        from megatron.rl.rl_utils import get_rl_runtime_state
        from megatron.training import get_args

        args = get_args()
        runtime_state = get_rl_runtime_state()
        step = int(args.curr_iteration)
        # --- 1. the pre-step hook, at the first call of an iteration ---
        if self._step is None or self._step.step != step:
            num = get_num_microbatches()
            self._step = self.pre_step([self._read(data_iterator, args, runtime_state) for _ in range(num)], step)
        mb, x, rows = self._step.next()
        runtime_state.increment_sequences(len(mb.seq_lengths) if mb.packed else mb.tokens.shape[0])
        # --- 2. the model, logits kept sharded ---
        model_to_use = model[0] if isinstance(model, list) else model
        output = self._model_forward(model_to_use, mb, x, args, rows)
        if not is_pipeline_last_stage():
            return output, None
        per_token = args.calculate_per_token_loss if self.calculate_per_token_loss is None else self.calculate_per_token_loss
        scaling = MegatronScaling(calculate_per_token_loss=bool(per_token), num_microbatches=len(self._step.micro_batches),
                                  dp_size=self.groups.dp_size)
        return output, partial(self.loss_func, x, self._step.batch, scaling, rows=rows)

    def _read(self, data_iterator: Iterator, args: Any, runtime_state: Any) -> RLMicroBatch:
        """One item of Megatron-LM's RL data iterator as an :class:`RLMicroBatch` on the GPU."""
        item = next(data_iterator)
        if args.rl_use_sequence_packing:
            from megatron.rl.sequence_packing_utils import load_packed_data_by_index

            (tokens, advantages, old, loss_mask, position_ids, ref, inference, seq_starts, seq_lengths, _indices,
             params) = load_packed_data_by_index(item[0].item(), runtime_state.packing_context,
                                                 args.rl_inference_logprobs_is_correction)
            return RLMicroBatch(tokens, position_ids, advantages, loss_mask, old, ref, inference,
                                seq_starts=tuple(seq_starts), seq_lengths=tuple(seq_lengths), packed_seq_params=params)
        tokens, advantages, old, loss_mask, position_ids, ref, inference = item
        return RLMicroBatch(
            tokens.cuda(), position_ids.cuda(), advantages.cuda(), loss_mask[:, 1:].contiguous().cuda(), old.cuda(),
            ref.cuda(), inference.cuda() if args.rl_inference_logprobs_is_correction else None)

    def _model_forward(self, model: Any, mb: RLMicroBatch, x: LossInputs, args: Any,
                       rows: LossRows | None = None) -> torch.Tensor:
        """Step 2: the model on this rank's tokens, ``runtime_gather_output=False``; with ``rows`` the output layer on
        those rows alone (an output layer mp_grpo does not compute itself runs as it is, on every row)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        for module in model.modules():  # as Megatron-LM's forward_step: RoPE caches filled by inference
            for fn in (getattr(module, "_forward", None), getattr(module, "forward", None)):
                if hasattr(fn, "cache_clear"):
                    fn.cache_clear()
        tokens, position_ids = mb.tokens, mb.position_ids
        params = mb.packed_seq_params
        if params is None:  # one THD segment per row, as Megatron-LM's forward_step (no dense attention mask)
            if args.rl_use_sequence_packing:
                from megatron.rl.sequence_packing_utils import get_default_packed_seq_params

                params = get_default_packed_seq_params(seq_length=tokens.shape[1],
                                                       max_sequences_per_bin=args.rl_sequence_packing_max_sequences_per_bin,
                                                       device=tokens.device)
            else:
                cu = torch.tensor([0, tokens.shape[1]], dtype=torch.int32, device=tokens.device)
                extra = {"pad_between_seqs": False} if "pad_between_seqs" in inspect.signature(PackedSeqParams).parameters else {}
                params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                         max_seqlen_q=tokens.shape[1], max_seqlen_kv=tokens.shape[1], **extra)
        if self.groups.cp_size > 1:
            from megatron.rl.rl_utils import _scatter_for_context_parallel

            tokens, position_ids, params, _labels, scatter = _scatter_for_context_parallel(
                tokens, position_ids, params, self.groups.cp)
            if not torch.equal(scatter.partition_index.to(x.positions.device), x.positions):  # type: ignore[union-attr]
                raise RuntimeError("the loss's CP positions differ from Megatron-LM's THD partition of the model input")
        call = dict(packed_seq_params=params, runtime_gather_output=False, fp32_output=not (args.fp16 or args.bf16))
        check_model_logit_dtype(model, self.logit_dtype)
        if self.logit_dtype is LogitDtype.FP32 or rows is not None:  # the output layer's GEMM is mp_grpo's
            from mp_grpo.megatron.logits_output import call_for_logits

            return call_for_logits(model, tokens, position_ids, None, logit_dtype=self.logit_dtype, rows=rows, **call)
        return model(tokens, position_ids, None, **call)


LOGIT_DTYPE_ARG = "--output-logit-dtype"
"""Megatron-LM's argument (``bf16`` | ``fp32``; absent from Megatron-LM before it, e.g. core_v0.19.0)."""
LOGIT_DTYPE_DEST = "logit_dtype"
"""Its ``dest`` in Megatron-LM's parser: ``args.logit_dtype`` — the string after ``parse_args``, a torch dtype after
``validate_args`` maps it (``map_dtype``); None when not given (the output layer's input dtype)."""
_LOGIT_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def logit_dtype_from_args(args: Any) -> LogitDtype:
    """``args.logit_dtype`` (``--output-logit-dtype``) as a :class:`LogitDtype`: a torch dtype or its string form;
    ``BF16`` where this Megatron-LM has no such argument or leaves it None (the logits in the output layer's own
    dtype); any other value is a one-line error naming the argument."""
    value = getattr(args, LOGIT_DTYPE_DEST, None)
    if value is None:
        return LogitDtype.BF16
    named = _LOGIT_DTYPE_NAMES.get(value, value) if isinstance(value, torch.dtype) else value
    try:
        return LogitDtype(str(named).lower())
    except ValueError:
        allowed = " | ".join(d.value for d in LogitDtype)
        raise ValueError(f"{LOGIT_DTYPE_ARG} (args.{LOGIT_DTYPE_DEST}): got {value!r}; allowed {allowed}") from None


def check_model_logit_dtype(model: Any, logit_dtype: LogitDtype) -> None:
    """A GPTModel with its own ``logit_dtype`` (megatron-core versions that have it, set from
    ``--output-logit-dtype``) must agree with ``logit_dtype``: one line naming both otherwise."""
    inner = model
    while inner is not None and not hasattr(inner, "output_layer"):
        inner = getattr(inner, "module", None)
    own = getattr(inner, "logit_dtype", None) if inner is not None else None
    if own is None:
        return
    if own in (torch.float32, "fp32", LogitDtype.FP32):
        own_dtype = LogitDtype.FP32
    elif own in (torch.bfloat16, "bf16", LogitDtype.BF16):
        own_dtype = LogitDtype.BF16
    else:
        return  # another dtype (fp16 / fp32 models): the model's own output layer decides
    if own_dtype is not logit_dtype:
        raise ValueError(f"logit_dtype={logit_dtype.value}, but the model's GPTModel.logit_dtype is {own}: pass the "
                         f"run's {LOGIT_DTYPE_ARG} to GRPOForwardStep (from_args reads it)")


def megatron_metrics(metrics: dict[str, torch.Tensor], *, sampled_entropy: bool) -> dict[str, torch.Tensor]:
    """mp_grpo's ``[sum, count]`` entries under Megatron-LM's keys (``MEGATRON_KEYS``) or ``mp_grpo/<name>``;
    ``entropy`` is Megatron-LM's ``rl/entropy_term`` only when it is its −p·log p (``sampled_entropy``).

    Megatron-LM's ``train_step`` sums 2-element entries over micro-batches and DP×CP and divides: exact. The
    extrema (0-dim, ``…/min`` / ``…/max``) are left out — it would average them over micro-batches."""
    out = {}
    for name, value in metrics.items():
        if value.numel() == 2:
            key = MEGATRON_KEYS.get(name) if name != "entropy" or sampled_entropy else None
            out[key or f"mp_grpo/{name}"] = value.detach().to(torch.float32)
    return out


def _old_logprobs(cfg: LossConfig, x: LossInputs) -> torch.Tensor | None:
    """The micro-batch's old log-probs for the loss — none with ``rollout_correction.bypass``, where the inference
    log-probs are the old ones (the DPPO presets: the ratio and the trust region against the rollout)."""
    return None if cfg.rollout_correction.bypass else x.old_logprobs
