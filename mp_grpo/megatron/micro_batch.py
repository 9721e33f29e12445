"""One micro-batch on one rank: the model's inputs and the loss's logit-aligned fields, cut as Megatron cuts them.

Schedule of :func:`prepare_micro_batch` (every rank of a DP replica starts from the same :class:`Rollouts`)

1. Layout: padded rows (length rounded up to a multiple of 2·CP, times TP with sequence parallelism),
   or one packed THD row (each segment padded to a multiple of 2·CP; :class:`PackedLayout`).
2. Context parallel: the positions this rank keeps — chunks r and 2·CP−1−r of every row (padded) or of
   every segment (packed), as Megatron's ``get_batch_on_this_cp_rank`` / TE's ``thd_get_partitioned_indices``.
3. The loss's :class:`~mp_grpo.loss.sequence.SequenceLayout`: rows, or this rank's segment boundaries
   ``cu_seqlens_padded / CP``, with the CP group so per-sequence sums cover whole sequences.
4. Fields (:class:`TokenLayout`): model inputs are laid out and cut as they are. The logits at position s
   predict token s+1, so every per-token loss field first moves one left within its sequence (the
   target of position s is ``tokens[s+1]``; a sequence's last position has no target) — on whole
   sequences, before the CP cut, so that a chunk's last target, the first token of the next chunk and
   usually on another CP rank, is right. Positions not trained on get target ``ignore_index``: the
   log-prob kernel gives them 0 with no gradient. The rollout engine's per-token id lists — its captured support,
   its top-K ids and log-probs (CSR) — are cut alike (:mod:`mp_grpo.megatron.token_csr`).
5. The loss rows (:attr:`MicroBatch.loss_rows`): the flat positions of this rank's loss mask, found on the host
   (where the rollouts are), so that the output layer can run on them alone (``OutputRows.LOSS``) without a host
   read in the micro-batch loop. Under CP each rank holds the rows of its own chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from mp_grpo.collectives import ProcessGroup, group_rank, group_size
from mp_grpo.config.job import SequenceFormat
from mp_grpo.loss.sequence import PackedSequences, PaddedSequences, SequenceLayout
from mp_grpo.megatron.context_parallel import cp_positions, select_positions, thd_cp_positions
from mp_grpo.megatron.packed import PackedLayout, packed_seq_params, round_up
from mp_grpo.megatron.rollouts import Rollouts
from mp_grpo.megatron.token_csr import lay_out_csr
from mp_grpo.ops.captured_support import check_captured_support
from mp_grpo.ops.loss_rows import loss_rows
from mp_grpo.ops.sampling_filter import SamplingFilter, check_sampling_filter
from mp_grpo.ops.token_ids import CapturedSupport, TokenIds, check_token_ids

IGNORE_INDEX = -100
"""Target of positions that are not trained on (the log-prob kernel's default ``ignore_index``)."""


@dataclass(frozen=True)
class TokenLayout:
    """How token-aligned ``[B, S]`` fields of one micro-batch become this rank's local tensors."""

    row_len: int
    """Length of the full (pre-CP) row: padded rows' length, or the packed row's length T."""
    packed: PackedLayout | None
    """Segment boundaries (packed format only)."""
    positions: torch.Tensor
    """Positions along the row (padded: of ``padded_len``; packed: of the packed row) this CP rank holds."""

    def input_field(self, x: torch.Tensor, fill: float | int | bool) -> torch.Tensor:
        """A token-aligned ``[B, S, ...]`` field as the model sees it on this rank (laid out and CP-cut, no shift).

        ``S`` may be any width that holds every sequence: padded rows are cut or padded to ``row_len`` (the
        positions past the longest sequence are padding either way).
        """
        if self.packed is not None:
            row = self.packed.pack(x, fill).unsqueeze(0)
        else:
            x = x[:, : self.row_len]
            pad = self.row_len - x.shape[1]
            row = torch.cat([x, x.new_full((x.shape[0], pad, *x.shape[2:]), fill)], dim=1) if pad else x
        return select_positions(row, self.positions.to(x.device), seq_dim=1)

    def target_field(self, x: torch.Tensor, fill: float | int | bool) -> torch.Tensor:
        """A token-aligned ``[B, S, ...]`` field moved to the logit that predicts it (shifted, laid out, CP-cut)."""
        shifted = torch.cat([x[:, 1:], x.new_full((x.shape[0], 1, *x.shape[2:]), fill)], dim=1)
        return self.input_field(shifted, fill)


@dataclass(frozen=True)
class RolloutTopK:
    """The rollout engine's top-K ids of every token and its log-probs at them (what a top-K divergence between the
    trainer's policy and the engine's compares; DPPO's top-K TV / KL), CSR over the tokens (vLLM's layout)."""

    ids: TokenIds
    """Each token's top-K ids (any order)."""
    logprobs: torch.Tensor
    """``[nnz]`` float: the engine's log-probs at ``ids.ids``, aligned with them."""

    def __post_init__(self) -> None:
        if not isinstance(self.ids, TokenIds):
            raise TypeError(f"rollout_top_k.ids must be a mp_grpo.TokenIds, got {type(self.ids).__name__}")
        x = self.logprobs
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.shape != self.ids.ids.shape:
            got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"rollout_top_k.logprobs must be a float tensor aligned with the ids, "
                             f"[{self.ids.nnz}], got {got}")
        if x.device != self.ids.ids.device:
            raise ValueError(f"rollout_top_k.logprobs is on {x.device} but its ids are on {self.ids.ids.device}")

    def to(self, device: torch.device | str) -> RolloutTopK:
        return RolloutTopK(self.ids.to(device), self.logprobs.to(device))


