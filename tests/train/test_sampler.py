"""The keyed vocab-parallel Gumbel-max sampler (mp_grpo/train/sampler.py) and its collective.

Draws are a function of (seed, step, sequence, position, token id) only: the same on any slicing of
the vocabulary or the batch; the sample follows softmax(logits); TP = 2 (gloo) samples exactly the
tokens TP = 1 samples, through one all-reduce of packed (score, id) words. Top-k / top-p: the keep set equals
a float64 reference that filters the full-vocabulary softmax (vLLM's convention and order, ties kept), samples
follow the filtered softmax, and TP = 2 keeps and samples exactly what TP = 1 does.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mp_grpo.collectives import all_reduce_argmax
from mp_grpo.train.sampler import gumbel_max_sample, keyed_normal, keyed_uniform, sampling_filter_keep
from tests.distributed import torchrun, worker_main
from tests.reference import sampling_filter_keep_reference


def test_keyed_uniform_is_a_function_of_its_key() -> None:
    seq, pos, tok = torch.arange(6).view(6, 1), torch.arange(6).view(6, 1) + 3, torch.arange(40)
    full = keyed_uniform(7, 2, seq, pos, tok)
    assert full.dtype == torch.float64 and full.shape == (6, 40)
    assert bool(((full > 0) & (full < 1)).all())
    # a vocabulary shard and a batch slice see the same numbers
    assert torch.equal(keyed_uniform(7, 2, seq, pos, tok[20:]), full[:, 20:])
    assert torch.equal(keyed_uniform(7, 2, seq[3:], pos[3:], tok), full[3:])
    # every key coordinate matters
    for other in (keyed_uniform(8, 2, seq, pos, tok), keyed_uniform(7, 3, seq, pos, tok),
                  keyed_uniform(7, 2, seq + 1, pos, tok), keyed_uniform(7, 2, seq, pos + 1, tok)):
        assert not torch.equal(other, full)


def test_keyed_uniform_and_normal_statistics() -> None:
    seq, pos, tok = torch.arange(200).view(200, 1), torch.zeros(200, 1, dtype=torch.int64), torch.arange(500)
    u = keyed_uniform(0, 0, seq, pos, tok).flatten()
    n = u.numel()  # 1e5 draws: the mean's standard error is 0.29 / sqrt(n) ≈ 9e-4
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    hist = torch.histc(u, bins=10, min=0, max=1) / n
    assert float((hist - 0.1).abs().max()) < 0.005
    z = keyed_normal(0, 0, seq, pos, tok).flatten()
    assert abs(float(z.mean())) < 5 / math.sqrt(n) and abs(float(z.std()) - 1) < 0.01


def test_gumbel_max_follows_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 3.0])
    n = 40000
    tokens = gumbel_max_sample(logits.expand(n, -1).contiguous(), vocab_start=0, seed=1, step=0,
                               sequence=torch.arange(n), position=torch.zeros(n, dtype=torch.int64), tp_group=None)
    freq = torch.bincount(tokens, minlength=6).double() / n
    p = torch.softmax(logits.double(), 0)
    sigma = (p * (1 - p) / n).sqrt()
    assert bool(((freq - p).abs() < 5 * sigma).all()), f"{freq} vs {p}"


def _top_p_logits(n: int, v: int, seed: int) -> torch.Tensor:
    """Rows of several sharpnesses, and rows of quantized logits with many ties."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.3, 1.0, 3.0, 8.0]).repeat(n // 4 + 1)[:n].unsqueeze(1)
    z = torch.randn(n, v, generator=gen) * scale
    z[: n // 4] = torch.round(z[: n // 4] * 2) / 2  # ties at (and around) the threshold
    return z


def test_top_p_keep_set_matches_float64_reference() -> None:
    z = _top_p_logits(64, 48, seed=3)  # 64 rows: the bin-mass kernel runs under Triton's CPU interpreter
    for p in (0.3, 0.8, 0.95, 1.0):
        keep = sampling_filter_keep(z, top_k=0, top_p=p, tp_group=None)
        ref = sampling_filter_keep_reference(z, top_p=p)
        assert torch.equal(keep, ref), f"top_p={p}: {int((keep != ref).sum())} entries differ"
        assert bool(keep.any(dim=1).all())  # the largest logit is always kept
        if p < 1.0:
            # the kept mass reaches p; the kept set without its smallest tie group does not
            prob = torch.softmax(z.double(), dim=1)
            assert bool(((prob * keep).sum(1) >= p - 1e-6).all())


def test_top_k_and_top_p_keep_set_matches_float64_reference() -> None:
    z = _top_p_logits(32, 48, seed=6)  # ties at the k-th value too (the quantized rows)
    for k, p in ((5, 1.0), (1, 1.0), (12, 0.8), (48, 0.9), (0, 0.7)):
        keep = sampling_filter_keep(z, top_k=k, top_p=p, tp_group=None)
        ref = sampling_filter_keep_reference(z, top_k=k if k else None, top_p=p)
        assert torch.equal(keep, ref), f"top_k={k}, top_p={p}: {int((keep != ref).sum())} entries differ"
        if 0 < k < 48 and p == 1.0:  # at least k kept (more on a tie at the k-th value), never the whole row
            assert bool((keep.sum(1) >= k).all()) and bool((keep.sum(1) < 48).all())


def test_top_p_samples_follow_the_filtered_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 3.0, 0.5])
    n, p = 40000, 0.8
    keep = sampling_filter_keep(logits.unsqueeze(0), top_k=0, top_p=p, tp_group=None)  # one row (the interpreter's time goes per row)
    filtered = torch.where(keep, logits, torch.full_like(logits, float("-inf"))).expand(n, -1).contiguous()
    tokens = gumbel_max_sample(filtered, vocab_start=0, seed=2, step=0, sequence=torch.arange(n),
                               position=torch.zeros(n, dtype=torch.int64), tp_group=None)
    freq = torch.bincount(tokens, minlength=7).double() / n
    ref_keep = sampling_filter_keep_reference(logits, top_p=p)
    expected = torch.softmax(torch.where(ref_keep, logits.double(), torch.tensor(float("-inf"), dtype=torch.float64)), 0)
    assert bool((freq[~ref_keep] == 0).all()), f"sampled outside the nucleus: {freq}"
    sigma = (expected * (1 - expected) / n).sqrt()
    assert bool(((freq - expected).abs() <= 5 * sigma).all()), f"{freq} vs {expected}"


