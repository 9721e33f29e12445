"""vocab_parallel_logprobs with a sampling filter (top-k / top-p / min-p), TP = 1, vs the float64 reference.

The reference (tests/reference.py) filters a full-vocabulary float64 softmax from the definitions; a
sort-based transcription of vLLM's top-k / top-p masking checks that the reference follows vLLM's
convention where no tie straddles the threshold, and explicit tie cases pin down the tie rule.
"""

from __future__ import annotations

import pytest
import torch

from mp_grpo import vocab_parallel_logprobs
from mp_grpo.ops import SamplingFilter, count_outside_filter
from tests.reference import filtered_logprobs_reference, logprobs_reference, sampling_filter_keep_reference
from tests.tolerances import assert_close

NEG_INF = float("-inf")


def _case(shape, vocab, dtype, seed, *, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=gen) * scale).to(dtype)
    return logits, gen


def _kept_targets(keep: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One target per row drawn from the kept set (as the rollout engine would have sampled)."""
    flat = keep.reshape(-1, keep.shape[-1]).double()
    return torch.multinomial(flat, 1, generator=gen).reshape(keep.shape[:-1])


def _check(logits, target, filt_kwargs, *, temperature=1.0, with_entropy=True, check_inputs=True):
    x = logits.clone().requires_grad_()
    out = vocab_parallel_logprobs(
        x, target, temperature=temperature, with_entropy=with_entropy, check_inputs=check_inputs,
        sampling_filter=SamplingFilter(**filt_kwargs),
    )
    lp, ent = out if with_entropy else (out, None)
    x_ref = logits.detach().double().requires_grad_()
    lp_ref, ent_ref = filtered_logprobs_reference(x_ref, target, temperature=temperature, **filt_kwargs)
    assert_close(lp, lp_ref, torch.float32, "filtered logprobs")
    finite = torch.isfinite(lp_ref)
    g_lp = torch.where(finite, torch.randn(lp.shape, dtype=torch.float64), 0.0)
    loss, loss_ref = (lp.double() * g_lp).where(finite, 0.0).sum(), (lp_ref * g_lp).where(finite, 0.0).sum()
    if with_entropy:
        assert_close(ent, ent_ref, torch.float32, "filtered entropy")
        g_ent = torch.randn(ent.shape, dtype=torch.float64)
        loss, loss_ref = loss + (ent.double() * g_ent).sum(), loss_ref + (ent_ref * g_ent).sum()
    loss.backward()
    loss_ref.backward()
    assert_close(x.grad, x_ref.grad, logits.dtype, "filtered grad")
    return lp, x.grad


FILTERS = [
    dict(top_k=5),
    dict(top_p=0.9),
    dict(min_p=0.05),
    dict(top_k=12, top_p=0.8, min_p=0.01),
    dict(top_k=1),
    dict(top_p=0.3),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("filt", FILTERS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_filter_matches_reference(dtype, filt):
    logits, gen = _case((5,), 70, dtype, seed=sum(map(ord, repr(filt))))
    temperature = 0.7
    target = _kept_targets(sampling_filter_keep_reference(logits, temperature=temperature, **filt), gen)
    target[1] = -100
    _check(logits, target, filt, temperature=temperature)


def test_per_row_filters_any_leading_shape():
    """Per-row tensors of target.shape ([S, B] here), a row with each filter off, fp16 logits."""
    logits, gen = _case((3, 2), 50, torch.float16, seed=7)
    filt = dict(
        top_k=torch.tensor([[3, 0], [50, 8], [1, -1]]),  # 0 / -1 / >= V: off
        top_p=torch.tensor([[0.9, 1.0], [0.5, 0.95], [0.7, 0.2]]),
        min_p=torch.tensor([[0.0, 0.1], [0.02, 0.0], [0.3, 0.05]]),
    )
    target = _kept_targets(sampling_filter_keep_reference(logits, **filt), gen)
    _check(logits, target, filt)


def test_off_values_equal_the_unfiltered_op_bitwise():
    """top_p = 1, k >= V and min_p = 0 keep everything: the same bits as no filter at all."""
    logits, gen = _case((6,), 40, torch.bfloat16, seed=3)
    target = torch.randint(0, 40, (6,), generator=gen)
    plain, plain_ent = vocab_parallel_logprobs(logits, target, with_entropy=True)
    off = SamplingFilter(top_k=40, top_p=1.0, min_p=0.0)
    lp, ent = vocab_parallel_logprobs(logits, target, with_entropy=True, sampling_filter=off)
    assert torch.equal(lp, plain) and torch.equal(ent, plain_ent)
    # Per-row tensors that switch every row off run the threshold path with -inf: still the same bits.
    off_rows = SamplingFilter(top_k=torch.zeros(6, dtype=torch.long), top_p=torch.ones(6), min_p=torch.zeros(6))
    lp, ent = vocab_parallel_logprobs(logits, target, with_entropy=True, sampling_filter=off_rows)
    assert torch.equal(lp, plain) and torch.equal(ent, plain_ent)


def _vllm_style_keep(z: torch.Tensor, k: int | None, p: float | None) -> torch.Tensor:
    """vLLM's masking transcribed: sort ascending; mask below the k-th largest; softmax; mask where the
    cumulative probability <= 1 - p, always keeping the last (largest) position."""
    ordered, idx = z.sort(dim=-1, descending=False)
    if k is not None:
        kth = ordered[:, -k].unsqueeze(1)
        ordered = ordered.masked_fill(ordered < kth, NEG_INF)
    if p is not None:
        cum = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - p
        drop[:, -1] = False
        ordered = ordered.masked_fill(drop, NEG_INF)
    kept_sorted = torch.isfinite(ordered)
    return torch.zeros_like(kept_sorted).scatter(1, idx, kept_sorted)


@pytest.mark.parametrize("k,p", [(7, None), (None, 0.8), (20, 0.6)])
def test_reference_follows_vllm_without_ties(k, p):
    gen = torch.Generator().manual_seed(11)
    z = torch.randn(40, 60, generator=gen, dtype=torch.float64) * 2  # continuous: no ties
    ours = sampling_filter_keep_reference(z, top_k=k, top_p=p)
    assert torch.equal(ours, _vllm_style_keep(z, k, p))


def test_top_k_keeps_every_tie_at_the_kth_value():
    """k = 3 with the 3rd largest value repeated 4 times: all 4 copies stay (vLLM masks only < kth)."""
    logits = torch.tensor([[5.0, 4.0, 2.0, 2.0, 1.0, 2.0, 0.0, 2.0, -1.0]])
    target = torch.tensor([7])  # one of the tied tokens
    lp, grad = _check(logits, target, dict(top_k=3))
    kept = torch.tensor([5.0, 4.0, 2.0, 2.0, 2.0, 2.0]).double()
    assert abs(lp.item() - (2.0 - torch.logsumexp(kept, 0)).item()) < 1e-5
    assert (grad[0, [4, 6, 8]] == 0).all() and (grad[0, [0, 1, 2, 3, 5, 7]] != 0).all()


def test_top_p_keeps_a_tie_group_straddling_the_boundary_whole():
    """Logits (3, 1, 1, 1, -2): p_max ~ 0.83 < p = 0.9, so vLLM keeps the top token and *some* of the
    three tied 1s (its sort order decides which). The rule here keeps the whole tie group."""
    logits = torch.tensor([[1.0, 3.0, 1.0, -2.0, 1.0]])
    keep = sampling_filter_keep_reference(logits, top_p=0.9)
    assert keep.tolist() == [[True, True, True, False, True]]
    vllm = _vllm_style_keep(logits.double(), None, 0.9)
    assert vllm[0, 1] and 1 <= int(vllm[0, [0, 2, 4]].sum()) <= 3 and not vllm[0, 3]
    _check(logits, torch.tensor([2]), dict(top_p=0.9))
    # Just below the tie group's cut the top token alone is kept.
    p_top = torch.softmax(logits.double(), -1)[0, 1].item()
    keep_tight = sampling_filter_keep_reference(logits, top_p=p_top * 0.999)
    assert keep_tight.tolist() == [[False, True, False, False, False]]
    _check(logits, torch.tensor([1]), dict(top_p=p_top * 0.999))


def test_target_outside_the_kept_set():
    logits, gen = _case((6,), 30, torch.float32, seed=5)
    keep = sampling_filter_keep_reference(logits, top_k=4)
    target = _kept_targets(keep, gen)
    target[2] = int((~keep[2]).nonzero()[0])  # outside
    target[4] = int((~keep[4]).nonzero()[0])  # outside
    target[5] = -100
    filt = SamplingFilter(top_k=4)
    with pytest.raises(ValueError, match=r"target: 2 token id\(s\) lie outside the sampling_filter's kept set"):
        vocab_parallel_logprobs(logits, target, sampling_filter=filt)
    # Unchecked: -inf log-prob, no gradient from it, counted; the entropy's gradient still flows.
    lp, grad = _check(logits, target, dict(top_k=4), check_inputs=False)
    assert torch.isneginf(lp[[2, 4]]).all() and torch.isfinite(lp[[0, 1, 3, 5]]).all()
    assert int(count_outside_filter(lp, target)) == 2
    x = logits.clone().requires_grad_()
    lp = vocab_parallel_logprobs(x, target, sampling_filter=filt, check_inputs=False)
    lp.where(torch.isfinite(lp), 0.0).sum().backward()
    assert (x.grad[[2, 4, 5]] == 0).all() and (x.grad[[0, 1, 3]] != 0).any()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(top_k=0), "sampling_filter.top_k must be an int >= 1"),
        (dict(top_k=2.5), "sampling_filter.top_k must be an int >= 1"),
        (dict(top_p=0.0), r"sampling_filter.top_p must be a float in \(0.0, 1.0\]"),
        (dict(top_p=1.2), r"sampling_filter.top_p must be a float in \(0.0, 1.0\]"),
        (dict(min_p=-0.1), r"sampling_filter.min_p must be a float in \[0.0, 1.0\]"),
        (dict(top_p=torch.tensor([0.5, 0.0])), r"sampling_filter.top_p has values outside \(0.0, 1.0\]"),
        (dict(top_k=torch.tensor([1, 2, 3])), r"sampling_filter.top_k tensor shape \(3,\) must equal target.shape \(2,\)"),
        (dict(top_k=torch.tensor([1.0, 2.0])), "sampling_filter.top_k tensor must be integer"),
    ],
)
def test_bad_filter_arguments_are_named(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        vocab_parallel_logprobs(torch.randn(2, 8), torch.zeros(2, dtype=torch.long), sampling_filter=SamplingFilter(**kwargs))


def test_unfiltered_reference_is_the_filter_off():
    """Sanity of the reference itself: no filter = logprobs_reference."""
    logits, gen = _case((4,), 20, torch.float32, seed=1)
    target = torch.randint(0, 20, (4,), generator=gen)
    a = filtered_logprobs_reference(logits, target)
    b = logprobs_reference(logits, target)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _keep_from_threshold(logits, filt, temperature=1.0):
    from mp_grpo.ops.sampling_filter import filter_threshold

    x = logits.reshape(-1, logits.shape[-1])
    tau = filter_threshold(x, SamplingFilter(**filt), logits.shape[:-1], tp_group=None, inv_temperature=1 / temperature)
    return (x.float() >= tau[:, None]).reshape(logits.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("filt", [dict(top_k=7), dict(top_p=0.6), dict(top_k=30, top_p=0.9), dict(min_p=0.1, top_p=0.95)],
                         ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_radix_select_exact_with_ties_and_extremes(dtype, filt):
    """The threshold search's kept set equals the reference's on rows full of ties (a few distinct values),
    with -0 / +0, -inf, huge and tiny magnitudes, and wide rows (every digit of the key used)."""
    gen = torch.Generator().manual_seed(sum(map(ord, repr(filt) + str(dtype))))
    ties = torch.randint(-4, 5, (6, 300), generator=gen).float() / 2  # 9 distinct values
    wide = torch.randn(6, 300, generator=gen) * torch.logspace(-6, 4, 300)[torch.randperm(300, generator=gen)]
    wide[0, :5] = torch.tensor([-0.0, 0.0, float("-inf"), -1e4, 1e4])
    wide[1, :] = -0.0
    wide[1, 7] = 0.0
    logits = torch.cat([ties, wide]).to(dtype)
    keep_ref = sampling_filter_keep_reference(logits, temperature=0.8, **filt)
    keep = _keep_from_threshold(logits, filt, temperature=0.8)
    assert torch.equal(keep, keep_ref), (keep != keep_ref).nonzero()[:5]


def test_top_p_tie_group_across_the_mass_passes():
    """A tie group straddling p, in bf16 with 300 columns: kept whole (the search's strict 'mass above')."""
    logits = torch.full((1, 300), -8.0)
    logits[0, :3] = 2.0  # 3 tied tops
    logits[0, 100:110] = 1.0
    lp_tie = torch.softmax(logits.double(), -1)
    p = float(lp_tie[0, :3].sum() + lp_tie[0, 100:103].sum())  # inside the group of ten 1.0s
    keep = _keep_from_threshold(logits.bfloat16(), dict(top_p=p))
    assert keep[0, :3].all() and keep[0, 100:110].all() and int(keep.sum()) == 13
