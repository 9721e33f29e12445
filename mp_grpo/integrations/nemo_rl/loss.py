"""mp_grpo's GRPOLoss as a NeMo-RL ``LossFunction`` (``nemo_rl/algorithms/loss/interfaces.py``).

The one line a user changes, in the launcher after ``setup(...)`` (``examples/run_grpo.py``)::

    loss_fn = MPGRPOLossFn.from_master_config(master_config, "nemo_rl_grpo")

or, for the asynchronous SingleController trainer, after ``setup_single_controller(...)``
(``examples/run_grpo_single_controller.py``)::

    actor_args.loss_fn = MPGRPOLossFn.from_master_config(config, "nemo_rl_grpo")

Schedule of :meth:`MPGRPOLossFn.__call__` (NeMo-RL calls it once per micro-batch — once per sequence with
sequence packing — with ``global_valid_toks`` / ``global_valid_seqs``, the step's counts over the DP group)

1. The per-token fields at logit positions (:mod:`.data`): log-prob input ``[B, S-1]`` — every field
   ``x[:, 1:]``; logit input — this rank's ``[B, S_local, V/TP]`` shard, the data dict shifted on the whole
   sequence and cut like the logits (NeMo-RL's load-balanced CP split).
2. The step's :class:`~mp_grpo.GlobalBatch` from NeMo-RL's counts (:func:`step_account`:
   :meth:`GlobalBatch.from_counts`, N = ``global_valid_toks``, S = ``global_valid_seqs``); no collective. A
   micro-batch with more valid tokens than the step is refused. Both counts exactly 1 are the placeholders of
   NeMo-RL's split-API trainers (``train_microbatch`` in ``megatron_policy_worker.py``: every micro-batch
   with ``global_valid_* = 1``, then at ``finish_train_step`` the gradients × 1/N — N = ``global_valid_toks``
   for ``TOKEN_LEVEL``, ``global_valid_seqs`` for ``SEQUENCE_LEVEL`` — and each metric × 1/its advertised
   denominator): :meth:`GlobalBatch.unnormalized` (N = S = 1), so the call returns the raw sums whose rescale is
   the synchronous call's; a config not linear in that one count is refused then (the step-level statistics
   at construction, :func:`~mp_grpo.loss.step_counts.nonlinear_in_counts` at the first such call). The
   decision reads the two counts on the host once per pair of count tensors (NeMo-RL hands every micro-batch
   of a step the same two).
3. GRPOLoss: ``loss(logprobs, ...)`` (log-prob input) or ``loss.on_logits(logits, target, ...)`` on the TP group
   from megatron-core's ``parallel_state`` (logit input; the fused path on a GPU: the loss's backward inside
   the log-prob backward kernel). Temperature 1: NeMo-RL's Megatron worker divides the logits by the
   sampling temperature before any loss sees them.
4. Returned value: the share ℓ of the step objective (its gradient sums to the step's over micro-batches and
   DP ranks, as NeMo-RL's own losses). Logit input under context parallelism: ``CP · ℓ_r`` — NeMo-RL's Megatron
   worker divides every loss by the CP size (``cp_normalize``, made for log-prob losses that see the
   CP-gathered sequence on every CP rank and whose gradient the CP all-gather sums), so rank r's share ℓ_r
   is handed over multiplied back; the per-sequence sums' backward (an all-reduce over CP) makes each rank's
   gradient that of the whole micro-batch's share.
5. Metrics in NeMo-RL's form (:mod:`.metrics`; one host read, one sum and one max over the CP group).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from mp_grpo.collectives import all_reduce_sum, group_size
from mp_grpo.config import load_config
from mp_grpo.config.loss import Aggregation, LossConfig
from mp_grpo.config.precision import LogitDtype
from mp_grpo.integrations.nemo_rl.data import LossFields, logit_fields, shifted_fields
from mp_grpo.integrations.nemo_rl.interfaces import LossInputType, LossType
from mp_grpo.integrations.nemo_rl.metrics import metric_normalizations, nemo_rl_metrics
from mp_grpo.loss.global_batch import GlobalBatch
from mp_grpo.loss.grpo_loss import GRPOLoss, LossBackend
from mp_grpo.loss.step_counts import STEP_STATISTICS, check_linear_in_counts
from mp_grpo.loss.sequence import PaddedSequences
from mp_grpo.megatron.groups import ParallelGroups
from mp_grpo.ops.sampling_filter import SamplingFilter
from mp_grpo.ops.vocab_parallel_logprobs import vocab_parallel_logprobs


class InputType(str, Enum):
    """What NeMo-RL hands the loss (``MPGRPOLossFn(input_type=...)``)."""

    LOGPROB = "logprob"
    """``next_token_logprobs`` ``[B, S-1]`` fp32, shifted, CP-gathered (NeMo-RL computes them from the
    logits: every worker, every parallelism)."""
    LOGIT = "logit"
    """This rank's ``[B, S/CP, V/TP]`` logits shard, temperature-scaled, not shifted (NeMo-RL's Megatron
    worker); the log-probs (and the entropy) come from mp_grpo's vocab-parallel kernel."""


