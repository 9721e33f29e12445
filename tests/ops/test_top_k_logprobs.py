"""The trainer's log-probs at the rollout engine's top-K ids (``top_k_ids=TokenIds(indptr, ids)``), taken in the
log-prob ops' own forward, against the float64 log-softmax gathered at the ids (``tests/reference.py``).

Every op that takes them — ``vocab_parallel_logprobs_with_top_k``, ``fused_linear_logprobs_with_top_k`` (several
forward chunks) and ``fused_linear_loss(top_k_ids=)`` (``loss_fn`` receives them, the chunks so far filled in) —
normalized over the whole vocabulary, a sampling filter's kept set or a captured support (-inf at an id outside it);
rows with no ids, ids in any order and repeated; the values are not differentiable and the targets' log-probs and
gradients are those of the op without top-K, bitwise. TP = 2: ``check_top_k_tensor_parallel``, run in the launch of
``tests/ops/test_captured_support.py``.
"""

from __future__ import annotations

import pytest
import torch

from mp_grpo import (
    CapturedSupport,
    TokenIds,
    fused_linear_logprobs,
    fused_linear_logprobs_with_top_k,
    fused_linear_loss,
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_with_top_k,
)
from mp_grpo.ops import SamplingFilter
from tests.reference import logprobs_at_ids_reference, sampling_filter_keep_reference, support_keep_reference
from tests.tolerances import assert_close

N, V, K, TEMPERATURE = 8, 40, 5, 0.8


