"""GRPOLoss as a Megatron ``forward_step_func`` / ``loss_func`` for ``forward_backward_func``.

Schedule of :meth:`MegatronGRPO.loss_func` (called by Megatron's schedule on the last pipeline stage)

1. Check the model output against the micro-batch: ``[*targets.shape, V_local]`` logits
   (``OutputPath.LOGITS``), or ``[*targets.shape, H]`` final hidden states and the output layer's
   ``[V_local, H]`` weight (``OutputPath.FUSED``, from :func:`~mp_grpo.megatron.fused_output.call_for_hidden_states`),
   with ``V_local · TP`` = the model's (padded) vocabulary — a TP group that does not match the
   model's vocabulary shards fails here, before any collective — and the micro-batch's loss inputs and
   GlobalBatch (GRPOLoss's step 1). This is the micro-batch's one check: the ops and GRPOLoss's entries
   called below are their unchecked ones (``*_unchecked``), which trust it; the sampling filter was checked
   when it was set on the MicroBatch.
2. Log-probs (and entropy) of the targets on the TP group, at the rollout's sampling temperature and,
   when the micro-batch carries one (:meth:`MicroBatch.with_sampling_filter`), under the rollout's
   sampling filter (top-k / top-p / min-p replayed: the filtered, renormalized distribution), or over the
   rollout engine's captured support (:meth:`MicroBatch.with_captured_support`: each token's distribution
   renormalized over the ids it was sampled from), and with the engine's top-K ids
   (:meth:`MicroBatch.with_rollout_top_k`) the trainer's log-probs at them, in the same forward:
   :func:`mp_grpo.vocab_parallel_logprobs` of the logits, or :func:`mp_grpo.fused_linear_logprobs` of
   the hidden states and the weight (the output layer's GEMM fused with the log-probs, chunk by chunk,
   never holding the logits; into ``weight.main_grad`` as :mod:`mp_grpo.megatron.main_grad` decides). This is
   the one place that reads the model output; both paths give the same log-probs and gradients. On the
   fused path with a token-separable loss (:func:`~mp_grpo.megatron.fused_output.loss_in_forward`)
   steps 2–3 run together in :func:`~mp_grpo.megatron.fused_output.fused_output_loss`: the loss's
   gradient is produced chunk by chunk in forward (three GEMMs, no recompute), backward scales it. On
   the logits path of every row without a sampling filter, captured support or top-K ids steps 2–3 run together in
   :meth:`GRPOLoss.on_logits`: one
   autograd Function, the loss's backward inside the log-prob backward kernel (same values, fewer host
   steps per micro-batch). With ``OutputRows.LOSS`` (the default) the model output is that of the micro-batch's loss
   rows alone (:meth:`call_model`; :mod:`mp_grpo.megatron.output_rows`): the ops run on those rows and their
   log-probs and entropy are scattered back to the micro-batch's positions (0 elsewhere) before GRPOLoss. On the logits path the gradient of the logits is written into the logits
   (``inplace_backward``: Megatron's schedule never reads the model output again), and
   :meth:`MegatronGRPO.call_model`'s batch-major output layer (:mod:`mp_grpo.megatron.logits_output`)
   copies neither them nor their gradient: one ``[N, V_local]`` buffer is all the logits path holds.
3. :class:`~mp_grpo.GRPOLoss` with the step's :class:`~mp_grpo.GlobalBatch` and the micro-batch's
   :class:`~mp_grpo.loss.sequence.SequenceLayout`: this micro-batch's share ℓ of the step objective.
4. ℓ scaled so that Megatron's own scaling turns it back into the gradient of the step objective
   (:mod:`mp_grpo.megatron.scaling`), returned as ``(loss, metrics)`` or, with
   ``calculate_per_token_loss``, ``(loss, num_tokens, metrics)`` — for an MoE model with the routed-token
   account of :mod:`mp_grpo.megatron.moe` instead of the trained tokens, so that the routers' aux / z
   losses keep one scale. ``metrics`` is GRPOLoss's dict —
   Megatron's ``loss_reduced``; reduce the list ``forward_backward_func`` returns with
   :func:`mp_grpo.reduce_metrics` over the DP×CP group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial

import torch

from mp_grpo.config.job import OutputPath, OutputRows
from mp_grpo.config.loss import LossConfig
from mp_grpo.config.precision import LogitDtype
from mp_grpo.loss.global_batch import GlobalBatch
from mp_grpo.collectives import is_last_rank
from mp_grpo.loss.grpo_loss import GRPOLoss
from mp_grpo.loss.input_checks import check_batch, check_loss_call
from mp_grpo.loss.metrics import reduce_metrics, total_entry
from mp_grpo.loss.trust_region import TOPK_MODES, TopKLogprobs
from mp_grpo.megatron.fused_output import OutputWeight, call_for_hidden_states, fused_output_loss, loss_in_forward
from mp_grpo.megatron.groups import ParallelGroups, resolve_groups
from mp_grpo.megatron.logits_output import call_for_logits
from mp_grpo.megatron.micro_batch import IGNORE_INDEX, MicroBatch
from mp_grpo.megatron.moe import MoEStats, RoutedTokenAccount, check_moe_config, end_routing_replay, is_moe, replay_routing
from mp_grpo.megatron.output_checks import checked_output
from mp_grpo.megatron.output_rows import RowsOutput, rows_output
from mp_grpo.megatron.scaling import MegatronScaling
from mp_grpo.ops.checks import CheckInputs, check_inputs_mode, check_main_grad, check_temperature
from mp_grpo.ops.fused_linear_logprobs import fused_linear_logprobs_unchecked
from mp_grpo.ops.logits_grpo_loss import LogitsSpec
from mp_grpo.ops.loss_rows import LossRows
from mp_grpo.ops.sampling_filter import SamplingFilter
from mp_grpo.ops.token_ids import CapturedSupport, TokenIds
from mp_grpo.ops.top_k_logprobs import TokenLogprobs
from mp_grpo.ops.vocab_parallel_logprobs import vocab_parallel_logprobs_unchecked


class MegatronGRPO:
    """Builds the pieces of a Megatron step around :class:`~mp_grpo.GRPOLoss`.

    Usage, once per optimizer step (every rank of the DP×CP group, with its own micro-batches)::

        grpo = MegatronGRPO(loss_config, temperature=rollout_temperature, num_microbatches=M,
                            calculate_per_token_loss=model_config.calculate_per_token_loss)
        batch = grpo.global_batch(micro_batches, step=step)
        losses = forward_backward_func(forward_step_func=grpo.forward_step_func(batch, step=step),
                                       data_iterator=iter(micro_batches), model=model,
                                       num_microbatches=M, seq_length=..., micro_batch_size=...)
        metrics = mp_grpo.reduce_metrics(losses, grpo.groups.dp_cp)

    ``output_path=OutputPath.FUSED`` makes the same step read GPTModel's final hidden states and output
    weight instead of its logits (see :class:`~mp_grpo.config.job.OutputPath` for the trade-off); the
    model, the schedule and the call above do not change.
    """

    def __init__(
        self,
        config: LossConfig,
        *,
        temperature: float,
        calculate_per_token_loss: bool,
        num_microbatches: int | None = None,
        groups: ParallelGroups | None = None,
        vocab_size: int | None = None,
        with_entropy: bool = True,
        output_path: OutputPath = OutputPath.LOGITS,
        check_inputs: CheckInputs | bool = CheckInputs.DEFERRED,
        logit_dtype: LogitDtype = LogitDtype.BF16,
        output_rows: OutputRows = OutputRows.LOSS,
    ) -> None:
        """
        Args:
            config: the loss.
            temperature: the rollout engine's sampling temperature; the trainer's log-probs are taken at
                the same temperature (logits / T), so ratios compare like with like.
            calculate_per_token_loss: the model config's ``calculate_per_token_loss``; checked against the
                model's config at every ``forward_step`` (a disagreement would scale the gradients wrongly).
            num_microbatches: M, as passed to ``forward_backward_func``, when it is the same every step (checked
                by :meth:`global_batch`); None (dynamic batching): each step's M is the number of micro-batches
                its GlobalBatch was built from on this rank — pass that same number to ``forward_backward_func``.
            groups: process groups; None takes them from ``megatron.core.parallel_state``.
            vocab_size: the model's (padded) vocabulary size; None reads ``vocab_size`` from the model.
            with_entropy: compute the policy entropy for the metrics even when the loss does not need it
                (one extra sum in the log-prob kernel's pass).
            output_path: ``OutputPath.LOGITS`` (default, faster) reads the model's vocab-parallel logits;
                ``OutputPath.FUSED`` skips the model's output layer and computes the log-probs from its
                input and weight without holding the ``[tokens, V_local]`` logits (see :class:`OutputPath`).
            check_inputs: the log-prob ops' ``check_inputs``: a target outside the vocabulary, or outside the
                kept set of the micro-batch's :attr:`~MicroBatch.sampling_filter`, raises ``ValueError`` (at
                once on the CPU, at the next ``mp_grpo.check_errors()`` — e.g. :meth:`reduce_metrics` — on a
                GPU). With False such a target's log-prob is NaN (outside the vocabulary) or -inf (outside
                the filter: probability 0 under the rollout's distribution); GRPOLoss drops such a position
                from the loss (no value, no gradient) without recording it, the metric ``nonfinite_inputs``
                counts it, and ``sampling_filter/outside_tokens`` counts the trained tokens outside the filter.
                It is also GRPOLoss's ``check_inputs`` (its non-finite inputs).
            logit_dtype: the precision of the output layer's logits on both output paths and in every pass
                through :meth:`model_logprobs` (the forward-only old / reference log-probs): ``LogitDtype.BF16``
                (default) as the model makes them; ``LogitDtype.FP32`` the output GEMM's fp32 accumulator from the
                same bf16 operands (Megatron-LM's ``--output-logit-dtype fp32``; README, "Precision"). A model whose
                output layer cannot be computed so is refused at its first forward step, never rounded silently.
            output_rows: ``OutputRows.LOSS`` (default): the output layer's GEMMs, the log-prob statistics and the
                backward run on each micro-batch's loss rows alone (:attr:`MicroBatch.loss_rows`), in the training
                step and in every pass through :meth:`model_logprobs`; the other positions get log-prob and entropy
                0 and a hidden-state gradient of 0. ``OutputRows.ALL``: every row (the entropy of every position).
                The loss, metrics, log-probs at the loss tokens and gradients are the same (see
                :class:`~mp_grpo.config.job.OutputRows`). Every TP rank must hold the same micro-batches (as it
                already must: the log-prob ops' collectives are sized by the rows).
        """
        if not isinstance(config, LossConfig):
            raise TypeError(f"config must be a LossConfig, got {type(config).__name__}")
        if not isinstance(output_path, OutputPath):
            raise TypeError(f"output_path must be an OutputPath (LOGITS or FUSED), got {output_path!r}")
        if not isinstance(logit_dtype, LogitDtype):
            raise TypeError(f"logit_dtype must be a LogitDtype (BF16 or FP32), got {logit_dtype!r}")
        if not isinstance(output_rows, OutputRows):
            raise TypeError(f"output_rows must be an OutputRows (LOSS or ALL), got {output_rows!r}")
        self.logit_dtype = logit_dtype
        self.output_rows = output_rows
        self.config = config
        self.output_path = output_path
        self.loss = GRPOLoss(config)
        self.temperature = float(temperature)
        self._inv_temperature = check_temperature(self.temperature)
        self.groups = resolve_groups(groups)
        if not isinstance(calculate_per_token_loss, bool):
            raise TypeError(f"calculate_per_token_loss must be a bool (the model config's), got {calculate_per_token_loss!r}")
        if num_microbatches is not None and (isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int)
                                             or num_microbatches < 1):
            raise ValueError(f"num_microbatches must be None or an int ≥ 1, got {num_microbatches!r}")
        self.calculate_per_token_loss = calculate_per_token_loss
        self.num_microbatches = num_microbatches
        self.vocab_size = vocab_size
        self.with_entropy = with_entropy or config.needs_entropy
        self.check_inputs = check_inputs_mode(check_inputs)
        self.moe_stats: MoEStats | None = None
        """The routers' statistics of the current step (MoE models; set at the first forward step)."""
        self._replayed_routing = False

    # ------------------------------------------------------------------------------------------ step
    def global_batch(
        self,
        micro_batches: Sequence[MicroBatch],
        *,
        step: int,
        entropies: Sequence[torch.Tensor] | None = None,
    ) -> GlobalBatch:
        """The step's GlobalBatch over the DP×CP group, from this rank's micro-batches (all ranks must call it).

        Its one all-reduce also checks that every rank of the group has the same LossConfig, step,
        ``calculate_per_token_loss`` and temperature (:class:`~mp_grpo.loss.fingerprint.RankDisagreementError`
        otherwise, on every rank: at once on the CPU, at the next ``mp_grpo.check_errors()`` on a GPU).

        ``entropies`` (per micro-batch, from the old-log-prob pass) are needed by ``entropy.top_quantile < 1``;
        old and rollout log-probs are taken from the micro-batches when the config needs them.
        """
        micro_batches = list(micro_batches)
        if not micro_batches:
            raise ValueError("micro_batches must hold this rank's micro-batches of the step (at least one)")
        if self.num_microbatches is not None and len(micro_batches) != self.num_microbatches:
            raise ValueError(
                f"micro_batches holds {len(micro_batches)} micro-batches but num_microbatches is "
                f"{self.num_microbatches}"
            )
        masks = [mb.loss_mask for mb in micro_batches]
        layouts = [mb.sequences for mb in micro_batches]
        step_level = (self.config.rollout_correction.normalize_weights or self.config.mismatch.skip_threshold is not None
                      or self.config.m2po.bound is not None)
        # Under pipeline parallelism only the last stage needs them: it decides and broadcasts over PP.
        needs_logprobs = step_level and is_last_rank(self.groups.pp)
        for i, mb in enumerate(micro_batches):
            for name in ("old_logprobs", "rollout_logprobs"):
                if needs_logprobs and getattr(mb, name) is None:
                    raise ValueError(
                        f"micro_batches[{i}].{name} is None, but rollout_correction.normalize_weights / "
                        "mismatch.skip_threshold / m2po.bound decide on it before the step: set it (MicroBatch.with_logprobs, "
                        "e.g. from a no-grad pass of the model at the start of the step)"
                    )
        # nonfinite.skip_step: the last stage checks every rollout input the micro-batches hold
        checks_inputs = self.config.nonfinite.skip_step and is_last_rank(self.groups.pp)

        def given(name: str) -> list[torch.Tensor] | None:
            values = [getattr(mb, name) for mb in micro_batches]
            return values if all(v is not None for v in values) else None

        return GlobalBatch.from_rollouts(  # without step-level quantities: the counts only, as from_masks
            self.config,
            masks,
            old_logprobs=given("old_logprobs") if needs_logprobs or checks_inputs else None,
            rollout_logprobs=given("rollout_logprobs") if needs_logprobs or checks_inputs else None,
            ref_logprobs=given("ref_logprobs") if checks_inputs else None,
            advantages=given("advantages") if checks_inputs or needs_logprobs else None,  # (M2PO's clip quadrants)
            entropies=entropies,
            group=self.groups.dp_cp,
            layouts=layouts,
            step=step,
            pp_group=self.groups.pp,
            # checked in the batch's all-reduce with the LossConfig and the step: a rank that differs would scale
            # its gradient (calculate_per_token_loss) or its log-probs (temperature) differently
            same_on_all_ranks={"calculate_per_token_loss": self.calculate_per_token_loss,
                               "temperature": self.temperature},
        )

    def reduce_metrics(self, losses: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, float]:
        """The step's metrics from what ``forward_backward_func`` returned, on every pipeline stage.

        :func:`mp_grpo.reduce_metrics` over the DP×CP group on the last stage, broadcast over the PP group:
        every stage (whose ``losses`` list is empty except on the last) gets the last stage's values.
        For an MoE model the routers' metrics of the step are added on every stage (``moe/…``,
        :mod:`mp_grpo.megatron.moe`), and a step that replayed routing ends the replay.
        """
        metrics = reduce_metrics(losses, self.groups.dp_cp, pp_group=self.groups.pp)
        if self.moe_stats is not None:
            metrics.update(self.moe_stats.reduce())
        if self._replayed_routing:
            end_routing_replay()
            self._replayed_routing = False
        return metrics

    def forward_step_func(
        self, batch: GlobalBatch, *, step: int, model_kwargs: Mapping[str, object] | None = None
    ) -> Callable[[Iterator[MicroBatch], torch.nn.Module], tuple[torch.Tensor, Callable]]:
        """A ``forward_step_func`` for ``forward_backward_func``; its data iterator yields :class:`MicroBatch`.

        The model is called like GPTModel (:meth:`call_model`): ``model(input_ids, position_ids, None,
        packed_seq_params=..., **model_kwargs)`` (``model_kwargs`` e.g. ``{"fp32_output": False}`` to keep a
        Float16Module's logits or hidden states in bf16). ``batch`` must be the GlobalBatch built for ``step``.
        """
        if not isinstance(batch, GlobalBatch):
            raise TypeError(f"batch must be a GlobalBatch, got {type(batch).__name__}")
        batch.check_step(step)
        batch.check_config(self.config)
        extra = dict(model_kwargs or {})
        checked_models: dict[int, RoutedTokenAccount | None] = {}
        if self.moe_stats is not None:
            self.moe_stats.reset()

        def forward_step(
            data_iterator: Iterator[MicroBatch],
            model: torch.nn.Module,
            checkpoint_activations_microbatch: bool | None = None,
            *,
            return_schedule_plan: bool = False,
        ):
            # Megatron's schedules pass these two in some modes; refuse them with the reason, not a TypeError.
            if return_schedule_plan:
                raise NotImplementedError(
                    "return_schedule_plan=True: the combined 1F1B schedule of overlap_moe_expert_parallel_comm "
                    "needs a GPTModel schedule plan, which MegatronGRPO's forward_step does not build; turn "
                    "overlap_moe_expert_parallel_comm off"
                )
            if checkpoint_activations_microbatch is not None:
                raise NotImplementedError(
                    "checkpoint_activations_microbatch: megatron-core's GPTModel has no per-micro-batch activation "
                    "checkpointing switch (the schedule passes one with num_microbatches_with_partial_activation_"
                    "checkpoints); unset that option and use the model config's recompute_* settings"
                )
            if id(model) not in checked_models:
                checked_models[id(model)] = self._prepare_model(model, extra)
            mb = next(data_iterator)
            if not isinstance(mb, MicroBatch):
                raise TypeError(f"the data iterator must yield MicroBatch objects, got {type(mb).__name__}")
            if mb.routing is not None:
                replay_routing(model, mb.routing)
                self._replayed_routing = True
            output, output_weight = self.call_model(model, mb, model_kwargs=extra)
            return output, partial(
                self.loss_func, mb, batch, vocab_size=self._model_vocab_size(model), output_weight=output_weight,
                routed=checked_models[id(model)],
            )

        return forward_step

    def _prepare_model(self, model: torch.nn.Module, model_kwargs: Mapping[str, object]) -> RoutedTokenAccount | None:
        """First forward step on ``model`` this step: check its config; for MoE, hook its routers for the metrics
        and return the routed-token account the loss function reports under per-token loss (else None)."""
        self.check_model_config(model)
        from megatron.core.utils import get_attr_wrapped_model

        try:
            config = get_attr_wrapped_model(model, "config")
        except RuntimeError:
            return None
        if not is_moe(config):
            return None
        if self.moe_stats is None:
            self.moe_stats = MoEStats(config, self.groups)
        self.moe_stats.attach(model)
        if not self.calculate_per_token_loss:
            return None
        if "padding_mask" in model_kwargs:
            raise ValueError(
                "model_kwargs['padding_mask'] with an MoE model under calculate_per_token_loss: the routers would "
                "count only unmasked positions, which the routed-token account (mp_grpo.megatron.moe) does not "
                "know; leave padding to be routed or use calculate_per_token_loss=False"
            )
        return RoutedTokenAccount.for_model(self.groups)

    def check_model_config(self, model: torch.nn.Module) -> None:
        """Raise if ``model``'s config disagrees with what this adapter's scaling and paths assume.

        ``calculate_per_token_loss`` decides the loss contract (a 3-tuple with a token count and Megatron's
        division by the global count, or a 2-tuple with its ×CP/M): a mismatch scales every gradient wrongly
        and silently, so it is compared here. Multi-token prediction (``mtp_num_layers``) needs labels inside
        GPTModel, which neither output path passes. Models without a Megatron config are not checked.
        """
        from megatron.core.utils import get_attr_wrapped_model

        try:
            config = get_attr_wrapped_model(model, "config")
        except RuntimeError:
            return
        model_flag = getattr(config, "calculate_per_token_loss", None)
        if model_flag is not None and bool(model_flag) != self.calculate_per_token_loss:
            raise ValueError(
                f"calculate_per_token_loss: MegatronGRPO was built with {self.calculate_per_token_loss} but the "
                f"model config has {bool(model_flag)}; the gradients would be scaled wrongly (pass "
                "calculate_per_token_loss=model_config.calculate_per_token_loss)"
            )
        cp = getattr(config, "context_parallel_size", None)
        if cp is not None and int(cp) != self.groups.cp_size:
            raise ValueError(
                f"groups.cp: the model config has context_parallel_size={cp} but the CP group has "
                f"{self.groups.cp_size} ranks"
            )
        check_moe_config(config, self.groups, calculate_per_token_loss=self.calculate_per_token_loss)
        if getattr(config, "mtp_num_layers", None):
            raise ValueError(
                f"mtp_num_layers={config.mtp_num_layers}: multi-token prediction computes its loss inside GPTModel "
                "from labels, which MegatronGRPO does not pass (it reads the logits or the hidden states of the "
                "main head); build the model with mtp_num_layers=None for GRPO training"
            )

    def call_model(
        self, model: torch.nn.Module, mb: MicroBatch, *, model_kwargs: Mapping[str, object] | None = None
    ) -> tuple[torch.Tensor, OutputWeight | None]:
        """The model's output for ``mb`` on this object's output path, and the output weight it needs.

        ``OutputPath.LOGITS``: ``(logits [*targets, V_local], None)``, GPTModel's output layer computing them
        batch-major (:func:`~mp_grpo.megatron.logits_output.call_for_logits`: no transposed copy of the logits
        forward or backward). ``OutputPath.FUSED``: ``(hidden
        [*targets, H], OutputWeight)`` with the model's output layer skipped
        (:func:`~mp_grpo.megatron.fused_output.call_for_hidden_states`); on a pipeline stage without an
        output layer ``(activations, None)``. With ``OutputRows.LOSS`` the output layer gets the micro-batch's loss
        rows alone and the output is theirs, ``[1, K, V_local]`` or ``[1, K, H]`` (:meth:`loss_rows`). Either way,
        pass both to :meth:`token_logprobs`.
        """
        kwargs = dict(model_kwargs or {})
        if mb.packed_seq_params is not None:
            kwargs["packed_seq_params"] = mb.packed_seq_params
        rows = self.loss_rows(mb)
        if self.output_path == OutputPath.FUSED:
            return call_for_hidden_states(model, mb.input_ids, mb.position_ids, None, rows=rows, **kwargs)
        logits = call_for_logits(model, mb.input_ids, mb.position_ids, None, logit_dtype=self.logit_dtype, rows=rows,
                                 **kwargs)
        return logits, None

    def loss_rows(self, mb: MicroBatch) -> LossRows | None:
        """The rows of ``mb`` the output layer computes: its loss rows (:attr:`MicroBatch.loss_rows`) under
        ``OutputRows.LOSS``, None (every row) under ``OutputRows.ALL``."""
        if self.output_rows is OutputRows.ALL:
            return None
        return LossRows(mb.loss_rows, mb.targets.shape)

    def model_logprobs(
        self, model: torch.nn.Module, mb: MicroBatch, *, model_kwargs: Mapping[str, object] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`call_model` then :meth:`token_logprobs`: ``(logprobs, entropy or None)`` of ``mb.targets``.

        For passes outside the training step on the same output path, e.g. the old log-probs under
        ``torch.no_grad()`` at the start of a step, or a reference model's log-probs.
        """
        output, output_weight = self.call_model(model, mb, model_kwargs=model_kwargs)
        return self.token_logprobs(output, mb, vocab_size=self._model_vocab_size(model), output_weight=output_weight)

    # ------------------------------------------------------------------------------------------ loss
    def token_logprobs(
        self,
        output_tensor: torch.Tensor,
        mb: MicroBatch,
        *,
        vocab_size: int | None = None,
        output_weight: OutputWeight | None = None,
        inplace_backward: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Steps 1–2: fp32 log-probs of ``mb.targets`` (and entropy) from the model output of :meth:`call_model`.

        ``OutputPath.LOGITS``: ``output_tensor`` is the vocab-parallel logits and ``output_weight`` None.
        ``OutputPath.FUSED``: ``output_tensor`` is the output layer's TP-mapped input and ``output_weight``
        its weight. Either of every row, ``[*targets, X]``, or — ``OutputRows.LOSS`` — of the loss rows alone,
        ``[1, K, X]`` (what :meth:`call_model` makes then); the results are ``[*targets]`` either way, 0 outside
        the rows. ``inplace_backward`` (logits path): the logits' gradient is written into the logits
        themselves (one ``[N, V_local]`` buffer fewer; they are overwritten in backward) — what
        :meth:`loss_func` does with the model output, which Megatron's schedule never reads again.
        """
        # --- 1. the output must cover the micro-batch's positions (or its loss rows) and this rank's vocabulary shard ---
        rows = self.loss_rows(mb)
        x = checked_output(self.output_path, output_tensor, mb, output_weight, self._vocab_size(vocab_size),
                           self.groups.tp_size, rows)
        selected = rows_output(x, mb, rows, self.output_path, self.check_inputs)
        # --- 2. log-probs and entropy over the whole (sharded) vocabulary ---
        out = self._logprobs_unchecked(x, mb, selected, output_weight, inplace_backward, with_top_k=False)
        return out.logprobs, out.entropy

    def token_logprobs_with_top_k(
        self,
        output_tensor: torch.Tensor,
        mb: MicroBatch,
        *,
        vocab_size: int | None = None,
        output_weight: OutputWeight | None = None,
    ) -> TokenLogprobs:
        """:meth:`token_logprobs` and, in the same forward, the trainer's log-probs at the micro-batch's rollout top-K
        ids (:attr:`MicroBatch.rollout_top_k`): ``TokenLogprobs(logprobs, entropy or None, top_k)``, ``top_k``
        ``[nnz]`` fp32 aligned with ``mb.rollout_top_k.ids`` (not differentiable; 0 at the entries of positions outside
        the loss rows under ``OutputRows.LOSS``). For passes outside the training step (a forward-only pass measuring
        the top-K divergence); the training step takes them in :meth:`loss_func`."""
        if mb.rollout_top_k is None:
            raise ValueError("mb.rollout_top_k is None: set the engine's top-K ids with MicroBatch.with_rollout_top_k")
        rows = self.loss_rows(mb)
        x = checked_output(self.output_path, output_tensor, mb, output_weight, self._vocab_size(vocab_size),
                           self.groups.tp_size, rows)
        selected = rows_output(x, mb, rows, self.output_path, self.check_inputs)
        return self._logprobs_unchecked(x, mb, selected, output_weight, False, with_top_k=True)

    def _logprobs_unchecked(
        self, x: torch.Tensor, mb: MicroBatch, selected: RowsOutput | None, output_weight: OutputWeight | None,
        inplace_backward: bool, *, with_top_k: bool,
    ) -> TokenLogprobs:
        """Step 2 on the output :func:`~mp_grpo.megatron.output_checks.checked_output` returned — or on the loss rows'
        (``selected``, the results scattered back to ``[*targets]`` and the micro-batch's top-K list): the ops'
        unchecked entries; ``top_k`` (the log-probs at ``mb.rollout_top_k``'s ids) None unless ``with_top_k``."""
        if selected is not None:
            out = self._op_logprobs(selected.x, selected.targets, selected.sampling_filter, selected.captured_support,
                                    selected.top_k_ids if with_top_k else None, output_weight, inplace_backward)
            return TokenLogprobs(selected.scatter(out.logprobs), selected.scatter(out.entropy),
                                 selected.scatter_top_k(out.top_k))
        return self._op_logprobs(x, mb.targets, mb.sampling_filter, mb.captured_support,
                                 mb.rollout_top_k.ids if with_top_k else None, output_weight, inplace_backward)

    def _op_logprobs(
        self, x: torch.Tensor, targets: torch.Tensor, sampling_filter: SamplingFilter | None,
        captured_support: CapturedSupport | None, top_k_ids: TokenIds | None, output_weight: OutputWeight | None,
        inplace_backward: bool,
    ) -> TokenLogprobs:
        """The log-prob op of this output path on ``x`` and ``targets`` (``[*targets, X]``, ``[*targets]``)."""
        common = dict(tp_group=self.groups.tp, inv_temperature=self._inv_temperature, with_entropy=self.with_entropy,
                      ignore_index=IGNORE_INDEX, check_inputs=self.check_inputs, sampling_filter=sampling_filter,
                      captured_support=captured_support, top_k_ids=top_k_ids)
        if self.output_path == OutputPath.FUSED:
            weight = output_weight.weight  # type: ignore[union-attr]
            # Megatron's linear layer, too, accumulates only when a weight gradient is computed.
            accumulate = output_weight.accumulate_into_main_grad and torch.is_grad_enabled() and weight.requires_grad
            if accumulate:
                check_main_grad(weight)
            out = fused_linear_logprobs_unchecked(x, weight, targets, chunk_tokens=None, chunk_vocab=None,
                                                  accumulate_into_main_grad=accumulate, logit_dtype=self.logit_dtype,
                                                  **common)
        else:
            out = vocab_parallel_logprobs_unchecked(x, targets, inplace_backward=inplace_backward, **common)
        if top_k_ids is not None:
            return out
        return TokenLogprobs(*(out if self.with_entropy else (out, None)), None)

    def loss_func(
        self,
        mb: MicroBatch,
        batch: GlobalBatch,
        output_tensor: torch.Tensor,
        *,
        vocab_size: int | None = None,
        output_weight: OutputWeight | None = None,
        routed: RoutedTokenAccount | None = None,
    ) -> tuple:
        """Megatron's loss function for one micro-batch; see the module docstring.

        ``routed`` (MoE model, per-token loss; given by ``forward_step``): report the routed-token account
        instead of the trained tokens, so the routers' aux / z losses get the scale of
        :mod:`mp_grpo.megatron.moe`; GRPOLoss's gradient is the same either way.
        """
        # --- 1. the micro-batch against the model output, and its loss inputs, checked once: the layers below trust it ---
        rows = self.loss_rows(mb)
        x = checked_output(self.output_path, output_tensor, mb, output_weight, self._vocab_size(vocab_size),
                           self.groups.tp_size, rows)
        if (self.config.trust_region.mode in TOPK_MODES) != (mb.rollout_top_k is not None):
            raise ValueError(f"mb.rollout_top_k: trust_region.mode={self.config.trust_region.mode.value} "
                             + ("takes the divergence over the engine's top-K ids: set them with "
                                "MicroBatch.with_rollout_top_k" if mb.rollout_top_k is None else
                                "reads no top-K log-probs: leave MicroBatch.rollout_top_k unset, or pick topk_tv / topk_kl"))
        # the top-K input as the loss will get it, the trainer's side (taken in step 2) in the engine's shape
        topk = None if mb.rollout_top_k is None else TopKLogprobs(mb.rollout_top_k.ids.indptr, mb.rollout_top_k.logprobs,
                                                                  mb.rollout_top_k.logprobs)
        check_loss_call(self.config, mb.sequences, mb.targets.shape, x.device, "targets", mb.old_logprobs,
                        mb.advantages, mb.loss_mask, mb.rollout_logprobs, mb.ref_logprobs, None, entropy_computed=True,
                        topk_logprobs=topk)
        check_batch(self.config, batch, mb.loss_mask)
        # OutputRows.LOSS: the model output of the loss rows (None: every row's); the ops run on the rows, their
        # results scattered back to the micro-batch's positions, so GRPOLoss below sees full-size log-probs.
        selected = rows_output(x, mb, rows, self.output_path, self.check_inputs)

        def share_of(logprobs: torch.Tensor, entropy: torch.Tensor | None,
                     top_k: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
            share, metrics = self._share(mb, batch, logprobs, entropy, top_k)
            # Trained tokens outside the rollout's sampling filter or captured support (log-prob -inf; 0 without
            # either or when checked, which raises instead): always present, so every micro-batch's dict has the
            # same names.
            outside = (torch.isneginf(logprobs.detach()) & mb.loss_mask).sum()
            metrics["sampling_filter/outside_tokens"] = total_entry(outside, batch.num_micro_batches)
            return share, metrics

        restricted = mb.sampling_filter is not None or mb.captured_support is not None or mb.rollout_top_k is not None
        if self.output_path == OutputPath.FUSED and loss_in_forward(self.config, mb.sequences):
            # --- 2.–3. fused path, token-separable loss: log-probs (and the top-K ones) and the share with its
            #          gradient in forward — of the loss rows, the loss reading them scattered to the micro-batch ---
            if selected is not None:
                hidden, targets, filt, support, top_k_ids = (selected.x, selected.targets, selected.sampling_filter,
                                                             selected.captured_support, selected.top_k_ids)
                loss_fn = selected.loss_fn(share_of)
            else:
                hidden, targets, filt, support = x, mb.targets, mb.sampling_filter, mb.captured_support
                top_k_ids = None if mb.rollout_top_k is None else mb.rollout_top_k.ids
                loss_fn = share_of
            share, metrics = fused_output_loss(
                hidden, output_weight, targets, loss_fn, tp_group=self.groups.tp,  # type: ignore[arg-type]
                inv_temperature=self._inv_temperature, with_entropy=self.with_entropy, ignore_index=IGNORE_INDEX,
                sampling_filter=filt, check_inputs=self.check_inputs, logit_dtype=self.logit_dtype,
                captured_support=support, top_k_ids=top_k_ids,
            )
        elif self.output_path == OutputPath.LOGITS and not restricted and (selected is None or selected.every_row):
            # --- 2.–3. logits path: log-probs and the share in one autograd Function (GRPOLoss.on_logits) ---
            spec = LogitsSpec(self.groups.tp, self._inv_temperature, IGNORE_INDEX, True, self.check_inputs)
            share, metrics = self.loss.on_logits_unchecked(
                x, mb.targets, mb.old_logprobs, mb.advantages, mb.loss_mask, spec=spec, with_entropy=self.with_entropy,
                rollout_logprobs=mb.rollout_logprobs, ref_logprobs=mb.ref_logprobs, batch=batch, layout=mb.sequences,
            )
            # No sampling filter: no trained token lies outside it (the name kept, as share_of reports it).
            outside = torch.zeros((), dtype=torch.int64, device=share.device)
            metrics["sampling_filter/outside_tokens"] = total_entry(outside, batch.num_micro_batches)
        else:
            # --- 2. log-probs (and entropy; the top-K ones) ---
            out = self._logprobs_unchecked(x, mb, selected, output_weight, inplace_backward=True,
                                           with_top_k=mb.rollout_top_k is not None)
            # --- 3. this micro-batch's share of the step objective ---
            share, metrics = share_of(*out)
        # --- 4. what Megatron's schedule, DDP and finalize_model_grads turn back into ∇J ---
        scaling = MegatronScaling(calculate_per_token_loss=self.calculate_per_token_loss,
                                  num_microbatches=len(batch.micro_batch_shapes), dp_size=self.groups.dp_size)
        if self.calculate_per_token_loss and routed is not None:
            # MoE (mp_grpo.megatron.moe, step 2): report the routed-token account; Megatron divides by its sum A.
            loss = scaling.megatron_loss(share, routed.total(batch.all_positions))
            return loss, routed.local(mb.input_ids.numel(), loss.device), metrics
        loss = scaling.megatron_loss(share, batch.valid_tokens)
        if self.calculate_per_token_loss:
            # This rank's valid tokens: summed over micro-batches and DP×CP, the GlobalBatch's valid_tokens.
            num_tokens = mb.sequences.valid_tokens(mb.loss_mask).sum().to(device=loss.device, dtype=torch.int)
            return loss, num_tokens, metrics
        return loss, metrics

    def _share(self, mb: MicroBatch, batch: GlobalBatch, logprobs: torch.Tensor, entropy: torch.Tensor | None,
               top_k: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        """Step 3: GRPOLoss's share of the micro-batch from its log-probs (and entropy). ``top_k``: the trainer's
        log-probs at ``mb.rollout_top_k.ids`` ([nnz] fp32, aligned), taken in step 2's forward — with the engine's
        ``mb.rollout_top_k.logprobs`` the loss's top-K divergence input (``trust_region.mode`` topk_tv / topk_kl)."""
        topk = None if top_k is None else TopKLogprobs(mb.rollout_top_k.ids.indptr, mb.rollout_top_k.logprobs, top_k)
        return self.loss.share_unchecked(
            logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask,
            rollout_logprobs=mb.rollout_logprobs, ref_logprobs=mb.ref_logprobs, entropy=entropy,
            batch=batch, layout=mb.sequences, check_inputs=self.check_inputs, topk_logprobs=topk,
        )

    def _vocab_size(self, vocab_size: int | None) -> int | None:
        """The model's vocabulary size: ``vocab_size`` if given, else the one this object was built with."""
        return self.vocab_size if vocab_size is None else vocab_size

    def _model_vocab_size(self, model: torch.nn.Module) -> int | None:
        if self.vocab_size is not None:
            return self.vocab_size
        from megatron.core.utils import get_attr_wrapped_model

        try:
            return int(get_attr_wrapped_model(model, "vocab_size"))
        except RuntimeError:
            return None

