"""The rollout engine: samples completions from its own copy of the policy, with a controllable mismatch.

It stands in for vLLM / SGLang: its own copy of the weights in its own dtype (bf16 by default, while
the trainer is fp32 on CPU), its own log-prob arithmetic (plain torch, not mp_grpo's kernel), and
knobs that widen the gap (:class:`~mp_grpo.config.job.EngineConfig`): noise on its logits, weights
that lag the trainer's by some optimizer steps, top-k / top-p sampling (whose filtered log-probs the trainer
matches only by replaying the filter), and its head's precision (``logit_dtype``: logits rounded to bf16 or
kept in fp32). The log-probs it returns are the ``rollout_logprobs``
that mp_grpo's rollout correction, OPSM and mismatch monitor consume. With ``dtype = fp32`` and every
knob at 0 they equal the trainer's to fp32 reduction order.

Schedule of :meth:`RolloutEngine.generate` (every TP rank of a replica calls it with the same prompts)

1. Buffer ``[N, P_max + L]``: the prompts, right-padded.
2. For each of the L completion tokens (full recompute, no KV cache — fine at these sizes): the engine
   model's vocab-parallel logits of the whole buffer, at each row's last filled position. The head sums the
   products of its bf16 (or fp32) operands in fp32; with ``logit_dtype = fp32`` those sums are the logits
   (:func:`fp32_head`: vLLM's ``head_dtype=float32``, sglang's ``--enable-fp32-lm-head``), with ``bf16`` they
   are rounded once to the engine's dtype — its own output layer, a bf16 GEMM. Keyed N(0, std²) noise
   (``logit_noise_std``) enters the fp32 sums, before that rounding. Then / temperature = z.
3. With ``top_k > 0`` or ``top_p < 1``: z = −inf outside each row's kept set (top-k, then top-p on what is
   left: :func:`~mp_grpo.train.sampler.sampling_filter_keep`, vLLM's convention and order, found without
   gathering the logits). Sample from softmax(z) with
   :func:`~mp_grpo.train.sampler.gumbel_max_sample` (one all-reduce over TP), write the token. With
   ``capture_support`` the kept set is recorded as vLLM's ``SamplingMask`` returns it (each shard's kept ids,
   all-gathered: every rank holds the same :class:`~mp_grpo.ops.token_ids.CapturedSupport`).
4. Its log-prob log softmax(z)[token] over the sharded vocabulary — with a filter, of the filtered,
   renormalized distribution, as vLLM reports it: all-reduce MAX of the shard maxima, all-reduce SUM of
   the shards' sums of exp, all-reduce SUM of the owning shard's z[token]. With ``topk_logprobs = K`` also the
   K largest z of the whole vocabulary and their log-probs (vLLM's ``logprobs=K``, of the same distribution):
   each shard's K largest, all-gathered, the K largest of those (:func:`_top_k`); every rank holds the same
   ids, CSR over the ``[N, S]`` positions (:attr:`Generation.top_ids`).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from mp_grpo.collectives import ProcessGroup, all_gather_stacked, all_reduce_max, all_reduce_sum, group_rank
from mp_grpo.config.job import EngineConfig, EngineDtype
from mp_grpo.config.precision import LogitDtype
from mp_grpo.ops.sampling_filter import SamplingFilter
from mp_grpo.ops.token_ids import CapturedSupport, TokenIds
from mp_grpo.train.sampler import gumbel_max_sample, keyed_normal, sampling_filter_keep

_DTYPES = {EngineDtype.BF16: torch.bfloat16, EngineDtype.FP32: torch.float32}


@dataclass(frozen=True)
class Generation:
    """One batch of completions, token-aligned like :class:`~mp_grpo.megatron.Rollouts`."""

    tokens: torch.Tensor
    """``[N, S]`` int64 prompt then completion, right-padded with 0."""
    lengths: torch.Tensor
    """``[N]`` prompt + completion lengths."""
    completion_mask: torch.Tensor
    """``[N, S]`` bool: the sampled tokens."""
    rollout_logprobs: torch.Tensor
    """``[N, S]`` float32: the engine's log-prob of each sampled token (0 elsewhere); with a sampling filter
    (``top_k`` / ``top_p``) that of the filtered, renormalized distribution."""
    support: CapturedSupport | None = None
    """With ``generate(capture_support=True)`` and a sampling filter: the kept set each sampled token was drawn from,
    CSR over the ``[N, S]`` positions (row-major; no ids for prompt and padding positions), ids increasing."""
    top_ids: TokenIds | None = None
    """With ``engine.topk_logprobs = K``: each sampled token's K most probable ids of the distribution it was drawn
    from (most probable first), CSR over the ``[N, S]`` positions (row-major; K entries at every completion position,
    none elsewhere)."""
    top_logprobs: torch.Tensor | None = None
    """``[nnz]`` float32, aligned with :attr:`top_ids`: the engine's log-probs at those ids (−inf: outside its
    sampling filter)."""

    def top_k_rows(self, start: int, stop: int) -> tuple[TokenIds, torch.Tensor]:
        """:attr:`top_ids` and :attr:`top_logprobs` of the rows ``start:stop``, as a CSR over their ``[stop − start,
        S]`` positions (what :meth:`~mp_grpo.megatron.MicroBatch.with_rollout_top_k` takes for those sequences)."""
        if self.top_ids is None or self.top_logprobs is None:
            raise ValueError("top_k_rows: this generation has no top-K log-probs (engine.topk_logprobs = 0)")
        n, width = self.tokens.shape
        if not 0 <= start < stop <= n:
            raise ValueError(f"top_k_rows: rows {start}:{stop} are not a non-empty range of the {n} rows")
        indptr = self.top_ids.indptr[start * width: stop * width + 1]
        first, last = int(indptr[0]), int(indptr[-1])
        return TokenIds(indptr - first, self.top_ids.ids[first:last]), self.top_logprobs[first:last]


class RolloutEngine:
    """Samples completions with its own copy of the policy; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig,
        *,
        temperature: float,
        seed: int,
        tp_group: ProcessGroup | None,
        forward: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """
        Args:
            model: the engine's own model instance (same architecture and TP sharding as the trainer's);
                its weights are replaced by :meth:`sync_weights`.
            config: dtype and mismatch knobs.
            temperature: sampling temperature (the trainer's log-probs use the same).
            seed: the run's seed (sampling noise is keyed by it).
            tp_group: the group the vocabulary is split over.
            forward: ``(model, input_ids, position_ids) -> [N, S, V_local]`` logits; default ``model(ids, pos, None)``.
        """
        self.config = config
        self.dtype = _DTYPES[config.dtype]
        self.model = model.to(self.dtype).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.temperature = float(temperature)
        self.seed = int(seed)
        self.tp_group = tp_group
        self.forward = forward or (lambda m, ids, pos: m(ids, pos, None))
        self._history: deque[dict[str, torch.Tensor]] = deque(maxlen=config.weight_lag + 1)

    @property
    def sampling_filter(self) -> SamplingFilter | None:
        """The engine's sampling filter as the trainer replays it (``top_k`` 0 → None, ``top_p`` 1 → None), or None
        when the engine samples from the whole vocabulary."""
        if self.config.top_k == 0 and self.config.top_p >= 1.0:
            return None
        top_p = None if self.config.top_p >= 1.0 else float(self.config.top_p)
        return SamplingFilter(top_k=self.config.top_k or None, top_p=top_p)

    @torch.no_grad()
    def sync_weights(self, trainer_model: torch.nn.Module) -> None:
        """Record the trainer's current weights; load those of ``weight_lag`` syncs ago (or the oldest kept)."""
        self._history.append({k: v.detach().clone() for k, v in trainer_model.state_dict().items() if torch.is_tensor(v)})
        state = self._history[0]
        own = self.model.state_dict()
        for name, value in own.items():
            if torch.is_tensor(value) and name in state:
                value.copy_(state[name].to(value.dtype))

    @torch.no_grad()
    def generate(
        self, prompts: torch.Tensor, prompt_lengths: torch.Tensor, *, completion_length: int, step: int,
        sequence_ids: torch.Tensor, capture_support: bool = False,
    ) -> Generation:
        """``completion_length`` tokens after each prompt; ``sequence_ids`` key the sampling noise per row. With
        ``capture_support`` (and a sampling filter) also the kept set of each sampled token
        (:attr:`Generation.support`)."""
        captured: list[torch.Tensor] = []  # per completion token: [kept entries, 3] (row, position, id)
        top: list[tuple[torch.Tensor, torch.Tensor]] = []  # per completion token: [N, K] ids and log-probs
        n, p_max = prompts.shape
        device = prompts.device
        # --- 1. the buffer ---
        width = p_max + completion_length
        tokens = torch.zeros(n, width, dtype=torch.int64, device=device)
        tokens[:, :p_max] = prompts
        logprobs = torch.zeros(n, width, dtype=torch.float32, device=device)
        positions = torch.arange(width, device=device).unsqueeze(0).expand(n, width)
        rows = torch.arange(n, device=device)
        for k in range(completion_length):
            # --- 2. logits at each row's last filled position ---
            pos = prompt_lengths + k  # position of the token being sampled
            noisy = self.config.logit_noise_std > 0.0
            if self.config.logit_dtype == LogitDtype.FP32 or noisy:  # the head's fp32 sums
                with fp32_head(self.model):
                    logits = self.forward(self.model, tokens, positions)[rows, pos - 1]
            else:  # its own output layer: the same sums rounded once to the engine's dtype (a bf16 GEMM)
                logits = self.forward(self.model, tokens, positions)[rows, pos - 1].float()
            v_local = logits.shape[1]
            vocab_start = group_rank(self.tp_group) * v_local
            ids = torch.arange(vocab_start, vocab_start + v_local, device=device)
            if noisy:
                noise = keyed_normal(self.seed, step, sequence_ids.unsqueeze(1), pos.unsqueeze(1), ids)
                logits = logits + (self.config.logit_noise_std * noise).float()
                if self.config.logit_dtype == LogitDtype.BF16:  # rounded as the head's output, after the noise
                    logits = logits.to(self.dtype).float()
            z = logits / self.temperature
            # --- 3. sample (from the kept set with top-k / top-p) ---
            if self.sampling_filter is not None:
                keep = sampling_filter_keep(z, top_k=self.config.top_k, top_p=self.config.top_p, tp_group=self.tp_group)
                z = torch.where(keep, z, torch.full_like(z, float("-inf")))
                if capture_support:  # the whole vocabulary's kept ids, in increasing order per row
                    whole = all_gather_stacked(keep.to(torch.uint8), self.tp_group).permute(1, 0, 2).reshape(n, -1)
                    row, ids = whole.nonzero(as_tuple=True)
                    captured.append(torch.stack([row, pos[row], ids], dim=1))
            token = gumbel_max_sample(z, vocab_start=vocab_start, seed=self.seed, step=step, sequence=sequence_ids,
                                      position=pos, tp_group=self.tp_group)
            tokens[rows, pos] = token
            # --- 4. its log-prob over the sharded vocabulary (and its top-K ones) ---
            zmax = all_reduce_max(z.max(dim=1).values, self.tp_group)
            sumexp = all_reduce_sum(torch.exp(z - zmax.unsqueeze(1)).sum(dim=1), self.tp_group)
            local = token - vocab_start
            owned = (local >= 0) & (local < v_local)
            picked = z.gather(1, torch.where(owned, local, torch.zeros_like(local)).unsqueeze(1)).squeeze(1)
            picked = all_reduce_sum(torch.where(owned, picked, torch.zeros_like(picked)), self.tp_group)
            log_normalizer = zmax + torch.log(sumexp)
            logprobs[rows, pos] = picked - log_normalizer
            if self.config.topk_logprobs > 0:
                top_z, top_id = _top_k(z, self.config.topk_logprobs, vocab_start, self.tp_group)
                top.append((top_id, top_z - log_normalizer.unsqueeze(1)))
        lengths = prompt_lengths + completion_length
        col = torch.arange(width, device=device).unsqueeze(0)
        mask = (col >= prompt_lengths.unsqueeze(1)) & (col < lengths.unsqueeze(1))
        support = _support_of(captured, n, width) if captured else None
        top_ids = top_logprobs = None
        if top:  # step k's entries sit at (row, prompt_length + k): rows first, then k, is row-major position order
            ids, values = (torch.stack([t[i] for t in top], dim=1).reshape(-1) for i in (0, 1))
            counts = mask.reshape(-1).to(torch.int64) * self.config.topk_logprobs
            top_ids = TokenIds(torch.cat([torch.zeros(1, dtype=torch.int64, device=device), counts.cumsum(0)]), ids)
            top_logprobs = values
        return Generation(tokens=tokens, lengths=lengths, completion_mask=mask, rollout_logprobs=logprobs,
                          support=support, top_ids=top_ids, top_logprobs=top_logprobs)