STEP_LEVEL_FEATURES = (
    *((stat.key, stat.needed, stat.computes) for stat in STEP_STATISTICS),
    ("entropy.adaptive", lambda c: c.entropy.adaptive, "a coefficient updated once per step from its mean entropy"),
)
"""Options that need a pass over the whole step before its first micro-batch (``step_counts.STEP_STATISTICS``)
or a coefficient updated between steps; NeMo-RL hands a loss only the step's two counts, so they are refused."""

PLACEHOLDER_COUNT = 1.0
"""``global_valid_toks`` and ``global_valid_seqs`` of NeMo-RL's split-API trainers (``placeholder_n =
torch.tensor(1.0)`` in ``MegatronPolicyWorker._train_microbatch_body``): both exactly this value mark the call as
one whose raw sums NeMo-RL rescales after the step. A real step of one sequence with one valid token has the same
counts; there raw sums and normalized shares are equal, and only the micro-batch bound check is left out."""

FP32_LM_HEAD = "policy.megatron_cfg.fp32_lm_head"
"""NeMo-RL's switch of an fp32 output layer on the Megatron worker: ``true`` (an fp32 GEMM), ``"tf32"`` (the same on
TF32 tensor cores) or ``false``. Both fp32 values give logits of the bf16 operands summed in fp32 and never rounded to
bf16 — what :attr:`LogitDtype.FP32` means (bf16 operands are exact in TF32 and their products in fp32: ``"tf32"``
differs from ``true`` only in the accumulation's order, as mp_grpo's own fp32-output GEMM does), so both map to it."""

SPLIT_API = "NeMo-RL's split-API trainer (placeholder counts global_valid_toks = global_valid_seqs = 1)"
"""How the refusals on the asynchronous path name it."""

_SEQUENCE_LEVEL = (Aggregation.SEQ_MEAN_TOKEN_MEAN, Aggregation.SEQ_MEAN_TOKEN_SUM, Aggregation.SEQ_MEAN_TOKEN_SUM_NORM)


def step_account(global_valid_toks: torch.Tensor, global_valid_seqs: torch.Tensor, device: torch.device) -> GlobalBatch:
    """The step's GlobalBatch from NeMo-RL's counts (:meth:`GlobalBatch.from_counts`, no collective).

    ``global_valid_toks`` = Σ token_mask[:, 1:]·sample_mask over the DP group: mp_grpo's N (``valid_tokens``).
    ``global_valid_seqs`` = Σ sample_mask over the DP group: every row NeMo-RL trains on, with or without a
    valid token — mp_grpo's ``all_sequences`` (the S of ``aggregation.count_empty_sequences=true``); NeMo-RL has
    no count of the rows with a valid token.
    """
    return GlobalBatch.from_counts(valid_tokens=_count("global_valid_toks", global_valid_toks, device),
                                   all_sequences=_count("global_valid_seqs", global_valid_seqs, device), device=device)


def _count(name: str, value: object, device: torch.device) -> torch.Tensor | float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise TypeError(f"{name} must be a one-element tensor (NeMo-RL's global count), got {value!r}")
    return value.detach().reshape(()).to(device=device, dtype=torch.float64)


