"""The explicit account of one optimizer step: global counts and step-level decisions, the same on every rank.

**Gradient convention.** :class:`~mp_grpo.GRPOLoss` returns each micro-batch's *share* of the step
objective J: the shares of all micro-batches on all ranks of the group add up to J, and so do their
gradients — whatever the split into ranks and micro-batches. Every normalizer of the loss therefore
comes from here, never from the micro-batch: the global valid-token count N, the global sequence count
S and the step-level quantities below. (Megatron's schedule scales what a loss function returns; the
Megatron adapter undoes that scaling — see ``mp_grpo.megatron.scaling``.)

Schedule of :meth:`GlobalBatch.from_rollouts` (and of :meth:`GlobalBatch.from_masks`, which is its
first steps only)
    1. Check the micro-batches; the valid tokens of each (loss mask, and inside a packed segment).
    2. Under context parallelism only: one all-reduce over the CP group of the per-sequence valid counts
       (and Σd, where a sequence-level weight is normalized), so each sequence is counted once, on CP
       rank 0, and only when it has a valid token anywhere.
    3. Step-level sums: IS-weight sum and count (``normalize_weights``), Σ k3(old ‖ rollout)
       (``mismatch.skip_threshold``) — over the valid tokens whose old and rollout log-probs are finite (a NaN
       or ±inf one is left out, never summed: GRPOLoss drops that position and raises, or the step is skipped);
       with ``nonfinite.skip_step``, the valid positions with a non-finite input given here.
    4. ONE all-reduce over ``group`` (DP, or DP×CP) of [valid tokens, valid sequences, all sequences,
       micro-batches, positions, weight sum, weight count, k3 sum, non-finite positions] in float64 — and, for a group of more than
       one rank, the fingerprint of what every rank must hold alike (:mod:`mp_grpo.loss.fingerprint`: the
       LossConfig, the step id, ``same_on_all_ranks``), checked on the reduced lanes: ranks that disagree get a
       :class:`~mp_grpo.loss.fingerprint.RankDisagreementError` (every rank alike) and NaN counts.
    5. Only with ``entropy.top_quantile < 1``: all-gather of the valid tokens' finite entropies over ``group``
       (sizes, then the padded values, fp32 — fp64 for fp64 inputs) and their exact quantile — an exact
       quantile needs the values. Only with ``m2po.bound``: all-gather of the M2PO candidates' d² (float64) and
       the step's threshold (:mod:`mp_grpo.loss.m2po`) — likewise from the values.
    6. Only under pipeline parallelism (``pp_group``) with step-level quantities: the last stage computes
       them (3–5) and ONE broadcast over ``pp_group`` gives every stage the same values and decisions.
A host synchronization happens only in step 5 (variable sizes; there the fingerprint's verdict is read first, so
that ranks that disagree raise before a gather some of them would not join); the counts stay on the device.

**Wrong-step protection.** A GlobalBatch knows exactly which loss masks it was built from — by
identity, not by shape: it holds a reference to each mask (so their memory cannot be reused by other
tensors while the batch lives) and its in-place version counter. GRPOLoss (:meth:`check_micro_batch`) accepts
one of them, unmodified, or a copy with equal content, and rejects a mask of another step even of the same
shapes (:mod:`mp_grpo.loss.mask_identity`).
A batch records the caller's ``step`` id (:meth:`check_step` raises for another id), and a batch built
for another LossConfig is rejected. Across the ranks of ``group``, the step's all-reduce checks that every rank
built its batch alike (same LossConfig, step id and ``same_on_all_ranks``; see step 4).

**From counts.** :meth:`GlobalBatch.from_counts` takes the counts a training framework already made
(verl's ``global_batch_info``, NeMo-RL's ``global_valid_toks`` / ``global_valid_seqs``, Megatron-LM's
per-token-loss counts) and, where the config needs them, the step-level statistics its loop computed: no
mask, and a collective only to check that the ranks agree. Such a batch checks what counts can bound (a
micro-batch never has more valid tokens or sequences than the step); the checks of its inputs are in
:mod:`mp_grpo.loss.step_counts`.

**Unnormalized.** :meth:`GlobalBatch.unnormalized` is the account of a loop that divides by the step's count
itself, once, after the step (NeMo-RL's split-API trainers): N = S = 1, for objectives linear in that count.

Every rank of ``group`` must call the constructor (it makes collectives), with its own micro-batches.
Tensor-parallel ranks hold copies of the same tokens: ``group`` never includes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from mp_grpo.collectives import (
    ProcessGroup, all_gather_varlen, all_reduce_sum, broadcast_from_last, group_size, is_last_rank,
)
from mp_grpo.config.loss import LossConfig
from mp_grpo.loss.clamps import COUNT_FLOOR
from mp_grpo.loss.entropy import entropy_threshold
from mp_grpo.loss.fingerprint import Fingerprint, RankDisagreementError, fingerprint_items
from mp_grpo.loss.m2po import m2po_threshold, m2po_values
from mp_grpo.loss.mask_identity import StaleGlobalBatchError, check_known_mask
from mp_grpo.loss.sequence import SequenceLayout
from mp_grpo.loss.step_counts import (
    COUNTS, STEP_STATISTICS, check_counts, check_device, check_linear_in_counts, check_sequence_count,
    check_within_counts,
)
from mp_grpo.loss.step_inputs import (
    as_list, finite_log_ratios, is_weight_sums, k3_sum, nonfinite_positions, per_micro_batch, resolve_layouts,
    token_advantages,
)
from mp_grpo.ops.checks import check_errors


__all__ = ["GlobalBatch", "RankDisagreementError", "StaleGlobalBatchError"]

_NUM_COUNTS = 9
"""Lanes of step 4's all-reduce before the fingerprint's."""


@dataclass(frozen=True, eq=False)
class GlobalBatch:
    """Counts and decisions of one optimizer step over the data-parallel group (see the module docstring)."""

    valid_tokens: torch.Tensor
    """0-dim float64: valid tokens of the step, all ranks (N)."""
    valid_sequences: torch.Tensor
    """0-dim float64: sequences with at least one valid token, each counted once (S). NaN in a
    :meth:`from_counts` batch not given it (see ``missing_counts``)."""
    all_sequences: torch.Tensor
    """0-dim float64: every sequence (row / packed segment), each counted once (S with count_empty_sequences).
    NaN in a :meth:`from_counts` batch not given it."""
    num_micro_batches: torch.Tensor
    """0-dim float64: (rank, micro-batch) pairs of the step over the group (NaN in a :meth:`from_counts` batch
    not given it: the ``loss`` and ``valid_tokens`` metric entries then reduce to NaN)."""
    all_positions: torch.Tensor
    """0-dim float64: every token position of the micro-batches (masked or not, padding included), summed over
    the group's ranks — what a model runs on; the Megatron adapter's routed-token account for MoE (see
    ``mp_grpo.megatron.moe``). NaN in a :meth:`from_counts` batch."""
    micro_batch_shapes: tuple[tuple[int, ...], ...]
    """Token shapes of this rank's micro-batches, in order (empty for a :meth:`from_counts` batch)."""
    masks: tuple[torch.Tensor, ...] = ()
    """The loss masks the batch was built from (held, so their storage cannot be reused while it lives)."""
    mask_versions: tuple[int, ...] = ()
    """Each mask's in-place version counter when the batch was built."""
    step: int | None = None
    """The caller's optimizer-step id, if given (see :meth:`check_step`)."""
    config: LossConfig | None = None
    """The LossConfig the step-level quantities were computed for (None: counts only)."""
    weight_mean: torch.Tensor | None = None
    """0-dim float64: global mean of the truncated IS weights (``normalize_weights``)."""
    entropy_threshold: torch.Tensor | None = None
    """0-dim float64: entropy quantile below which the policy term is dropped (``top_quantile < 1``)."""
    mismatch_k3: torch.Tensor | None = None
    """0-dim float64: global mean of k3(old ‖ rollout) (``mismatch.skip_threshold``)."""
    skip: torch.Tensor | None = None
    """0-dim bool: skip this step (``mismatch_k3 > skip_threshold``, or with ``nonfinite.skip_step`` a non-finite
    input anywhere)."""
    nonfinite_inputs: torch.Tensor | None = None
    """0-dim float64 (``nonfinite.skip_step``): valid positions of the step, all ranks, with a NaN / ±inf input among
    those given to :meth:`from_rollouts` (or the count given to :meth:`from_counts`)."""
    m2po_threshold: torch.Tensor | None = None
    """0-dim float64 (``m2po.bound``): M2PO drops a candidate's policy term where d² ≥ this (+inf: none dropped;
    :mod:`mp_grpo.loss.m2po`)."""
    missing_counts: tuple[str, ...] = ()
    """Counts a :meth:`from_counts` batch was not given (NaN in their fields): ``valid_sequences``,
    ``all_sequences``, ``micro_batches``, ``all_positions``. :meth:`check_config` refuses a config that needs one."""
    normalized: bool = True
    """False for a batch of :meth:`unnormalized`: N = S = 1 stand in for counts the loop applies after the step."""

    # ------------------------------------------------------------------------------------------ build
    @classmethod
    def from_masks(
        cls,
        masks: Sequence[torch.Tensor],
        *,
        group: ProcessGroup | None = None,
        layouts: Sequence[SequenceLayout | None] | None = None,
        step: int | None = None,
        same_on_all_ranks: Mapping[str, object] | None = None,
    ) -> GlobalBatch:
        """Counts only: valid tokens and sequences over ``group`` from this rank's micro-batch loss masks.

        One all-reduce over ``group`` (plus one over the CP group of ``layouts`` under context parallelism).
        Enough for a LossConfig without step-level features (IS-weight normalization, top-entropy
        selection, mismatch skip); :meth:`from_rollouts` computes those too. ``same_on_all_ranks``: as in
        :meth:`from_rollouts`.
        """
        return cls._build(None, masks, group=group, layouts=layouts, step=step, same_on_all_ranks=same_on_all_ranks)

    @classmethod
    def from_rollouts(
        cls,
        config: LossConfig,
        masks: Sequence[torch.Tensor],
        *,
        old_logprobs: Sequence[torch.Tensor] | None = None,
        rollout_logprobs: Sequence[torch.Tensor] | None = None,
        entropies: Sequence[torch.Tensor] | None = None,
        group: ProcessGroup | None = None,
        layouts: Sequence[SequenceLayout | None] | None = None,
        step: int | None = None,
        pp_group: ProcessGroup | None = None,
        same_on_all_ranks: Mapping[str, object] | None = None,
        ref_logprobs: Sequence[torch.Tensor] | None = None,
        advantages: Sequence[torch.Tensor] | None = None,
    ) -> GlobalBatch:
        """Counts plus the step-level quantities ``config`` needs, decided identically on every rank.

        Args:
            config: the LossConfig of the GRPOLoss this batch will be used with.
            masks: this rank's micro-batch loss masks (nonzero = valid), in order.
            old_logprobs / rollout_logprobs: per micro-batch, needed by ``rollout_correction.normalize_weights``,
                ``mismatch.skip_threshold`` and ``m2po.bound`` (pass the loss the same old log-probs: M2PO compares
                each token's d with the step's threshold, both from these numbers).
            entropies: per micro-batch entropies of the policy at the start of the step (the old-log-prob
                pass), needed by ``entropy.top_quantile < 1``. GRPOLoss compares the entropies it is given
                with the resulting threshold; they are the same numbers on the step's first pass.
            group: the DP group (DP×CP under context parallelism); None: this process alone.
            layouts: per micro-batch :class:`SequenceLayout` (None: padded ``[B, T]``).
            step: an optimizer-step id to check later with :meth:`check_step`.
            pp_group: the pipeline-parallel group. Under pipeline parallelism only the last stage runs the
                loss and holds the old / rollout log-probs and entropies: there the step-level quantities are
                computed (the other stages need not pass them) and then broadcast over ``pp_group``
                (step 6), so every stage makes the same decisions (``skip_step`` above all: a stage that
                steps its optimizer while another does not hangs in the grad-norm collective).
            same_on_all_ranks: settings of the caller that every rank of ``group`` must hold alike, by name
                (values: None, bool, numbers, str, enums, dataclasses or tuples of them) — the Megatron adapter
                passes ``calculate_per_token_loss`` and the sampling temperature. Checked in step 4's all-reduce
                with ``config`` and ``step`` (:mod:`mp_grpo.loss.fingerprint`).
            ref_logprobs / advantages: per micro-batch (advantages per sequence ``[S]`` or per token), read
                with ``nonfinite.skip_step``: with it, every input given here (old, rollout and reference
                log-probs, advantages, entropies) is checked at the valid positions, and a NaN / ±inf anywhere in
                the group skips the step on every rank. An input not given is checked by GRPOLoss, which raises.
                ``m2po.scope=clip_quadrants`` needs the advantages (their sign picks M2PO's candidates).
        """
        if not isinstance(config, LossConfig):
            raise TypeError(f"config must be a LossConfig, got {type(config).__name__}")
        return cls._build(config, masks, group=group, layouts=layouts, step=step, old_logprobs=old_logprobs,
                          rollout_logprobs=rollout_logprobs, entropies=entropies, pp_group=pp_group,
                          same_on_all_ranks=same_on_all_ranks, ref_logprobs=ref_logprobs, advantages=advantages)

    @classmethod
    def from_counts(
        cls,
        *,
        valid_tokens: int | float | torch.Tensor,
        device: torch.device | str,
        valid_sequences: int | float | torch.Tensor | None = None,
        all_sequences: int | float | torch.Tensor | None = None,
        micro_batches: int | float | torch.Tensor | None = None,
        config: LossConfig | None = None,
        weight_mean: float | torch.Tensor | None = None,
        entropy_threshold: float | torch.Tensor | None = None,
        mismatch_k3: float | torch.Tensor | None = None,
        nonfinite_inputs: int | float | torch.Tensor | None = None,
        m2po_threshold: float | torch.Tensor | None = None,
        step: int | None = None,
        group: ProcessGroup | None = None,
        same_on_all_ranks: Mapping[str, object] | None = None,
    ) -> GlobalBatch:
        """The step's account from counts a training framework already made (no mask; one collective with
        ``group``).

        For loops that hand the loss global counts instead of the step's masks (verl's ``global_batch_info``,
        NeMo-RL's ``global_valid_toks`` / ``global_valid_seqs``, Megatron-LM's per-token-loss counts). The
        counts must be over the same group and step as :meth:`from_masks` would count them: every rank
        passes the same numbers.

        Args:
            valid_tokens: N, the step's valid (loss-mask) tokens over all ranks of the group.
            device: the device of the tokens (the counts become float64 0-dim tensors there).
            valid_sequences: sequences with at least one valid token, each counted once (S without
                ``aggregation.count_empty_sequences``).
            all_sequences: every sequence of the step, with or without a valid token (S with
                ``count_empty_sequences``; verl's ``global_batch_size``).
            micro_batches: (rank, micro-batch) pairs of the step; only the step totals among the metric entries
                use it — ``loss``, ``valid_tokens``, ``nonfinite_inputs`` (they reduce to NaN without it).
            config: the LossConfig the step-level statistics below were computed for; required with them.
            weight_mean: the global mean of the truncated IS weights, needed by
                ``rollout_correction.normalize_weights`` (what :meth:`from_rollouts` computes in its step 3).
            entropy_threshold: the entropy quantile of the step's valid tokens, needed by
                ``entropy.top_quantile < 1`` (:meth:`from_rollouts` step 5).
            mismatch_k3: the global mean over valid tokens of k3(old ‖ rollout), needed by
                ``mismatch.skip_threshold`` (:meth:`from_rollouts` step 3); ``skip`` follows from it.
            nonfinite_inputs: the step's valid positions, over all ranks, with a NaN / ±inf old / rollout /
                reference log-prob, advantage or entropy, needed by ``nonfinite.skip_step`` (a step with any is
                skipped); what :meth:`from_rollouts` counts in its step 3.
            m2po_threshold: M2PO's threshold on d² (+inf: nothing dropped), needed by ``m2po.bound``
                (:meth:`from_rollouts` step 5, :func:`mp_grpo.loss.m2po.m2po_threshold`).
            step: an optimizer-step id to check later with :meth:`check_step`.
            group: the group the counts are over (DP, or DP×CP). Given (more than one rank), ONE all-reduce checks
                that every rank passed the same counts and statistics bit for bit, the same ``config``, ``step`` and
                ``same_on_all_ranks`` (as :meth:`from_rollouts`; :mod:`mp_grpo.loss.fingerprint`):
                :class:`~mp_grpo.loss.fingerprint.RankDisagreementError` naming what differs otherwise, on every
                rank, and NaN counts. None: no collective, nothing compared.
            same_on_all_ranks: as in :meth:`from_rollouts` (checked with ``group``).

        Each value is a Python number or a 0-dim tensor on ``device``. Python numbers are checked at once;
        tensors on the device through the deferred error ledger (see :mod:`mp_grpo.loss.step_counts`): counts
        finite, ≥ 0 and whole; valid_sequences ≤ all_sequences and ≤ valid_tokens; a step with a valid token
        has a sequence; micro_batches ≥ 1; weight_mean > 0, mismatch_k3 ≥ 0, every statistic finite.
        A statistic is required exactly when ``config`` needs it. Without ``config`` the batch holds counts
        only, and :meth:`check_config` refuses a config that needs a step-level pass, naming the pass.

        Such a batch cannot know which micro-batches belong to its step (it has no masks):
        :meth:`check_micro_batch` checks what the counts bound — a micro-batch never has more valid tokens,
        or more rows with a valid token, than the step.
        """
        # --- 1. the values checked (types, the statistics config needs, their rules), as float64 tensors ---
        device = check_device(device)
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        if config is not None and not isinstance(config, LossConfig):
            raise TypeError(f"config must be a LossConfig or None, got {type(config).__name__}")
        values = check_counts(dict(
            valid_tokens=valid_tokens, valid_sequences=valid_sequences, all_sequences=all_sequences,
            micro_batches=micro_batches, weight_mean=weight_mean, entropy_threshold=entropy_threshold,
            mismatch_k3=mismatch_k3, nonfinite_inputs=nonfinite_inputs, m2po_threshold=m2po_threshold), device, config)

        # --- 2. the batch: NaN for the counts not given; skip from mismatch_k3 ---
        nan = torch.full((), float("nan"), dtype=torch.float64, device=device)
        missing = tuple(name for name in ("valid_sequences", "all_sequences", "micro_batches") if name not in values)
        # --- 3. with a group: one all-reduce of the fingerprint — every rank holds the same values ---
        ranks = group_size(group)
        if ranks > 1:
            names = (*COUNTS, *(stat.name for stat in STEP_STATISTICS))
            fingerprint = Fingerprint(fingerprint_items(config, LossConfig, step, same_on_all_ranks, built="counts"),
                                      device, {name: values.get(name, nan) for name in names})
            agree = fingerprint.verdict(all_reduce_sum(fingerprint.lanes, group), ranks)
            values = {name: torch.where(agree, v, nan) for name, v in values.items()}
        elif same_on_all_ranks is not None:
            fingerprint_items(config, LossConfig, step, same_on_all_ranks)  # its types checked all the same
        mismatch = values.get("mismatch_k3")
        skip = _skip(config, mismatch, values.get("nonfinite_inputs"))
        return cls(
            valid_tokens=values["valid_tokens"], valid_sequences=values.get("valid_sequences", nan),
            all_sequences=values.get("all_sequences", nan), num_micro_batches=values.get("micro_batches", nan),
            all_positions=nan, micro_batch_shapes=(), step=step, config=config,
            weight_mean=values.get("weight_mean"), entropy_threshold=values.get("entropy_threshold"),
            mismatch_k3=mismatch, skip=skip, nonfinite_inputs=values.get("nonfinite_inputs"),
            m2po_threshold=values.get("m2po_threshold"), missing_counts=(*missing, "all_positions"),
        )

    @classmethod
    def unnormalized(cls, *, device: torch.device | str, step: int | None = None) -> GlobalBatch:
        """The account of a loop that normalizes once per step, after its micro-batches: N = S = 1.

        Each share is then the micro-batch's unnormalized sum Σ_t c_t / D_t(N = S = 1) (see
        :mod:`mp_grpo.loss.aggregation`), and the loop multiplies the summed gradients (and the shares) by 1/N
        for ``aggregation.mode=token_mean``, by 1/S for the seq_mean modes — NeMo-RL's split-API trainers, which
        call their loss with placeholder counts of 1 and rescale once per optimizer step. The result equals the
        shares of :meth:`from_counts` with the step's counts when the objective is linear in that one count;
        :meth:`check_config` refuses a config for which it is not (``step_counts.nonlinear_in_counts``: the
        step-level statistics, the positive-example NLL's own divisor, a regularizer mode dividing by the other
        count). The counts bound no micro-batch: :meth:`check_micro_batch` checks only its type and device.
        """
        device = check_device(device)
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        one = torch.ones((), dtype=torch.float64, device=device)
        nan = torch.full((), float("nan"), dtype=torch.float64, device=device)
        return cls(valid_tokens=one, valid_sequences=one, all_sequences=one, num_micro_batches=nan, all_positions=nan,
                   micro_batch_shapes=(), step=step, missing_counts=("micro_batches", "all_positions"),
                   normalized=False)

    @classmethod
    def _build(
        cls,
        config: LossConfig | None,
        masks: Sequence[torch.Tensor],
        *,
        group: ProcessGroup | None,
        layouts: Sequence[SequenceLayout | None] | None,
        step: int | None,
        old_logprobs: Sequence[torch.Tensor] | None = None,
        rollout_logprobs: Sequence[torch.Tensor] | None = None,
        entropies: Sequence[torch.Tensor] | None = None,
        pp_group: ProcessGroup | None = None,
        same_on_all_ranks: Mapping[str, object] | None = None,
        ref_logprobs: Sequence[torch.Tensor] | None = None,
        advantages: Sequence[torch.Tensor] | None = None,
    ) -> GlobalBatch:
        # --- 1. check the micro-batches; valid tokens of each ---
        masks = as_list("masks", masks)
        if not masks:
            raise ValueError("masks must hold this rank's loss mask of at least one micro-batch")
        resolved = resolve_layouts(layouts, len(masks))
        cp_group = resolved[0].cp_group
        shapes = []
        valid = []
        for i, (mask, layout) in enumerate(zip(masks, resolved)):
            if not isinstance(mask, torch.Tensor):
                raise TypeError(f"masks[{i}] must be a tensor, got {type(mask).__name__}")
            layout.check_tokens(mask.shape, f"masks[{i}]")
            shapes.append(tuple(mask.shape))
            valid.append(layout.valid_tokens(mask))
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        ranks = group_size(group)
        fingerprint = None
        if ranks > 1:  # built before any collective: a bad same_on_all_ranks fails on its rank alone, at once
            fingerprint = Fingerprint(fingerprint_items(config, LossConfig, step, same_on_all_ranks), masks[0].device)
        elif same_on_all_ranks is not None:
            fingerprint_items(config, LossConfig, step, same_on_all_ranks)  # its types checked all the same
        decides_here = is_last_rank(pp_group)  # the last pipeline stage decides; the others receive (step 6)
        wants_weight_mean = config is not None and config.rollout_correction.normalize_weights
        wants_skip = config is not None and config.mismatch.skip_threshold is not None
        wants_entropy = config is not None and config.entropy.top_quantile < 1.0
        wants_nonfinite = config is not None and config.nonfinite.skip_step
        wants_m2po = config is not None and config.m2po.bound is not None
        needs_weight_mean, needs_skip, needs_entropy, needs_nonfinite, needs_m2po = (
            decides_here and wants_weight_mean, decides_here and wants_skip, decides_here and wants_entropy,
            decides_here and wants_nonfinite, decides_here and wants_m2po)
        old = rollout = None
        if needs_weight_mean or needs_skip or needs_m2po:
            why = ("rollout_correction.normalize_weights" if needs_weight_mean else
                   "mismatch.skip_threshold" if needs_skip else "m2po.bound")
            old = per_micro_batch("old_logprobs", old_logprobs, shapes, why)
            rollout = per_micro_batch("rollout_logprobs", rollout_logprobs, shapes, why)
        ents = per_micro_batch("entropies", entropies, shapes, "entropy.top_quantile < 1") if needs_entropy else None
        device = masks[0].device
        clamp = config.policy.log_ratio_clamp if config is not None else None
        nonfinite = torch.zeros((), dtype=torch.float64, device=device)
        if needs_nonfinite:
            nonfinite = nonfinite_positions(valid, resolved, shapes, old_logprobs=old_logprobs,
                                            rollout_logprobs=rollout_logprobs, ref_logprobs=ref_logprobs,
                                            advantages=advantages, entropies=entropies)
        # d = old − rollout (float64) where both are finite: the step-level sums never read a NaN or inf
        ds, summed = finite_log_ratios(old, rollout, valid, clamp) if old is not None else (None, None)
        m2po_local = None
        if needs_m2po:  # d² of this rank's M2PO candidates (their sign needs the advantages with clip_quadrants)
            advs = (token_advantages(advantages, resolved, shapes) if advantages is not None
                    else [None] * len(shapes))
            m2po_local = torch.cat([m2po_values(config.m2po, d, a, f)  # type: ignore[union-attr]
                                    for d, a, f in zip(ds, advs, summed)])  # type: ignore[arg-type]

        # --- 2. per-sequence valid counts (and Σd), whole sequences: one all-reduce over the CP group ---
        per_seq = []
        for i, (v, layout) in enumerate(zip(valid, resolved)):
            cols = [v.to(torch.float64)] + ([ds[i].to(torch.float64)] if ds is not None else [])
            per_seq.append(layout.local_seq_sum(torch.stack(cols, -1), v.shape))
        sizes = [p.shape[0] for p in per_seq]
        per_seq = list(all_reduce_sum(torch.cat(per_seq), cp_group).split(sizes))
        owner = 1.0 if resolved[0].owns_sequences else 0.0

        # --- 3. local sums: counts, IS-weight sum and count, k3 sum ---
        tokens = sum(v.sum(dtype=torch.float64) for v in valid)
        valid_seqs = owner * sum((p[:, 0] > 0).sum(dtype=torch.float64) for p in per_seq)
        all_seqs = torch.full((), owner * sum(sizes), dtype=torch.float64, device=device)  # fills: no host copy
        zero = torch.zeros((), dtype=torch.float64, device=device)
        w_sum, w_count = (is_weight_sums(config.rollout_correction, ds, summed, per_seq, owner, clamp)  # type: ignore[union-attr,arg-type]
                          if needs_weight_mean else (zero, zero))
        k3_total = k3_sum(ds, summed) if needs_skip else zero  # type: ignore[arg-type]

        # --- 4. the one all-reduce over the group, with the fingerprint; its verdict ---
        local = torch.stack([
            tokens, valid_seqs, all_seqs, torch.full((), float(len(masks)), dtype=torch.float64, device=device),
            torch.full((), float(sum(m.numel() for m in masks)), dtype=torch.float64, device=device),
            w_sum, w_count, k3_total, nonfinite,
        ]).to(torch.float64)
        if fingerprint is not None:
            local = torch.cat([local, fingerprint.lanes])
        totals = all_reduce_sum(local, group)
        counts = totals[:_NUM_COUNTS]
        agree = None
        if fingerprint is not None:
            agree = fingerprint.verdict(totals[_NUM_COUNTS:], ranks)
            counts = torch.where(agree, counts, torch.full((), float("nan"), dtype=torch.float64, device=device))
        n_tokens, n_valid_seqs, n_all_seqs, n_mbs, n_positions, w_sum, w_count, k3_total, nonfinite = counts.unbind()
        weight_mean = w_sum / w_count.clamp(min=COUNT_FLOOR) if needs_weight_mean else None
        mismatch_k3 = k3_total / n_tokens.clamp(min=COUNT_FLOOR) if needs_skip else None
        nonfinite = nonfinite if needs_nonfinite else None
        skip = _skip(config, mismatch_k3, nonfinite)

        # --- 5. the entropy quantile over every valid token of the group; M2PO's threshold over its candidates ---
        if (needs_entropy or needs_m2po) and agree is not None and not bool(agree):  # a sync step 5 makes anyway:
            check_errors()  # raise before a gather that ranks built for another config would not join
        m2po = None
        if needs_m2po:
            m2po = m2po_threshold(all_gather_varlen(m2po_local, group), config.m2po.bound)  # type: ignore[union-attr,arg-type]
        threshold = None
        if needs_entropy:
            dtype = torch.float64 if any(e.dtype == torch.float64 for e in ents) else torch.float32  # type: ignore[union-attr]
            local = torch.cat([e.detach()[v & torch.isfinite(e)].to(dtype) for e, v in zip(ents, valid)])  # type: ignore[arg-type]
            threshold = entropy_threshold(all_gather_varlen(local, group), config.entropy.top_quantile)  # type: ignore[union-attr]

        # --- 6. pipeline parallelism: the last stage's decisions on every stage (one broadcast over PP) ---
        if group_size(pp_group) > 1 and (wants_weight_mean or wants_skip or wants_entropy or wants_nonfinite
                                         or wants_m2po):
            nan = torch.full((), float("nan"), dtype=torch.float64, device=device)
            mine = torch.stack([
                weight_mean if weight_mean is not None else nan, mismatch_k3 if mismatch_k3 is not None else nan,
                threshold.to(torch.float64) if threshold is not None else nan,
                nonfinite if nonfinite is not None else nan, m2po if m2po is not None else nan,
            ])
            weight_mean, mismatch_k3, decided_threshold, nonfinite, m2po = broadcast_from_last(mine, pp_group).unbind()
            m2po = m2po if wants_m2po else None
            weight_mean = weight_mean if wants_weight_mean else None
            mismatch_k3 = mismatch_k3 if wants_skip else None
            nonfinite = nonfinite if wants_nonfinite else None
            skip = _skip(config, mismatch_k3, nonfinite)
            threshold = decided_threshold if wants_entropy else None

        return cls(
            valid_tokens=n_tokens, valid_sequences=n_valid_seqs, all_sequences=n_all_seqs, num_micro_batches=n_mbs,
            all_positions=n_positions, micro_batch_shapes=tuple(shapes), masks=tuple(masks), mask_versions=tuple(m._version for m in masks),
            step=step, config=config, weight_mean=weight_mean,
            entropy_threshold=threshold, mismatch_k3=mismatch_k3, skip=skip, nonfinite_inputs=nonfinite,
            m2po_threshold=m2po,
        )

    # ------------------------------------------------------------------------------------------ use
    def sequences(self, count_empty: bool) -> torch.Tensor:
        """S: every sequence when ``count_empty``, else those with a valid token."""
        return self.all_sequences if count_empty else self.valid_sequences

    def skip_step(self) -> bool:
        """Whether the step is skipped — by the mismatch monitor, or with ``nonfinite.skip_step`` for a non-finite
        input (one host read): then skip ``optimizer.step()`` too (the same decision on every rank).

        Also raises any input error recorded on the device during the step (:func:`mp_grpo.check_errors`).
        """
        check_errors()
        return bool(self.skip) if self.skip is not None else False

    def check_step(self, step: int) -> None:
        """Raise :class:`StaleGlobalBatchError` unless this batch was built with ``step=step``."""
        if self.step is None:
            raise StaleGlobalBatchError("this GlobalBatch was built without a step id; pass step= to its constructor")
        if self.step != step:
            raise StaleGlobalBatchError(f"this GlobalBatch belongs to step {self.step}, not to step {step}")

    def check_micro_batch(self, loss_mask: torch.Tensor, name: str = "loss_mask") -> None:
        """Raise :class:`StaleGlobalBatchError` unless ``loss_mask`` is one of the masks the batch was built from.

        The same tensor (storage, shape, strides, device; not modified in place since) passes at once. Another
        tensor of one of their shapes must equal one of them: compared on the device, raised at once on the
        CPU and at the next :func:`mp_grpo.check_errors` on a GPU (no host read here).

        A :meth:`from_counts` batch has no masks: ``loss_mask`` must fit in the step's counts — its valid
        tokens at most ``valid_tokens``; its rows with a valid token (a 2-D mask) at most ``valid_sequences``
        and ``all_sequences`` where given (a row of a padded, packed or CP-sharded mask holds at least one
        sequence). Counted on the device, reported the same deferred way.
        """
        if not isinstance(loss_mask, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(loss_mask).__name__}")
        if loss_mask.device != self.valid_tokens.device:
            raise ValueError(f"batch.valid_tokens is on {self.valid_tokens.device} but {name} is on {loss_mask.device}: "
                             "build the GlobalBatch on the tokens' device")
        if not self.normalized:  # placeholder counts bound nothing
            return
        if not self.masks:  # built from counts: what the counts bound
            bounds = {field: getattr(self, field) for field in ("valid_tokens", "valid_sequences", "all_sequences")
                      if field not in self.missing_counts}
            check_within_counts(loss_mask, name, bounds, StaleGlobalBatchError)
            return
        check_known_mask(loss_mask, name, self.masks, self.mask_versions, self.micro_batch_shapes)

    def check_config(self, config: LossConfig) -> None:
        """Raise unless this batch holds the step-level quantities ``config`` needs, computed for ``config``
        (and, for a :meth:`from_counts` batch, the sequence count its aggregation divides by); for an
        :meth:`unnormalized` batch, that ``config``'s objective is linear in the count the loop divides by."""
        if not self.normalized:
            check_linear_in_counts(config, "batch (GlobalBatch.unnormalized)")
            return
        if self.config is None:
            needs = [stat for stat in STEP_STATISTICS if stat.needed(config)]
            if needs and self.masks:
                raise StaleGlobalBatchError(
                    f"batch: the LossConfig needs step-level quantities ({', '.join(s.key for s in needs)}); build the "
                    "GlobalBatch with GlobalBatch.from_rollouts(config, ...), not from_masks"
                )
            if needs:
                passes = "; ".join(f"{s.key} needs {s.name} ({s.computes})" for s in needs)
                raise StaleGlobalBatchError(
                    f"batch: the LossConfig needs step-level passes this GlobalBatch was built without: {passes}. "
                    "Pass them with GlobalBatch.from_counts(config=config, ...), or build it with "
                    "GlobalBatch.from_rollouts"
                )
        elif self.config is not config and self.config != config:  # identity first: this runs every micro-batch
            raise StaleGlobalBatchError("batch: this GlobalBatch was built for a different LossConfig")
        if self.missing_counts:
            check_sequence_count(config, self.missing_counts, StaleGlobalBatchError)


def _skip(config: LossConfig | None, mismatch_k3: torch.Tensor | None, nonfinite: torch.Tensor | None) -> torch.Tensor | None:
    """The step's skip flag from the mismatch monitor and the non-finite count (None when the config has neither)."""
    flags = []
    if mismatch_k3 is not None:
        flags.append(mismatch_k3 > config.mismatch.skip_threshold)  # type: ignore[union-attr]
    if nonfinite is not None:
        flags.append(nonfinite != 0)  # NaN (ranks that disagree) skips too
    if not flags:
        return None
    return flags[0] if len(flags) == 1 else flags[0] | flags[1]
