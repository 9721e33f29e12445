"""The sampling filter through the fused output ops (TP = 1): fused_linear_logprobs and fused_linear_loss with a
``SamplingFilter`` give what the per-token op gives on ``hidden @ weightᵀ`` (itself tested against the float64
reference in test_vocab_parallel_logprobs_filter.py), over several row chunks and with per-row tensors; targets
outside the kept set raise when checked, and are -inf with no gradient when not."""

from __future__ import annotations

import pytest
import torch

from mp_grpo import vocab_parallel_logprobs
from mp_grpo.ops import SamplingFilter
from mp_grpo.ops.fused_linear_logprobs import fused_linear_logprobs
from mp_grpo.ops.fused_linear_loss import fused_linear_loss
from tests.reference import sampling_filter_keep_reference
from tests.tolerances import assert_close

TEMPERATURE = 0.8


def _case(rows: int, hidden_size: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen) * (3.0 / hidden_size**0.5)
    return hidden, weight, gen


def _filters(rows: int, gen: torch.Generator) -> list[SamplingFilter]:
    return [
        SamplingFilter(top_k=5),
        SamplingFilter(top_p=0.8),
        SamplingFilter(top_k=torch.randint(-1, 12, (rows,), generator=gen),
                       top_p=torch.rand(rows, generator=gen) * 0.6 + 0.4, min_p=0.02),
    ]


def _kept_target(hidden, weight, filt: SamplingFilter, gen) -> torch.Tensor:
    keep = sampling_filter_keep_reference(hidden @ weight.t(), top_k=filt.top_k, top_p=filt.top_p, min_p=filt.min_p,
                                          temperature=TEMPERATURE)
    target = torch.multinomial(keep.double(), 1, generator=gen).squeeze(1)
    target[::6] = -100
    return target


def _loss_fn(a: torch.Tensor, b: torch.Tensor):
    def loss_fn(lp, ent):
        ratio = torch.exp(lp - lp.detach())
        return (-torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)).sum() - (b * ent).sum(), None

    return loss_fn


@pytest.mark.parametrize("index", [0, 1, 2], ids=["top_k", "top_p", "per_row"])
def test_fused_ops_with_filter_equal_the_per_token_op(index):
    hidden, weight, gen = _case(14, 16, 40, seed=5 + index)
    filt = _filters(14, gen)[index]
    target = _kept_target(hidden, weight, filt, gen)
    a, b = torch.randn(14, generator=gen), torch.randn(14, generator=gen)
    g_lp, g_ent = torch.randn(14, generator=gen), torch.randn(14, generator=gen)
    results = {}
    for name in ("per_token", "fused_logprobs", "fused_loss"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        common = dict(temperature=TEMPERATURE, with_entropy=True, sampling_filter=filt)
        if name == "per_token":
            lp, ent = vocab_parallel_logprobs(h @ w.t(), target, **common)
        elif name == "fused_logprobs":
            lp, ent = fused_linear_logprobs(h, w, target, chunk_tokens=4, chunk_vocab=9, **common)
        if name == "fused_loss":
            loss, _ = fused_linear_loss(h, w, target, _loss_fn(a, b), chunk_tokens=4, **common)
            loss.backward()
            results[name] = (loss.detach(), h.grad, w.grad)
            continue
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        loss, _ = _loss_fn(a, b)(lp.detach(), ent.detach())
        results[name] = (lp.detach(), ent.detach(), h.grad, w.grad)
        if name == "per_token":  # the loss path's reference: the per-token op + the loss under autograd
            h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            lp2, ent2 = vocab_parallel_logprobs(h2 @ w2.t(), target, **common)
            loss2, _ = _loss_fn(a, b)(lp2, ent2)
            loss2.backward()
            results["per_token_loss"] = (loss2.detach(), h2.grad, w2.grad)
    for x, y, what in zip(results["fused_logprobs"], results["per_token"], ("logprobs", "entropy", "grad h", "grad w")):
        assert_close(x, y, torch.float32, f"fused_linear_logprobs {what} [{filt}]")
    for x, y, what in zip(results["fused_loss"], results["per_token_loss"], ("loss", "grad h", "grad w")):
        assert_close(x, y, torch.float32, f"fused_linear_loss {what} [{filt}]")
    # The filter changed something (the test could fail): the unfiltered log-probs differ.
    plain = vocab_parallel_logprobs(hidden @ weight.t(), target, temperature=TEMPERATURE)
    assert not torch.allclose(plain, results["per_token"][0])


def test_fused_ops_targets_outside_the_filter():
    hidden, weight, gen = _case(9, 16, 40, seed=17)
    filt = SamplingFilter(top_k=3)
    keep = sampling_filter_keep_reference(hidden @ weight.t(), top_k=3)
    target = torch.multinomial(keep.double(), 1, generator=gen).squeeze(1)
    target[[1, 6]] = torch.stack([(~keep[i]).nonzero()[0, 0] for i in (1, 6)])
    with pytest.raises(ValueError, match=r"target: 2 token id\(s\) lie outside the sampling_filter's kept set"):
        fused_linear_logprobs(hidden, weight, target, sampling_filter=filt, chunk_tokens=4)
    with pytest.raises(ValueError, match=r"target: 1 token id\(s\) lie outside"):  # the first chunk's
        fused_linear_loss(hidden, weight, target, _loss_fn(torch.ones(9), torch.zeros(9)), sampling_filter=filt,
                          chunk_tokens=4)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp = fused_linear_logprobs(h, w, target, sampling_filter=filt, chunk_tokens=4, check_inputs=False)
    assert torch.isneginf(lp[[1, 6]]).all() and torch.isfinite(lp[[0, 2, 3, 4, 5, 7, 8]]).all()
    g = torch.zeros(9)
    g[[1, 6]] = 1.0  # only the outside rows' (constant) log-probs: no gradient at all
    lp.backward(g)
    assert (h.grad == 0).all() and (w.grad == 0).all()