def test_top_p_bad_arguments_are_named() -> None:
    import pytest

    with pytest.raises(ValueError, match="top_p must be"):
        sampling_filter_keep(torch.zeros(2, 4), top_k=0, top_p=0.0, tp_group=None)
    with pytest.raises(ValueError, match="top_k must be"):
        sampling_filter_keep(torch.zeros(2, 4), top_k=-1, top_p=1.0, tp_group=None)
    with pytest.raises(ValueError, match="z must be"):
        sampling_filter_keep(torch.zeros(2, 4, dtype=torch.float64), top_k=0, top_p=0.9, tp_group=None)


def test_bad_shapes_are_named() -> None:
    import pytest

    with pytest.raises(ValueError, match="logits must be"):
        gumbel_max_sample(torch.zeros(3), vocab_start=0, seed=0, step=0, sequence=torch.arange(3),
                          position=torch.arange(3), tp_group=None)
    with pytest.raises(ValueError, match="value must be float32"):
        all_reduce_argmax(torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.int64), None)


def case_tp2() -> None:
    """Each rank holds half the vocabulary: the samples equal the full-vocabulary ones; ties go to the smaller id."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(5)
    n, v = 257, 64
    logits = torch.randn(n, v, generator=gen) * 3
    seq, pos = torch.arange(n) * 7, torch.arange(n) % 11
    full = gumbel_max_sample(logits, vocab_start=0, seed=3, step=4, sequence=seq, position=pos, tp_group=None)
    shard = v // world
    split = gumbel_max_sample(logits[:, rank * shard:(rank + 1) * shard].contiguous(), vocab_start=rank * shard,
                              seed=3, step=4, sequence=seq, position=pos, tp_group=dist.group.WORLD)
    assert torch.equal(split, full), f"{int((split != full).sum())} of {n} samples differ"
    # the merge alone: equal best values on both ranks -> the smaller global id, negative values ordered
    value = torch.tensor([1.5, -2.0, -0.0, float("-inf")])
    index = torch.tensor([10, 3, 7, 1]) + rank * 100
    merged = all_reduce_argmax(value if rank == 0 else torch.tensor([1.5, -1.0, 0.0, -1e30]), index, dist.group.WORLD)
    assert merged.tolist() == [10, 103, 107, 101], merged.tolist()
    # top-p: the split keep set is the full one's shard, and the filtered samples are the same
    z = _top_p_logits(64, v, seed=4)
    seq, pos = seq[:64], pos[:64]
    for p in (0.5, 0.9):
        keep_full = sampling_filter_keep(z, top_k=0, top_p=p, tp_group=None)
        z_shard = z[:, rank * shard:(rank + 1) * shard].contiguous()
        keep_split = sampling_filter_keep(z_shard, top_k=0, top_p=p, tp_group=dist.group.WORLD)
        assert torch.equal(keep_split, keep_full[:, rank * shard:(rank + 1) * shard]), f"top_p={p}: keep sets differ"
        neg = torch.tensor(float("-inf"))
        full = gumbel_max_sample(torch.where(keep_full, z, neg), vocab_start=0, seed=3, step=5, sequence=seq,
                                 position=pos, tp_group=None)
        split = gumbel_max_sample(torch.where(keep_split, z_shard, neg), vocab_start=rank * shard, seed=3, step=5,
                                  sequence=seq, position=pos, tp_group=dist.group.WORLD)
        assert torch.equal(split, full), f"top_p={p}: {int((split != full).sum())} of 64 samples differ"


def test_tp2_samples_equal_tp1() -> None:
    torchrun(__file__, "case_tp2", nproc=2)


if __name__ == "__main__":
    worker_main({"case_tp2": case_tp2})