def _top_k(z: torch.Tensor, k: int, vocab_start: int, tp_group: ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row of the vocab-parallel ``z`` (``[N, V_local]``) over the whole vocabulary, largest
    first, and their global ids (``[N, k]`` each; the same on every rank): each shard's min(k, V_local) largest,
    all-gathered over ``tp_group``, then the ``k`` largest of those."""
    n, v_local = z.shape
    values, index = z.topk(min(k, v_local), dim=1)
    values = all_gather_stacked(values, tp_group).permute(1, 0, 2).reshape(n, -1)
    if values.shape[1] < k:
        raise ValueError(f"engine.topk_logprobs: {k} exceeds the vocabulary ({values.shape[1]} ids); allowed: ≤ it")
    ids = all_gather_stacked(index + vocab_start, tp_group).permute(1, 0, 2).reshape(n, -1)
    best, which = values.topk(k, dim=1)
    return best, ids.gather(1, which)


def _support_of(captured: list[torch.Tensor], n: int, width: int) -> CapturedSupport:
    """The recorded (row, position, id) entries as a CSR over the ``[n, width]`` positions, row-major."""
    entries = torch.cat(captured)
    position = entries[:, 0] * width + entries[:, 1]
    order = torch.sort(position, stable=True).indices  # each step's entries are in increasing id order already
    counts = torch.bincount(position, minlength=n * width)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64, device=counts.device), counts.cumsum(0)])
    return CapturedSupport(indptr, entries[order, 2].contiguous())


@contextlib.contextmanager
def fp32_head(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, ``model``'s output layer returns the fp32 sums of its operands' products: its input (after
    the layer's TP mapping) and weight upcast to fp32, one fp32 GEMM — vLLM's ``head_dtype=float32`` and sglang's
    ``--enable-fp32-lm-head``. bf16 operands are exact in fp32, so these are a bf16 GEMM's fp32 accumulators (to
    summation order) before its output is rounded. The layer must be megatron-core's vocab-parallel
    ``ColumnParallelLinear`` without bias (GPTModel's and the CPU stand-in's); anything else raises."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.utils import get_attr_wrapped_model

    from mp_grpo.megatron.fused_output import _forward_replaced, _input_mapping

    try:
        layer = get_attr_wrapped_model(model, "output_layer", return_model_obj=True).output_layer
    except RuntimeError as err:
        raise ValueError(f"the rollout engine's model has no output_layer to compute its head from ({err})") from err
    if not isinstance(layer, ColumnParallelLinear) or layer.bias is not None or layer.gather_output:
        raise ValueError(f"the rollout engine's output layer must be a ColumnParallelLinear without bias and without "
                         f"gather_output (vocab-parallel logits); got {type(layer).__name__}")

    def head(input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        w = layer.weight if weight is None else weight
        return torch.nn.functional.linear(_input_mapping(layer, input_).float(), w.float()), None

    with _forward_replaced(layer, head):
        yield
