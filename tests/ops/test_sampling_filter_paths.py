"""The two paths of the threshold search (mp_grpo/ops/sampling_filter.py): the candidates gathered in the statistics'
read (kernels/logprob_candidates.py) and the radix fallback (kernels/logprob_filter.py). Both run in the CPU suite
(under the interpreter the candidates are the columns >= the 4th largest maximum of 8-column groups, at most 16),
both give the float64 reference's kept set — on rows
of a few distinct values for every k and a grid of p (ties at every threshold), on rows whose ties overflow the
candidate buffer, and whatever the buffer's size.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import mp_grpo.ops.filter_launch as filter_launch
from mp_grpo.ops import SamplingFilter
from mp_grpo.ops.sampling_filter import threshold_search
from tests.reference import sampling_filter_keep_reference

TEMPERATURE = 0.9


def _search(logits: torch.Tensor, **filt):
    s = threshold_search(logits, SamplingFilter(**filt), logits.shape[:-1], tp_group=None,
                         inv_temperature=1 / TEMPERATURE)
    return logits.float() >= s.tau[:, None], s.finished.bool()


def _assert_kept_sets_equal(logits, **filt):
    keep, finished = _search(logits, **filt)
    keep_ref = sampling_filter_keep_reference(logits, temperature=TEMPERATURE, **filt)
    bad = (keep != keep_ref).any(-1)
    assert not bad.any(), (filt, bad.nonzero().flatten()[:8], finished[bad])
    return finished


def _mixed_rows(rows: int, vocab: int, dtype, seed: int) -> torch.Tensor:
    """Peaky rows (three dominant tokens: the candidates finish top-p) and flat rows (the fallback does)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen)
    x[::2, torch.randperm(vocab, generator=gen)[:3]] += 9.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_both_paths_run_and_agree_with_the_reference(dtype):
    logits = _mixed_rows(8, 70, dtype, seed=1)
    finished = _assert_kept_sets_equal(logits, top_p=0.9)
    assert finished[::2].all() and not finished[1::2].any(), finished  # peaky: candidates; flat: fallback
    finished = _assert_kept_sets_equal(logits, top_k=4)  # k <= KEEP (4 here): always the candidates
    assert finished.all()
    finished = _assert_kept_sets_equal(logits, top_k=30)  # k beyond the buffer: the fallback
    assert not finished.any()
    finished = _assert_kept_sets_equal(logits, min_p=0.05, top_k=3, top_p=0.5)
    assert finished.all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_k_and_a_grid_of_p_on_rows_of_ties(dtype):
    """Rows of 3 and 5 distinct values (ties at every threshold), every k in 0 … V (0 and V: off), p on a grid,
    as per-row tensors in one call; both paths, exact kept sets (fp32 masses of so few values are far from p)."""
    gen = torch.Generator().manual_seed(11)
    vocab = 40  # 5 groups of 8 columns: more than the interpreter's 4 that set the candidates' threshold
    base = torch.stack([torch.randint(0, levels, (vocab,), generator=gen).float() * 1.5 - 2
                        for levels in (3, 5)])
    ks = torch.arange(0, vocab + 1)
    logits = base.repeat_interleave(len(ks), 0).to(dtype)
    top_k = ks.repeat(len(base))
    finished = _assert_kept_sets_equal(logits, top_k=top_k)
    assert finished.any() and not finished.all()
    ps = torch.tensor([0.05, 0.33, 0.5, 0.77, 0.9, 0.999, 1.0])
    logits_p = base.repeat_interleave(len(ps), 0).to(dtype)
    top_p = ps.repeat(len(base))
    _assert_kept_sets_equal(logits_p, top_p=top_p)
    _assert_kept_sets_equal(logits_p, top_p=top_p, top_k=torch.randint(0, vocab, (len(top_p),), generator=gen),
                            min_p=0.1)


def test_ties_overflowing_the_candidate_buffer():
    """Rows of one repeated value (every group maximum ties): more groups reach theta than the candidate kernel reads,
    and the fallback gives the reference's kept set."""
    logits = torch.full((3, 200), 0.5)
    logits[1, 7] = 3.0  # one larger token, then 199 ties
    logits[2, ::2] = -1.0
    for filt in (dict(top_k=3), dict(top_p=0.5), dict(top_k=1, top_p=0.9)):
        finished = _assert_kept_sets_equal(logits.bfloat16(), **filt)
        assert not finished[0], filt


@pytest.mark.parametrize("keep,groups_cap,cap", [(1, 2, 4), (64, 64, 512)],
                         ids=["tiny candidate set", "every column a candidate"])
def test_any_candidate_set_size_gives_the_same_kept_sets(monkeypatch, keep, groups_cap, cap):
    fixed = filter_launch.logprob_launch_config
    monkeypatch.setattr(filter_launch, "logprob_launch_config", lambda v_local: replace(
        fixed(v_local), candidate_keep=keep, candidate_groups_cap=groups_cap, candidate_cap=cap))
    logits = _mixed_rows(6, 300, torch.bfloat16, seed=4)
    for filt in (dict(top_k=5), dict(top_p=0.8), dict(min_p=0.02, top_p=0.95), dict(top_k=40, top_p=0.7)):
        finished = _assert_kept_sets_equal(logits, **filt)
        if keep > 300 // 8:
            assert finished.all(), filt  # fewer groups than keep: every column is a candidate, every row finishes