class MPGRPOLossFn:
    """A NeMo-RL ``LossFunction`` running mp_grpo's loss (module docstring).

    ``loss_type`` follows ``aggregation.mode`` (token_mean: ``TOKEN_LEVEL``, the seq_mean modes:
    ``SEQUENCE_LEVEL``); ``input_type`` is NeMo-RL's ``LOGPROB`` or ``LOGIT``; ``metric_normalizations``
    advertises each metric's denominator; ``reference_policy_kl_penalty`` (= ``kl.coef``) makes NeMo-RL compute
    the unfiltered log-probs the KL is taken of under top-k / top-p filtering (log-prob input).
    Picklable (Ray ships it to the workers): the GRPOLoss and the process groups are made on first use.
    """

    def __init__(
        self,
        config: LossConfig | str | Path,
        *,
        input_type: InputType | Any = InputType.LOGPROB,
        overrides: list[str] | None = None,
        sampling_filter: SamplingFilter | None = None,
        groups: ParallelGroups | None = None,
        cp_normalize: bool = True,
        with_entropy: bool = True,
        backend: LossBackend = LossBackend.AUTO,
        logit_dtype: LogitDtype = LogitDtype.BF16,
    ) -> None:
        """
        Args:
            config: a LossConfig, or a preset name / YAML path for :func:`mp_grpo.load_config` (with ``overrides``).
            input_type: :class:`InputType` (or NeMo-RL's ``LossInputType``, read by value).
            sampling_filter: logit input only — the rollout's top-k / top-p, replayed on the logits (NeMo-RL's
                own log-prob path applies the training sampling params itself); the KL is then taken of the
                unfiltered log-probs, as NeMo-RL does.
            groups: logit input — the TP and CP groups; None takes megatron-core's ``parallel_state`` on the
                first call (on the worker).
            cp_normalize: NeMo-RL's ``LossPostProcessor(cp_normalize=...)`` (True in every NeMo-RL trainer):
                whether the Megatron worker divides this loss by the CP size (module docstring, step 4).
            with_entropy: logit input — compute the policy entropy for the metrics even when the loss does not
                need it (one extra sum in the kernel's pass).
            backend: GRPOLoss's backend.
            logit_dtype: logit input — the precision of the logits NeMo-RL's output layer makes
                (:data:`FP32_LM_HEAD`); ``FP32``: logits rounded to bf16 are refused (a bf16 tensor at every call;
                values that are all bf16 numbers at the first call), never used as fp32 ones.
        """
        if not isinstance(config, LossConfig):
            config = load_config(config, overrides)
        elif overrides:
            raise ValueError("overrides apply to a preset name or YAML path, not to a LossConfig")
        kind = InputType(getattr(input_type, "value", input_type))
        for name, needs, what in STEP_LEVEL_FEATURES:
            if needs(config):
                raise ValueError(f"config: {name} needs {what} before the step's first micro-batch; NeMo-RL gives a "
                                 "loss only the step's token and sequence counts — switch it off")
        if config.aggregation.mode in _SEQUENCE_LEVEL and not config.aggregation.count_empty_sequences:
            raise ValueError(f"config: aggregation.mode={config.aggregation.mode.value} divides by the step's sequences; "
                             "NeMo-RL counts them as Σ sample_mask (with or without a valid token): set "
                             "aggregation.count_empty_sequences=true")
        if kind == InputType.LOGPROB and config.needs_entropy:
            raise ValueError("config: entropy.bonus_coef needs the policy entropy, which the log-prob input does not "
                             "carry; use input_type=InputType.LOGIT (NeMo-RL's Megatron worker)")
        if kind == InputType.LOGPROB and sampling_filter is not None:
            raise ValueError("sampling_filter: with the log-prob input NeMo-RL applies its training sampling params "
                             "itself; sampling_filter is for input_type=InputType.LOGIT")
        if sampling_filter is not None and not isinstance(sampling_filter, SamplingFilter):
            raise TypeError(f"sampling_filter must be a SamplingFilter or None, got {type(sampling_filter).__name__}")
        if groups is not None and not isinstance(groups, ParallelGroups):
            raise TypeError(f"groups must be a ParallelGroups or None, got {type(groups).__name__}")
        if not isinstance(logit_dtype, LogitDtype):
            raise TypeError(f"logit_dtype must be a LogitDtype (BF16 or FP32), got {logit_dtype!r}")
        if kind == InputType.LOGPROB and logit_dtype is not LogitDtype.BF16:
            raise ValueError("logit_dtype: with the log-prob input NeMo-RL makes the log-probs from its own logits "
                             f"({FP32_LM_HEAD} decides their precision there); logit_dtype is for input_type=InputType.LOGIT")
        self.config = config
        self.kind = kind
        self.sampling_filter = sampling_filter
        self.cp_normalize = bool(cp_normalize)
        self.with_entropy = bool(with_entropy)
        self.backend = backend
        self.logit_dtype = logit_dtype
        self._logits_checked = False  # see _check_logit_dtype
        self.input_type = LossInputType.LOGIT if kind == InputType.LOGIT else LossInputType.LOGPROB
        sequence_level = config.aggregation.mode in _SEQUENCE_LEVEL
        self.loss_type = LossType.SEQUENCE_LEVEL if sequence_level else LossType.TOKEN_LEVEL
        self.metric_normalizations = metric_normalizations(sequence_level)
        self.reference_policy_kl_penalty = config.kl.coef
        self._groups = groups
        self._loss: GRPOLoss | None = None
        self._counts_seen: tuple | None = None  # see _is_placeholder
        self._unnormalized: GlobalBatch | None = None  # the placeholder calls' account, per device

    # -------------------------------------------------------------------------------------- construction
    @classmethod
    def from_master_config(
        cls, master_config: Any, config: LossConfig | str | Path, overrides: list[str] | None = None, **kwargs: Any
    ) -> MPGRPOLossFn:
        """The loss for a NeMo-RL GRPO run: logit input on the Megatron worker (``policy.megatron_cfg.enabled``),
        log-prob input on the DTensor worker; under logit input the rollout's top-k / top-p
        (``policy.generation``) replayed. Checks that the reference log-probs are computed when the KL needs them,
        and that the old log-probs are (``loss_fn.force_on_policy_ratio`` makes NeMo-RL skip them). For the
        SingleController's master config (it has ``async_rl``: the split-API trainer, placeholder counts) a
        config not linear in the step's count is refused here (:func:`~mp_grpo.loss.step_counts.nonlinear_in_counts`).
        ``master_config``: NeMo-RL's ``MasterConfig`` (pydantic) or the same as nested mappings.
        """
        policy = _section(master_config, "policy")
        megatron = _section(policy, "megatron_cfg", optional=True) or {}
        kind = InputType.LOGIT if _value(megatron, "enabled", False) else InputType.LOGPROB
        if "input_type" not in kwargs:
            kwargs["input_type"] = kind
        generation = _section(policy, "generation", optional=True) or {}
        top_k, top_p = _value(generation, "top_k"), _value(generation, "top_p")
        if InputType(kwargs["input_type"]) == InputType.LOGIT and "logit_dtype" not in kwargs:
            kwargs["logit_dtype"] = logit_dtype_of(_value(megatron, "fp32_lm_head", False))
        filtering = (top_k is not None and top_k > 0) or (top_p is not None and top_p < 1.0)
        if filtering and InputType(kwargs["input_type"]) == InputType.LOGIT and "sampling_filter" not in kwargs:
            kwargs["sampling_filter"] = SamplingFilter(top_k=top_k if top_k and top_k > 0 else None,
                                                       top_p=top_p if top_p is not None and top_p < 1.0 else None)
        loss = cls(config, overrides=overrides, **kwargs)
        grpo = _section(master_config, "grpo", optional=True) or {}
        if loss.config.kl.coef != 0.0 and _value(grpo, "skip_reference_policy_logprobs_calculation", False):
            raise ValueError("config: kl.coef != 0 needs the reference log-probs, but "
                             "grpo.skip_reference_policy_logprobs_calculation is true")
        nemo_loss = _section(master_config, "loss_fn", optional=True) or {}
        if _value(nemo_loss, "force_on_policy_ratio", False) and _value(grpo, "seq_logprob_error_threshold") is None:
            raise ValueError("loss_fn.force_on_policy_ratio: true makes NeMo-RL skip the old log-probs "
                             "(prev_logprobs), which mp_grpo's loss reads; set it to false")
        if _section(master_config, "async_rl", optional=True) is not None:
            check_linear_in_counts(loss.config, f"config ({SPLIT_API})")
        return loss

    def __getstate__(self) -> dict[str, Any]:
        if self._groups is not None:
            raise TypeError("an MPGRPOLossFn built with explicit groups cannot be pickled (process groups belong to "
                            "one process): build it with groups=None, the worker then takes megatron-core's")
        state = dict(self.__dict__)
        state["_loss"] = None  # rebuilt on the worker
        state["_counts_seen"] = state["_unnormalized"] = None
        for name in ("input_type", "loss_type"):
            state[name] = state[name].value
        state["metric_normalizations"] = {k: v.value for k, v in self.metric_normalizations.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        from mp_grpo.integrations.nemo_rl.interfaces import MetricNormalizer

        state = dict(state)
        state["input_type"] = LossInputType(state["input_type"])
        state["loss_type"] = LossType(state["loss_type"])
        state["metric_normalizations"] = {k: MetricNormalizer(v) for k, v in state["metric_normalizations"].items()}
        self.__dict__.update(state)

    # -------------------------------------------------------------------------------------- call
    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        next_token_logprobs: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """This call's share of the step objective and NeMo-RL's metrics (module docstring)."""
        cfg = self.config
        if self._loss is None:
            self._loss = GRPOLoss(cfg, backend=self.backend)
        names = ["advantages", "prev_logprobs", "generation_logprobs"]
        if cfg.kl.coef != 0.0:
            names.append("reference_policy_logprobs")
        rewards = None
        if cfg.nll.positive_coef != 0.0 and "rewards" in data:
            rewards = data["rewards"]
        if self.kind == InputType.LOGPROB:
            if next_token_logprobs is None or logits is not None:
                raise TypeError("input_type LOGPROB: call with next_token_logprobs= (NeMo-RL's prepare_loss_input)")
            return self._on_logprobs(data, next_token_logprobs, names, global_valid_toks, global_valid_seqs, rewards)
        if logits is None or next_token_logprobs is not None:
            raise TypeError("input_type LOGIT: call with logits= (NeMo-RL's prepare_loss_input)")
        return self._on_logits(data, logits, names, global_valid_toks, global_valid_seqs, rewards)

    def _on_logprobs(self, data, logprobs, names, global_valid_toks, global_valid_seqs, rewards):
        cfg = self.config
        if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 2:
            raise ValueError(f"next_token_logprobs must be a [B, S-1] tensor, got {_shape(logprobs)}")
        # --- 1. the fields at logit positions ---
        fields = shifted_fields(data, tuple(names))
        if logprobs.shape != fields.mask.shape:
            raise ValueError(f"next_token_logprobs has shape {tuple(logprobs.shape)}, the data dict's shifted fields "
                             f"{tuple(fields.mask.shape)}")
        # --- 2. the step's account ---
        batch = self._account(global_valid_toks, global_valid_seqs, fields.mask.device)
        # --- 3. the loss ---
        f = fields.fields
        positive, positive_tokens = self._positive(fields, rewards, None)
        share, ours = self._loss(  # type: ignore[misc]
            logprobs, _old_logprobs(cfg, f), f["advantages"], fields.mask,
            rollout_logprobs=f["generation_logprobs"] if cfg.needs_rollout_logprobs else None,
            ref_logprobs=f.get("reference_policy_logprobs"), batch=batch,
            kl_logprobs=f.get("curr_logprobs_unfiltered") if cfg.kl.coef != 0.0 else None,
            positive=positive, positive_tokens=positive_tokens,
        )
        # --- 5. metrics ---
        metrics = nemo_rl_metrics(cfg, fields, share, ours, global_valid_toks=batch.valid_tokens, logprobs=logprobs,
                                  cp_group=None, rewards=rewards, normalized=batch.normalized)
        return share, metrics

    def _on_logits(self, data, logits, names, global_valid_toks, global_valid_seqs, rewards):
        cfg = self.config
        if type(logits).__name__ == "DTensor":
            raise TypeError("logits is a DTensor (NeMo-RL's DTensor worker): use input_type=InputType.LOGPROB there; "
                            "the logit input takes the Megatron worker's vocab-parallel shard")
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            raise ValueError(f"logits must be this rank's [B, S_local, V_local] shard, got {_shape(logits)}")
        self._check_logit_dtype(logits)
        groups = self._groups if self._groups is not None else ParallelGroups.from_parallel_state()
        cp = groups.cp
        # --- 1. the fields at this rank's logit positions ---
        fields = logit_fields(data, tuple(names), logits.shape[1], cp)
        if fields.mask.shape != logits.shape[:2]:
            raise ValueError(f"logits has shape {tuple(logits.shape)}; the data dict has {fields.mask.shape[0]} rows")
        layout = PaddedSequences(cp_group=cp)
        # --- 2. the step's account ---
        batch = self._account(global_valid_toks, global_valid_seqs, fields.mask.device)
        # --- 3. the loss ---
        f = fields.fields
        positive, positive_tokens = self._positive(fields, rewards, cp)
        common = dict(rollout_logprobs=f["generation_logprobs"] if cfg.needs_rollout_logprobs else None,
                      ref_logprobs=f.get("reference_policy_logprobs"), batch=batch, layout=layout,
                      positive=positive, positive_tokens=positive_tokens)
        if self.sampling_filter is not None and cfg.kl.coef != 0.0:
            # the policy term on the filtered distribution, the KL on the unfiltered one (NeMo-RL)
            with_entropy = self.with_entropy or cfg.needs_entropy
            out = vocab_parallel_logprobs(logits, fields.target, tp_group=groups.tp, with_entropy=with_entropy,
                                          sampling_filter=self.sampling_filter)
            lp, entropy = out if with_entropy else (out, None)
            unfiltered = vocab_parallel_logprobs(logits, fields.target, tp_group=groups.tp)
            share, ours = self._loss(lp, _old_logprobs(cfg, f), f["advantages"], fields.mask,  # type: ignore[misc]
                                     entropy=entropy, kl_logprobs=unfiltered, **common)
        else:
            share, ours = self._loss.on_logits(  # type: ignore[union-attr]
                logits, fields.target, _old_logprobs(cfg, f), f["advantages"], fields.mask, tp_group=groups.tp,
                with_entropy=self.with_entropy, sampling_filter=self.sampling_filter, **common)
        # --- 4. what NeMo-RL's Megatron worker divides by the CP size ---
        returned = share * float(group_size(cp)) if self.cp_normalize else share
        # --- 5. metrics (the loss metric: the whole micro-batch's share, summed over CP) ---
        metrics = nemo_rl_metrics(cfg, fields, share, ours, global_valid_toks=batch.valid_tokens, logprobs=None,
                                  cp_group=cp, rewards=rewards, normalized=batch.normalized)
        return returned, metrics

    def _check_logit_dtype(self, logits: torch.Tensor) -> None:
        """With ``logit_dtype=FP32``: logits of a lower-precision dtype are refused at every call; at the first call,
        logits whose every value is a bf16 number (an fp32 tensor holding bf16-rounded logits: NeMo-RL upcasts a bf16
        output layer's logits) — one pass over that micro-batch's shard and one host read, once."""
        if self.logit_dtype is not LogitDtype.FP32:
            return
        if logits.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"logits are {logits.dtype}, but logit_dtype=fp32 ({FP32_LM_HEAD}): NeMo-RL's output "
                             "layer rounded them; set the key in NeMo-RL's config, or logit_dtype=bf16")
        if self._logits_checked or logits.numel() == 0:
            return
        x = logits.detach()
        if bool(torch.equal(x, x.to(torch.bfloat16).to(x.dtype))):
            raise ValueError(f"logits: every value is a bf16 number, but logit_dtype=fp32 ({FP32_LM_HEAD}): NeMo-RL's "
                             "output layer rounded them to bf16 and upcast them (a NeMo-RL without the key, or the key "
                             "not set in its config); use a NeMo-RL that computes an fp32 head, or logit_dtype=bf16")
        self._logits_checked = True

    def _account(self, global_valid_toks, global_valid_seqs, device: torch.device) -> GlobalBatch:
        """Step 2: :func:`step_account` of the counts, or for NeMo-RL's placeholders (both counts
        :data:`PLACEHOLDER_COUNT`) :meth:`GlobalBatch.unnormalized`, after the config's check."""
        if not self._is_placeholder(global_valid_toks, global_valid_seqs):
            return step_account(global_valid_toks, global_valid_seqs, device)
        check_linear_in_counts(self.config, f"config ({SPLIT_API})")
        batch = self._unnormalized
        if batch is None or batch.valid_tokens.device != device:
            batch = self._unnormalized = GlobalBatch.unnormalized(device=device)
        return batch

    def _is_placeholder(self, global_valid_toks, global_valid_seqs) -> bool:
        """Whether both counts equal :data:`PLACEHOLDER_COUNT`. A tensor count is read on the host once per pair
        of count tensors (the answer is kept for the same two tensors, unmodified in place)."""
        counts = (global_valid_toks, global_valid_seqs)
        tensors = all(isinstance(c, torch.Tensor) for c in counts)
        if tensors:
            key = tuple(c._version for c in counts)
            seen = self._counts_seen
            if seen is not None and seen[0] is counts[0] and seen[1] is counts[1] and seen[2] == key:
                return seen[3]
        values = []
        for name, value in zip(("global_valid_toks", "global_valid_seqs"), counts):
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise TypeError(f"{name} must be a one-element tensor (NeMo-RL's global count), got shape "
                                    f"{tuple(value.shape)}")
                values.append(value.detach().reshape(()).to(torch.float64))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                values.append(float(value))
            else:
                raise TypeError(f"{name} must be a one-element tensor (NeMo-RL's global count), got {value!r}")
        if tensors and values[0].device == values[1].device:
            host = torch.stack(values).tolist()  # the one host read of this pair
        else:
            host = [float(v) for v in values]
        placeholder = host[0] == PLACEHOLDER_COUNT and host[1] == PLACEHOLDER_COUNT
        if tensors:
            self._counts_seen = (counts[0], counts[1], key, placeholder)  # held: their ids cannot be reused
        return placeholder

    def _positive(self, fields: LossFields, rewards, cp_group):
        """VAPO: the positive rows (reward > 0) and NeMo-RL's divisor — this call's positive valid tokens."""
        if self.config.nll.positive_coef == 0.0:
            return None, None
        if rewards is None:
            raise ValueError("data must hold 'rewards' for nll.positive_coef (NeMo-RL: positive_example_nll_weight)")
        rewards = torch.as_tensor(rewards, device=fields.mask.device)
        if rewards.shape != fields.sample_mask.shape:
            raise ValueError(f"data['rewards'] must be [B] = {tuple(fields.sample_mask.shape)}, got {tuple(rewards.shape)}")
        positive = rewards > 0
        count = (fields.mask & positive.unsqueeze(1)).sum(dtype=torch.float64)
        return positive, all_reduce_sum(count, cp_group)


