"""A vocab-parallel Gumbel-max sampler whose draws do not depend on how the vocabulary or the batch is split.

Every random number is a hash of its coordinates — (seed, step, sequence, position, global token id)
— not a draw from a generator whose state depends on how many numbers were drawn before, by whom.
So a sequence's completion is the same whichever DP rank samples it, in whichever micro-batch, and
whether its vocabulary is on one TP rank or split over several: the noise of token id v is the same
number on every layout, and the argmax over the whole vocabulary is merged from the shards' argmaxes.

Schedule of :func:`gumbel_max_sample` (one decoding position of N sequences, on every TP rank)

1. Uniforms ``u ∈ (0, 1)`` from :func:`keyed_uniform` for this rank's token ids
   ``[vocab_start, vocab_start + V_local)``; Gumbel noise ``g = −log(−log u)`` in float64.
2. Scores ``logits + g`` (logits already divided by the temperature), rounded to float32; this shard's
   argmax (ties: the smallest id).
3. One all-reduce over the TP group (:func:`mp_grpo.collectives.all_reduce_argmax`, MAX of packed
   (score, id) words): the id with the largest score over the whole vocabulary. The logits are never
   gathered. ``argmax(z + g)`` is a sample of ``softmax(z)`` (the Gumbel-max trick).

Top-k / top-p (:func:`sampling_filter_keep`): the engine first masks the logits outside the kept set to −inf,
then samples as above — a sample of the renormalized filtered distribution. The per-row kept set is a
raw-logit threshold found by mp_grpo's own replay machinery (:func:`mp_grpo.ops.sampling_filter.filter_threshold`,
vLLM's convention): one all-gather of each rank's largest logits of a row (its candidates, ≤ 512), then, for the
rows they do not settle, all-reduces of per-row histograms (counts for top-k, bin masses for top-p); the whole
logits are never gathered. The same function is what the trainer runs when it replays the filter
(``vocab_parallel_logprobs(..., sampling_filter=SamplingFilter(top_k=k, top_p=p))``), so with equal logits the
engine's and the trainer's kept sets are the same; with a bf16 engine and an fp32 trainer they can differ at
the boundary (the rule the learning loop applies: :class:`~mp_grpo.config.job.EngineConfig`).
"""

from __future__ import annotations

import torch

from mp_grpo.collectives import ProcessGroup, all_reduce_argmax, group_size
from mp_grpo.ops.sampling_filter import SamplingFilter, filter_threshold

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a product with a 32-bit value stays below 2**63, so int64 never overflows.
_MUL_A = 0x7FEB352D
_MUL_B = 0x6C8E9CF5

NOISE_SALT = 0x5EED1E55
"""Added to the seed for the engine's logit-noise knob, so that noise and sampling draws are independent."""


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (xorshift-multiply rounds) on int64 tensors holding values < 2**32."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 16)