def _case(seed: int = 0):
    """Logits ``[N, V]``, targets, and K ids a row (row 1: none, row 2: 2 ids, one repeated; the others the K largest
    logits in descending order, as an engine reports its top-K, plus row 6's a random id far below)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=gen) * 2.5
    target = logits.argmax(-1)
    target[3] = -100
    rows = [logits[i].topk(K).indices.tolist() for i in range(N)]
    rows[1] = []
    rows[2] = [rows[2][1], rows[2][1]]
    rows[6] = rows[6] + [int(logits[6].argmin())]
    return logits, target, TokenIds.from_lists(rows)


def _support(logits, target) -> CapturedSupport:
    """The 6 largest logits of each row (the target among them), row 4 none: some top-K ids lie outside."""
    rows = [sorted(logits[i].topk(6).indices.tolist()) for i in range(N)]
    rows[4] = []
    return CapturedSupport.from_lists(rows)


RESTRICTIONS = {
    "whole vocabulary": lambda logits, target: ({}, None),
    "sampling filter": lambda logits, target: (dict(sampling_filter=SamplingFilter(top_k=4)),
                                               sampling_filter_keep_reference(logits, top_k=4,
                                                                              temperature=TEMPERATURE)),
    "captured support": lambda logits, target: (dict(captured_support=(s := _support(logits, target))),
                                                support_keep_reference(s.indptr, s.ids, logits.shape)),
}


def _ops(logits, target, ids, kwargs, g, fused: bool = True):
    """name -> (top-K values, the targets' log-probs, the logits' gradient) of each op (the fused ones too)."""
    eye = torch.eye(V)
    out = {}
    x = logits.clone().requires_grad_()
    r = vocab_parallel_logprobs_with_top_k(x, target, ids, temperature=TEMPERATURE, check_inputs=False, **kwargs)
    (r.logprobs.where(torch.isfinite(r.logprobs), 0.0) * g).sum().backward()
    out["vocab_parallel_logprobs_with_top_k"] = (r.top_k, r.logprobs, x.grad)
    if not fused:
        return out
    h = logits.clone().requires_grad_()
    r = fused_linear_logprobs_with_top_k(h, eye, target, ids, temperature=TEMPERATURE, check_inputs=False,
                                         chunk_tokens=3, chunk_vocab=16, **kwargs)
    (r.logprobs.where(torch.isfinite(r.logprobs), 0.0) * g).sum().backward()
    out["fused_linear_logprobs_with_top_k"] = (r.top_k, r.logprobs, h.grad)
    h = logits.clone().requires_grad_()
    seen = []

    def loss_fn(lp, ent, top_k):
        seen.append((lp.detach().clone(), top_k.clone()))
        return (lp.where(torch.isfinite(lp), 0.0) * g).sum(), None

    loss, _ = fused_linear_loss(h, eye, target, loss_fn, temperature=TEMPERATURE, check_inputs=False, chunk_tokens=3,
                                top_k_ids=ids, **kwargs)
    loss.backward()
    # every chunk's call saw the rows so far: their entries filled in, the later rows' still 0
    first_rows = int(ids.indptr[3])
    assert len(seen) == 3 and (seen[0][1][first_rows:] == 0).all()
    out["fused_linear_loss(top_k_ids=)"] = (seen[-1][1], seen[-1][0], h.grad)
    return out


@pytest.mark.parametrize("restriction", list(RESTRICTIONS))
def test_matches_the_gathered_reference(restriction: str) -> None:
    logits, target, ids = _case()
    kwargs, keep = RESTRICTIONS[restriction](logits, target)
    want = logprobs_at_ids_reference(logits, ids.indptr, ids.ids, temperature=TEMPERATURE, keep=keep)
    if keep is not None:
        assert torch.isneginf(want).any() and torch.isfinite(want).any(), "ids on both sides of the kept set"
    g = torch.randn(N, generator=torch.Generator().manual_seed(1))
    x = logits.clone().requires_grad_()
    plain = vocab_parallel_logprobs(x, target, temperature=TEMPERATURE, check_inputs=False, **kwargs)
    (plain.where(torch.isfinite(plain), 0.0) * g).sum().backward()
    # the filter's threshold reaches the gather kernel alike in every op: the logits path alone (its search is slow
    # under the interpreter)
    for name, (top_k, lp, grad) in _ops(logits, target, ids, kwargs, g, fused=restriction != "sampling filter").items():
        assert top_k.dtype == torch.float32 and top_k.shape == ids.ids.shape and not top_k.requires_grad, name
        assert torch.equal(torch.isneginf(top_k), torch.isneginf(want)), f"{name}: -inf outside the kept set"
        finite = torch.isfinite(want)
        assert_close(top_k[finite], want[finite], torch.float32, f"{name}, {restriction}")
        # the rest of the op is the op without top-K
        assert torch.equal(lp, plain.detach()), name
        if name == "vocab_parallel_logprobs_with_top_k":
            assert torch.equal(grad, x.grad), name


def test_entropy_and_none() -> None:
    logits, target, ids = _case()
    r = vocab_parallel_logprobs_with_top_k(logits, target, ids, with_entropy=True)
    lp, ent = vocab_parallel_logprobs(logits, target, with_entropy=True)
    assert torch.equal(r.entropy, ent) and torch.equal(r.logprobs, lp)
    assert vocab_parallel_logprobs_with_top_k(logits, target, ids).entropy is None
    assert fused_linear_logprobs_with_top_k(logits, torch.eye(V), target, ids).entropy is None
    # an op's result without top-K is unchanged by the top-K ids
    assert torch.equal(fused_linear_logprobs(logits, torch.eye(V), target),
                       fused_linear_logprobs_with_top_k(logits, torch.eye(V), target, ids).logprobs)


@pytest.mark.parametrize("ids,match", [
    (TokenIds(torch.tensor([0, 1]), torch.tensor([3])), r"top_k_ids.indptr has 2 entries but target \(8,\) holds 8"),
    (TokenIds(torch.arange(N + 1), torch.tensor([3, 4, 5, 6, 7, 8, 9, V])),
     r"top_k_ids: 1 violation.*ids in \[0, 40\)"),
    (TokenIds(torch.tensor([0, 2, 1, 3, 4, 5, 6, 7, 8]), torch.arange(8)), r"top_k_ids: \d violation"),
])
def test_bad_ids_are_named(ids, match) -> None:
    logits, target, _ = _case()
    with pytest.raises(ValueError, match=match):
        vocab_parallel_logprobs_with_top_k(logits, target, ids)


def check_top_k_tensor_parallel() -> None:
    """Under torchrun (TP = world size): each rank's vocabulary shard; the ids of every row on several shards; the
    three ops, unrestricted and with a captured support, against the float64 reference."""
    import torch.distributed as dist

    size, rank = dist.get_world_size(), dist.get_rank()
    v_local = V // size
    logits, target, ids = _case(seed=7)
    assert len({i // v_local for i in ids.ids.tolist()}) == size
    for restriction in ("whole vocabulary", "captured support"):
        kwargs, keep = RESTRICTIONS[restriction](logits, target)
        want = logprobs_at_ids_reference(logits, ids.indptr, ids.ids, temperature=TEMPERATURE, keep=keep)
        shard = logits[:, rank * v_local:(rank + 1) * v_local].contiguous()
        w = torch.eye(V)[rank * v_local:(rank + 1) * v_local].contiguous()
        results = {
            "logits path": vocab_parallel_logprobs_with_top_k(shard, target, ids, temperature=TEMPERATURE,
                                                              tp_group=dist.group.WORLD, **kwargs).top_k,
            "fused_linear_logprobs": fused_linear_logprobs_with_top_k(
                logits, w, target, ids, temperature=TEMPERATURE, tp_group=dist.group.WORLD, chunk_tokens=3,
                **kwargs).top_k,
        }
        seen = []
        fused_linear_loss(logits, w, target, lambda lp, ent, top_k: (seen.append(top_k.clone()) or lp.sum(), None),
                          temperature=TEMPERATURE, tp_group=dist.group.WORLD, chunk_tokens=3, top_k_ids=ids, **kwargs)
        results["fused_linear_loss"] = seen[-1]
        for name, top_k in results.items():
            assert torch.equal(torch.isneginf(top_k), torch.isneginf(want)), f"TP {size} {name}, {restriction}"
            finite = torch.isfinite(want)
            assert_close(top_k[finite], want[finite], torch.float32, f"TP {size} {name}, {restriction}")