@dataclass(frozen=True)
class MicroBatch:
    """This rank's share of one micro-batch: model inputs and the loss's fields, all ``[b, s_local]``."""

    input_ids: torch.Tensor
    """``[B, S_local]`` (padded) or ``[1, T_local]`` (packed) int64 model input."""
    position_ids: torch.Tensor
    """Same shape: positions within each sequence."""
    packed_seq_params: object | None
    """Megatron ``PackedSeqParams`` (``thd``) for a packed micro-batch, else None."""
    targets: torch.Tensor
    """Same shape: the token each logit position predicts, ``IGNORE_INDEX`` where not trained on."""
    loss_mask: torch.Tensor
    """Same shape, bool: positions whose target is trained on."""
    advantages: torch.Tensor
    """``[num_sequences]`` per-sequence advantages, or per token in the local shape."""
    rollout_logprobs: torch.Tensor | None
    """Local logit-aligned rollout-engine log-probs of the targets, or None."""
    old_logprobs: torch.Tensor | None
    """Local logit-aligned old log-probs, or None (on-policy)."""
    ref_logprobs: torch.Tensor | None
    """Local logit-aligned reference log-probs, or None."""
    sequences: SequenceLayout
    """Which local positions form which sequence, with the CP group."""
    layout: TokenLayout
    """How further token-aligned fields are cut the same way (:meth:`TokenLayout.target_field`)."""
    routing: tuple[torch.Tensor, ...] | None = None
    """Routing replay (MoE): the recorded top-k expert indices of this micro-batch, one tensor per MoE layer of
    this pipeline stage, in megatron-core ``RouterReplay``'s layout (``[tokens, topk]`` in the model's token
    order); set with :meth:`with_routing`. None: the routers decide."""
    sampling_filter: SamplingFilter | None = None
    """The rollout's sampling filter (vLLM's per-request ``top_k`` / ``top_p`` / ``min_p``), replayed by the
    log-prob op: the trainer's log-probs are then those of the filtered, renormalized distribution the
    rollout sampled from. Per-row tensors have the local shape of :attr:`targets`; set with
    :meth:`with_sampling_filter`, which also takes per-sequence values. None: the whole vocabulary.
    Checked against :attr:`targets` whenever a MicroBatch is made (its boundary): ``MegatronGRPO.loss_func`` and
    the log-prob ops it calls trust it."""
    loss_rows: torch.Tensor | None = None
    """``[K]`` int64 ascending positions of ``loss_mask.reshape(-1)`` that are trained on: the rows the output layer
    computes under ``OutputRows.LOSS`` (:func:`mp_grpo.ops.loss_rows.loss_rows`). None when the MicroBatch is made:
    taken from :attr:`loss_mask` then — :func:`prepare_micro_batch` makes it on the host, where it costs no
    synchronization; a MicroBatch made from a mask already on a GPU pays one host read there, at data preparation,
    never in the micro-batch loop. Copies (``dataclasses.replace``, :meth:`with_logprobs`, ...) keep it: a mask made
    smaller afterwards (the main job's boundary rule) leaves rows without a target, which cost their share of the
    GEMMs and change nothing; a trained position outside the rows is an error (``MegatronGRPO`` reports it, and its
    log-prob is NaN meanwhile)."""
    captured_support: CapturedSupport | None = None
    """The rollout engine's captured support of every token (vLLM's ``SamplingMask``): the log-prob ops replay it —
    each token's log-prob, entropy and gradient of its distribution renormalized over the ids it was sampled from
    (``mp_grpo/ops/captured_support.py``). CSR over the flattened local :attr:`targets`; set with
    :meth:`with_captured_support`, which takes it over the rollout's tokens and cuts it as every token field. Not
    with :attr:`sampling_filter` (the support is what the engine's filter kept). Its values are checked by the ops
    (``check_inputs``)."""
    rollout_top_k: RolloutTopK | None = None
    """The rollout engine's top-K ids and log-probs of every token, CSR over the flattened local :attr:`targets`; set
    with :meth:`with_rollout_top_k`. ``MegatronGRPO.loss_func`` then takes the trainer's log-probs at the same ids in
    the forward of its log-prob op (``[nnz]`` fp32 aligned with ``rollout_top_k.ids``) for the loss's top-K
    divergence."""

    def __post_init__(self) -> None:
        if self.sampling_filter is not None:
            check_sampling_filter(self.sampling_filter, self.targets.shape, self.targets.device, check_tensors=True)
        if self.loss_rows is None:
            object.__setattr__(self, "loss_rows", loss_rows(self.loss_mask))
        elif (not isinstance(self.loss_rows, torch.Tensor) or self.loss_rows.dim() != 1
              or self.loss_rows.dtype != torch.int64 or self.loss_rows.device != self.loss_mask.device):
            got = (f"{tuple(self.loss_rows.shape)} {self.loss_rows.dtype} on {self.loss_rows.device}"
                   if isinstance(self.loss_rows, torch.Tensor) else type(self.loss_rows).__name__)
            raise ValueError(f"loss_rows must be a [K] int64 tensor on the loss mask's device ({self.loss_mask.device}), "
                             f"got {got}")
        if self.captured_support is not None:
            check_captured_support(self.captured_support, self.targets.shape, self.targets.device, self.sampling_filter)
        if self.rollout_top_k is not None:
            if not isinstance(self.rollout_top_k, RolloutTopK):
                raise TypeError(f"rollout_top_k must be a RolloutTopK, got {type(self.rollout_top_k).__name__}")
            check_token_ids(self.rollout_top_k.ids, "rollout_top_k.ids", self.targets.shape, self.targets.device)

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy with every tensor on ``device``: ``packed_seq_params``' boundaries and the loss layout's
        ``cu_seqlens`` included, so that nothing in the micro-batch loop copies from the host (one blocking
        host-to-device copy per packed micro-batch otherwise). Build the step's GlobalBatch afterwards, from
        the moved micro-batches."""
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        params = self.packed_seq_params
        if params is not None:
            params = replace(params, **{f.name: getattr(params, f.name).to(device) for f in fields(params)
                                        if isinstance(getattr(params, f.name), torch.Tensor)})
        routing = None if self.routing is None else tuple(r.to(device) for r in self.routing)
        sequences = self.sequences
        if isinstance(sequences, PackedSequences):
            sequences = PackedSequences(sequences.cu_seqlens.to(device), cp_group=sequences.cp_group)
        filt = self.sampling_filter
        if filt is not None:
            filt = SamplingFilter(**{name: getattr(filt, name).to(device) if isinstance(getattr(filt, name), torch.Tensor)
                                     else getattr(filt, name) for name in ("top_k", "top_p", "min_p")})
        support = None if self.captured_support is None else self.captured_support.to(device)
        top_k = None if self.rollout_top_k is None else self.rollout_top_k.to(device)
        return replace(self, packed_seq_params=params, sequences=sequences, routing=routing, sampling_filter=filt,
                       captured_support=support, rollout_top_k=top_k, **moved)

    def with_sampling_filter(
        self,
        *,
        top_k: int | torch.Tensor | None = None,
        top_p: float | torch.Tensor | None = None,
        min_p: float | torch.Tensor | None = None,
    ) -> MicroBatch:
        """A copy that replays the rollout's sampling filter (see :attr:`sampling_filter`).

        Each value is None (off), a Python number for every token, a ``[num_sequences]`` tensor (one value per
        request of the micro-batch, as vLLM's per-request ``SamplingParams``: laid out, packed and CP-cut like
        every token field; positions without a target get the value that keeps everything), or a tensor of
        the local shape of :attr:`targets`. vLLM's "off" values (``top_k = 0 / -1``, ``top_p = 1``,
        ``min_p = 0``) switch a request's filter off.
        """
        off = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}
        values = {}
        for name, value in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
            if isinstance(value, torch.Tensor) and value.shape != self.targets.shape:
                if value.dim() != 1:
                    raise ValueError(f"{name} must be [num_sequences] or the local shape {tuple(self.targets.shape)}, "
                                     f"got {tuple(value.shape)}")
                packed = self.layout.packed
                if packed is not None and value.shape[0] != packed.num_sequences:
                    raise ValueError(f"{name} has {value.shape[0]} values but the micro-batch holds "
                                     f"{packed.num_sequences} sequences")
                width = int(packed.lengths.max()) if packed is not None else self.layout.row_len
                value = self.layout.target_field(value.unsqueeze(1).expand(value.shape[0], width), off[name])
                if value.shape != self.targets.shape:
                    raise ValueError(f"{name} has {value.shape[0]} values but the micro-batch holds "
                                     f"{self.targets.shape[0]} sequences")
            values[name] = value
        return replace(self, sampling_filter=SamplingFilter(**values))  # checked by __post_init__

    def with_captured_support(self, support: CapturedSupport) -> MicroBatch:
        """A copy that replays the rollout engine's captured support (see :attr:`captured_support`).

        ``support``: CSR over the micro-batch's rollout tokens, token-aligned like :class:`Rollouts`' fields —
        row-major over ``[num_sequences, S]`` (``S`` any width that holds every sequence; vLLM returns one support per
        generated token: prompt and padding tokens have none) —, token s's ids the set the engine drew token s from.
        Each token's support moves to the logit that predicts it and is laid out, packed and CP-cut as every token
        field (:func:`~mp_grpo.megatron.token_csr.lay_out_csr`; its local size read once on the host)."""
        if not isinstance(support, CapturedSupport):
            raise TypeError(f"support must be a mp_grpo.CapturedSupport, got {type(support).__name__}")
        indptr, ids = lay_out_csr(self.layout, support.indptr, self._num_sequences(), "captured_support", support.ids)
        return replace(self, captured_support=CapturedSupport(indptr, ids))  # checked by __post_init__

    def with_rollout_top_k(self, ids: TokenIds, logprobs: torch.Tensor) -> MicroBatch:
        """A copy carrying the rollout engine's top-K ids and log-probs (see :attr:`rollout_top_k`): ``ids`` CSR over
        the micro-batch's rollout tokens, token-aligned as in :meth:`with_captured_support`, ``logprobs`` ``[nnz]``
        the engine's log-probs at them (token s's top-K of the distribution it was drawn from); laid out and cut
        alike."""
        if not isinstance(ids, TokenIds):
            raise TypeError(f"ids must be a mp_grpo.TokenIds, got {type(ids).__name__}")
        RolloutTopK(ids, logprobs)  # the types and the alignment, named
        indptr, local_ids, local_logprobs = lay_out_csr(self.layout, ids.indptr, self._num_sequences(),
                                                        "rollout_top_k.ids", ids.ids, logprobs)
        return replace(self, rollout_top_k=RolloutTopK(TokenIds(indptr, local_ids), local_logprobs))

    def _num_sequences(self) -> int:
        return self.layout.packed.num_sequences if self.layout.packed is not None else self.targets.shape[0]

    def with_routing(self, routing) -> MicroBatch:
        """A copy that replays ``routing`` (recorded top-k indices, one tensor per MoE layer; see :attr:`routing`).

        The rows are the tokens in the order the router of this rank sees them: Megatron's ``[S, B]``
        flattened (sequence-major, ``s * B + b``) of this rank's CP chunk and, with sequence parallelism, of its
        TP shard — what ``RouterReplay.get_recorded_data()`` returns after a ``RouterReplayAction.RECORD``
        pass on the same micro-batch. ``MegatronGRPO``'s forward step and ``forward_logprobs`` hand them to
        megatron-core's ``RouterReplay`` (megatron-core ≥ 0.16, ``moe_enable_routing_replay=True``) and switch
        the routers to ``REPLAY_FORWARD`` before calling the model; ``MegatronGRPO.reduce_metrics`` (and
        ``forward_logprobs`` at its end) clears the replay state. See ``docs/megatron.md``, "Mixture of experts"."""
        routing = tuple(routing)
        for i, r in enumerate(routing):
            if not isinstance(r, torch.Tensor) or r.dtype not in (torch.int32, torch.int64) or r.dim() != 2:
                raise ValueError(f"routing[{i}] must be a [tokens, topk] integer tensor of expert indices")
        return replace(self, routing=routing)

    def with_logprobs(
        self, *, old_logprobs: torch.Tensor | None = None, rollout_logprobs: torch.Tensor | None = None
    ) -> MicroBatch:
        """A copy with local logit-aligned old / rollout log-probs set (e.g. from a trainer recompute)."""
        for name, x in (("old_logprobs", old_logprobs), ("rollout_logprobs", rollout_logprobs)):
            if x is not None and x.shape != self.targets.shape:
                raise ValueError(f"{name} must have the local shape {tuple(self.targets.shape)}, got {tuple(x.shape)}")
        return replace(
            self,
            old_logprobs=self.old_logprobs if old_logprobs is None else old_logprobs,
            rollout_logprobs=self.rollout_logprobs if rollout_logprobs is None else rollout_logprobs,
        )


def prepare_micro_batch(
    rollouts: Rollouts,
    *,
    sequence_format: SequenceFormat = SequenceFormat.PADDED,
    cp_group: ProcessGroup | None = None,
    sequence_parallel_size: int = 1,
    seq_len: int | None = None,
) -> MicroBatch:
    """This rank's :class:`MicroBatch` of ``rollouts`` (see the module docstring for the schedule).

    Args:
        rollouts: the whole micro-batch, token-aligned (the same on every TP / CP rank of a DP replica).
        sequence_format: padded rows or one packed THD row.
        cp_group: the context-parallel group (None: no context parallelism).
        sequence_parallel_size: the TP size when Megatron's sequence parallelism is on (each CP rank's
            row must then split evenly over the TP ranks), else 1.
        seq_len: padded format only: pad rows to this length (a fixed length, e.g. for pipeline
            parallelism); None pads to the longest sequence. Rounded up to the multiple CP / SP need.
    """
    if not isinstance(rollouts, Rollouts):
        raise TypeError(f"rollouts must be a Rollouts, got {type(rollouts).__name__}")
    sequence_format = SequenceFormat(sequence_format)
    cp, cp_rank = group_size(cp_group), group_rank(cp_group)
    if sequence_parallel_size < 1:
        raise ValueError(f"sequence_parallel_size must be ≥ 1, got {sequence_parallel_size}")
    multiple = 2 * cp * sequence_parallel_size if cp > 1 else sequence_parallel_size

    # --- 1. layout ---
    packed: PackedLayout | None = None
    if sequence_format == SequenceFormat.PACKED:
        if seq_len is not None:
            raise ValueError("seq_len is only used by the padded format; packed rows take the lengths as they are")
        packed = PackedLayout.build(rollouts.lengths.cpu(), segment_multiple=2 * cp if cp > 1 else 1, total_multiple=multiple)
        row_len = packed.total
        # --- 2. context parallel: chunks r and 2·CP−1−r of every segment ---
        positions = thd_cp_positions(packed.cu_seqlens_padded, cp, cp_rank) if cp > 1 else torch.arange(row_len)
        # --- 3. the loss's sequence layout: this rank's segment boundaries ---
        sequences: SequenceLayout = PackedSequences(packed.cu_seqlens_padded // cp, cp_group=cp_group)
    else:
        longest = int(rollouts.lengths.max())
        if seq_len is not None and seq_len < longest:
            raise ValueError(f"seq_len ({seq_len}) is shorter than the longest sequence ({longest})")
        row_len = round_up(longest if seq_len is None else seq_len, multiple)
        rollouts = _trim(rollouts, row_len)
        # --- 2. context parallel: chunks r and 2·CP−1−r of every row ---
        positions = cp_positions(row_len, cp, cp_rank) if cp > 1 else torch.arange(row_len)
        # --- 3. the loss's sequence layout: rows ---
        sequences = PaddedSequences(cp_group=cp_group)
    layout = TokenLayout(row_len, packed, positions)

    # --- 4. inputs as they are; loss fields shifted by one, then cut alike ---
    device = rollouts.tokens.device
    tokens = rollouts.tokens.to(torch.int64)
    loss_mask = layout.target_field(rollouts.loss_mask, False)
    targets = torch.where(loss_mask, layout.target_field(tokens, 0), torch.full((), IGNORE_INDEX, device=device))
    advantages = rollouts.advantages if rollouts.advantages.dim() == 1 else layout.target_field(rollouts.advantages, 0.0)
    optional = {
        name: None if getattr(rollouts, name) is None else layout.target_field(getattr(rollouts, name), 0.0)
        for name in ("rollout_logprobs", "old_logprobs", "ref_logprobs")
    }
    b, s = tokens.shape
    positions_in_row = torch.arange(s, device=device).expand(b, s)  # packing restarts them in every segment
    # --- 5. the loss rows, from the mask on the rollouts' device (the host, usually: no synchronization) ---
    rows = loss_rows(loss_mask)
    return MicroBatch(
        input_ids=layout.input_field(tokens, 0),
        position_ids=layout.input_field(positions_in_row, 0),
        packed_seq_params=None if packed is None else packed_seq_params(packed, device=device),
        targets=targets,
        loss_mask=loss_mask,
        advantages=advantages,
        sequences=sequences,
        layout=layout,
        loss_rows=rows,
        **optional,
    )


def _trim(rollouts: Rollouts, length: int) -> Rollouts:
    """Rows cut (or left) to at most ``length`` columns — only padding is removed (lengths ≤ length)."""
    if rollouts.seq_len <= length:
        return rollouts
    cut = {}
    for name in ("tokens", "loss_mask", "rollout_logprobs", "old_logprobs", "ref_logprobs"):
        x = getattr(rollouts, name)
        cut[name] = None if x is None else x[:, :length]
    adv = rollouts.advantages
    return Rollouts(lengths=rollouts.lengths, advantages=adv if adv.dim() == 1 else adv[:, :length], **cut)