def logit_dtype_of(fp32_lm_head: object) -> LogitDtype:
    """NeMo-RL's :data:`FP32_LM_HEAD` value as a :class:`LogitDtype`: ``true`` and ``"tf32"`` → ``FP32``, ``false``
    or null → ``BF16``; anything else (``"TF32"``, ``"false"``, ``1``) is a one-line error naming the key."""
    if fp32_lm_head is None or fp32_lm_head is False:
        return LogitDtype.BF16
    if fp32_lm_head is True or fp32_lm_head == "tf32":
        return LogitDtype.FP32
    raise ValueError(f'{FP32_LM_HEAD}: got {fp32_lm_head!r}; allowed true | "tf32" | false')


def _value(section: Any, key: str, default: Any = None) -> Any:
    """``section[key]`` of a mapping, or the attribute of a pydantic section (NeMo-RL's ``GRPOConfig``)."""
    if isinstance(section, Mapping):
        return section.get(key, default)
    return getattr(section, key, default)


def _section(config: Any, name: str, optional: bool = False) -> Any:
    """``config[name]`` of NeMo-RL's MasterConfig (a mapping or an object with attributes)."""
    if isinstance(config, Mapping):
        if name in config:
            return config[name]
    elif hasattr(config, name):
        return getattr(config, name)
    if optional:
        return None
    raise KeyError(f"master_config has no {name!r} section (a NeMo-RL MasterConfig)")


def _shape(x: object) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _old_logprobs(cfg: LossConfig, fields: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """NeMo-RL's ``prev_logprobs`` as the loss's old log-probs — none with ``rollout_correction.bypass``, where the
    generation log-probs are the old ones (the DPPO presets: the ratio and the trust region against the rollout)."""
    return None if cfg.rollout_correction.bypass else fields["prev_logprobs"]