def keyed_uniform(seed: int, step: int, sequence: torch.Tensor, position: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in (0, 1), one per broadcast element of ``(sequence, position, token)``.

    A pure function of (seed, step, sequence id, position, global token id): the same number on any
    layout. ``sequence``, ``position``, ``token``: int64 tensors that broadcast together, e.g. ``[N, 1]``,
    ``[N, 1]`` and ``[V_local]``.
    """
    h = _mix(torch.tensor(seed, dtype=torch.int64, device=token.device))
    h = _mix(h ^ (step & _MASK32))
    h = _mix(h ^ sequence.to(torch.int64))
    h = _mix(h ^ position.to(torch.int64))
    h = _mix(h ^ token.to(torch.int64))
    return (h.to(torch.float64) + 0.5) / 2.0**32  # in [2**-33, 1 - 2**-33]: log(u) and log(-log u) finite


def gumbel_max_sample(
    logits: torch.Tensor,
    *,
    vocab_start: int,
    seed: int,
    step: int,
    sequence: torch.Tensor,
    position: torch.Tensor,
    tp_group: ProcessGroup | None,
) -> torch.Tensor:
    """Token ids ``[N]`` sampled from ``softmax(logits)`` over the whole (sharded) vocabulary.

    Args:
        logits: ``[N, V_local]`` this rank's vocabulary shard, already divided by the temperature.
        vocab_start: global id of this shard's first token (``tp_rank · V_local``).
        seed, step: the run's seed and the optimizer step (every step draws fresh noise).
        sequence: ``[N]`` int64 global sequence ids (the same sequence has the same id on every layout).
        position: ``[N]`` int64 positions of the tokens being sampled.
        tp_group: the group the vocabulary is split over (None: the whole vocabulary is here).
    """
    if logits.dim() != 2 or sequence.shape != logits.shape[:1] or position.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [N, V_local] with sequence and position [N], got {tuple(logits.shape)}, "
                         f"{tuple(sequence.shape)}, {tuple(position.shape)}")
    # --- 1. keyed Gumbel noise for this shard's global token ids ---
    ids = torch.arange(vocab_start, vocab_start + logits.shape[1], dtype=torch.int64, device=logits.device)
    u = keyed_uniform(seed, step, sequence.unsqueeze(1), position.unsqueeze(1), ids)
    gumbel = -torch.log(-torch.log(u))
    # --- 2. this shard's best (score, id) ---
    scores = (logits.double() + gumbel).float()
    best = scores.argmax(dim=1)  # first maximum: the smallest id among ties
    value = scores.gather(1, best.unsqueeze(1)).squeeze(1)
    # --- 3. one all-reduce merges the shards ---
    return all_reduce_argmax(value, best + vocab_start, tp_group)


def keyed_normal(seed: int, step: int, sequence: torch.Tensor, position: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """float64 standard normals keyed like :func:`keyed_uniform` (the engine's logit-noise knob)."""
    return torch.special.ndtri(keyed_uniform(seed + NOISE_SALT, step, sequence, position, token))


def sampling_filter_keep(z: torch.Tensor, *, top_k: int, top_p: float, tp_group: ProcessGroup | None) -> torch.Tensor:
    """``[N, V_local]`` bool: this shard's tokens in each row's kept set of top-k then top-p (sharded vocabulary).

    vLLM's convention and order: top-k keeps the tokens whose logit is ≥ the k-th largest (ties kept); top-p,
    on the distribution top-k leaves, keeps token j iff the probability mass of the kept tokens with a strictly
    larger logit is < ``top_p`` (ties at the threshold kept; the largest logit always). Schedule:

    1. :func:`~mp_grpo.ops.sampling_filter.filter_threshold` on fp32 ``z`` (already divided by the
       temperature, so ``inv_temperature = 1``): a per-row threshold τ from each rank's candidates (its
       largest logits of the row, one all-gather over ``tp_group``) and, for the rows they do not settle, a
       radix search over the logits' order-preserving keys, each round one all-reduce (sum) of per-row
       histograms (the rounds and sizes are listed there); the whole logits are never gathered.
    2. Keep ``z ≥ τ`` (no collective).

    Args:
        z: ``[N, V_local]`` fp32 logits shard / temperature (every rank of ``tp_group`` passes its shard).
        top_k: an int ≥ 0; 0 (or ≥ the vocabulary) keeps every token.
        top_p: in (0, 1]; 1 keeps every token.
        tp_group: the group the vocabulary is split over (None: the whole vocabulary is here).
    """
    if z.dim() != 2 or z.dtype != torch.float32:
        raise ValueError(f"z must be a [N, V_local] float32 tensor, got {tuple(z.shape)} {z.dtype}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int ≥ 0 (0 = off), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be a float in (0, 1], got {top_p!r}")
    filt = SamplingFilter(top_k=top_k or None, top_p=float(top_p)).without_noops(z.shape[1] * group_size(tp_group))
    if filt is None:
        return torch.ones_like(z, dtype=torch.bool)
    # --- 1. the per-row threshold, vocab-parallel ---
    threshold = filter_threshold(z.contiguous(), filt, z.shape[:1], tp_group=tp_group, inv_temperature=1.0)
    # --- 2. the keep set ---
    return z >= threshold.unsqueeze(1)
