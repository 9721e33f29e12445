"""The log-prob ops over the rollout engine's captured support (``captured_support=CapturedSupport(indptr, ids)``)
against the float64 reference of each token's distribution renormalized over its support (``tests/reference.py``).

Random supports (``random_support``): empty ones (the whole vocabulary), single ids (the target alone: log-prob 0,
entropy 0, no gradient), the target at either edge of its support, ids spread over the vocabulary (both shards at
TP = 2), and logits outside a support larger than inside it (a support that leaked them would show at once). Every
path that takes a support: ``vocab_parallel_logprobs`` (in place or not, fp32 / bf16, temperature), both fused
output-layer ops (an identity output weight makes the hidden state's gradient the logits'), ``GRPOLoss.on_logits`` on
both loss backends (equal to the log-prob op followed by the loss); gradients through random upstream gradients.
A target outside its support: the first such token named when checked (at once on the CPU, at ``check_errors`` when
deferred), -inf and no gradient when not. Bad CSRs name the argument. TP = 2 under torchrun (gloo), one launch.
"""

from __future__ import annotations

import pytest
import torch

from mp_grpo import fused_linear_logprobs, fused_linear_loss, vocab_parallel_logprobs
from mp_grpo.loss import GlobalBatch, GRPOLoss, LossBackend
from mp_grpo.ops import CapturedSupport, SamplingFilter, count_outside_filter
from mp_grpo.ops.checks import check_errors, deferred_checks
from tests.distributed import torchrun, worker_main
from tests.reference import support_logprobs_reference
from tests.tolerances import assert_close

N, V, TEMPERATURE = 9, 32, 0.7


def random_support(logits: torch.Tensor, gen: torch.Generator) -> tuple[CapturedSupport, torch.Tensor]:
    """A support per row of ``logits`` ``[N, V]`` and a target in each (row 2: ignore_index), in increasing id order:
    row 0 empty, row 1 the target alone, row 3 the target its smallest id, row 4 its largest, the others random sizes
    spread over the vocabulary. The logits outside every support are raised above those inside (in place)."""
    n, vocab = logits.shape
    rows, targets = [], []
    for i in range(n):
        if i == 0:
            rows.append([])
            targets.append(int(torch.randint(0, vocab, (1,), generator=gen)))
            continue
        size = 1 if i == 1 else int(torch.randint(2, vocab // 2, (1,), generator=gen))
        ids = sorted(torch.randperm(vocab, generator=gen)[:size].tolist())
        target = ids[0] if i in (1, 3) else ids[-1] if i == 4 else ids[int(torch.randint(0, size, (1,), generator=gen))]
        rows.append(ids)
        targets.append(target)
        outside = torch.ones(vocab, dtype=torch.bool)
        outside[ids] = False
        logits[i, outside] += 4.0
    targets[2] = -100
    return CapturedSupport.from_lists(rows), torch.tensor(targets)


def _case(dtype: torch.dtype = torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=gen) * 3.0
    support, target = random_support(logits, gen)
    return logits.to(dtype), support, target, torch.randn(N, generator=gen), torch.randn(N, generator=gen)


def _reference(logits, support, target, g_lp, g_ent):
    """Float64 log-probs, entropy and d(Σ g_lp·lp + g_ent·H)/dlogits of the support-renormalized distributions."""
    x = logits.detach().double().requires_grad_()
    lp, ent = support_logprobs_reference(x, target, support.indptr, support.ids, temperature=TEMPERATURE)
    (lp * g_lp.double() + ent * g_ent.double()).sum().backward()
    return lp.detach(), ent.detach(), x.grad


def _logits_path(logits, support, target, g_lp, g_ent, inplace: bool = False, **kwargs):
    x = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(x if not inplace else x.clone(), target, temperature=TEMPERATURE,
                                      with_entropy=True, captured_support=support, inplace_backward=inplace, **kwargs)
    (lp * g_lp + ent * g_ent).sum().backward()
    return lp, ent, x.grad


def _identity(logits, rank: int = 0, size: int = 1) -> torch.Tensor:
    v_local = logits.shape[1] // size
    return torch.eye(logits.shape[1], dtype=logits.dtype)[rank * v_local:(rank + 1) * v_local].contiguous()


def _fused_logprobs(logits, support, target, g_lp, g_ent, rank: int = 0, size: int = 1, **kwargs):
    h = logits.clone().requires_grad_()
    lp, ent = fused_linear_logprobs(h, _identity(logits, rank, size), target, temperature=TEMPERATURE,
                                    with_entropy=True, captured_support=support, chunk_tokens=4, chunk_vocab=8,
                                    **kwargs)
    (lp * g_lp + ent * g_ent).sum().backward()
    return lp, ent, h.grad


def _fused_loss(logits, support, target, g_lp, g_ent, rank: int = 0, size: int = 1, **kwargs):
    h = logits.clone().requires_grad_()
    seen = {}

    def loss_fn(lp, ent):
        seen["lp"], seen["ent"] = lp.detach().clone(), ent.detach().clone()
        return (lp * g_lp).sum() + (ent * g_ent).sum(), None

    loss, _ = fused_linear_loss(h, _identity(logits, rank, size), target, loss_fn, temperature=TEMPERATURE,
                                with_entropy=True, captured_support=support, chunk_tokens=4, **kwargs)
    loss.backward()
    return seen["lp"], seen["ent"], h.grad


PATHS = {"logits path": _logits_path, "logits path, in place": lambda *a: _logits_path(*a, inplace=True),
         "fused_linear_logprobs": _fused_logprobs, "fused_linear_loss": _fused_loss}


def _assert_matches(lp, ent, grad, ref, dtype, what):
    lp_r, ent_r, grad_r = ref
    assert_close(lp, lp_r, torch.float32, f"{what}: log-probs")
    assert_close(ent, ent_r, torch.float32, f"{what}: entropy")
    scale = float(grad_r.abs().max())
    assert_close(grad.double() / scale, grad_r / scale, dtype, f"{what}: gradient")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", list(PATHS))
def test_matches_the_renormalized_reference(path: str, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and path.startswith("fused"):
        pytest.skip("the fused ops' bf16 logits are rounded GEMM outputs: the logits path covers bf16")
    logits, support, target, g_lp, g_ent = _case(dtype)
    ref = _reference(logits, support, target, g_lp, g_ent)
    lp, ent, grad = PATHS[path](logits, support, target, g_lp, g_ent)
    _assert_matches(lp, ent, grad, ref, dtype, path)
    # outside each row's support no gradient, exactly (the rows with one: all but row 0)
    keep = torch.zeros(N, V, dtype=torch.bool)
    for i, ids in enumerate(support.indptr.diff().tolist()):
        lo = int(support.indptr[i])
        keep[i, support.ids[lo:lo + ids]] = ids > 0
    assert (grad[1:][~keep[1:]] == 0).all()


def test_edge_cases_exact() -> None:
    """A support of the target alone: log-prob 0, entropy 0, a zero gradient; an empty support: the unrestricted op,
    bitwise; a support of every id: the unrestricted values."""
    logits, support, target, g_lp, g_ent = _case()
    lp, ent, grad = _logits_path(logits, support, target, g_lp, g_ent)
    assert lp[1] == 0 and ent[1] == 0 and (grad[1] == 0).all()
    free = torch.zeros(N + 1, dtype=torch.int64)
    plain_lp, plain_ent, plain_grad = _logits_path(logits, CapturedSupport(free, torch.zeros(0, dtype=torch.int64)),
                                                   target, g_lp, g_ent)
    ref_lp, ref_ent = vocab_parallel_logprobs(logits, target, temperature=TEMPERATURE, with_entropy=True)
    assert torch.equal(plain_lp, ref_lp) and torch.equal(plain_ent, ref_ent)
    assert torch.equal(lp[0], ref_lp[0]) and torch.equal(ent[0], ref_ent[0]) and torch.equal(grad[0], plain_grad[0])
    everything = CapturedSupport(torch.arange(N + 1) * V, torch.arange(V).repeat(N))
    all_lp, all_ent = vocab_parallel_logprobs(logits, target, temperature=TEMPERATURE, with_entropy=True,
                                              captured_support=everything)
    assert_close(all_lp, ref_lp, torch.float32, "support of every id")
    assert_close(all_ent, ref_ent, torch.float32, "support of every id")


@pytest.mark.parametrize("backend", [LossBackend.TORCH, LossBackend.TRITON], ids=["torch", "triton"])
def test_on_logits_equals_the_two_ops(backend: LossBackend) -> None:
    """GRPOLoss.on_logits with a support: the log-prob op with the support then the loss (values and gradients)."""
    from mp_grpo.config import load_config

    gen = torch.Generator().manual_seed(3)
    logits, support, target, _, _ = _case(seed=3)
    rows = logits.view(3, 3, V)
    t = target.view(3, 3)
    mask = t != -100
    lp_ref, ent_ref = support_logprobs_reference(logits, target, support.indptr, support.ids, temperature=TEMPERATURE)
    old = (lp_ref.float() + 0.1 * torch.randn(N, generator=gen)).view(3, 3)
    adv = torch.randn(3, generator=gen)
    cfg = load_config(None, ["entropy.bonus_coef=0.01", "kl.coef=0.0"])
    batch = GlobalBatch.from_rollouts(cfg, [mask], old_logprobs=[old], entropies=[ent_ref.float().view(3, 3)])
    loss = GRPOLoss(cfg, backend=backend)
    x = rows.clone().requires_grad_()
    share, _ = loss.on_logits(x, t, old, adv, mask, temperature=TEMPERATURE, captured_support=support, batch=batch)
    share.backward()
    y = rows.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(y, t, temperature=TEMPERATURE, with_entropy=True, captured_support=support)
    share2, _ = loss(lp, old, adv, mask, entropy=ent, batch=batch)
    share2.backward()
    torch.testing.assert_close(share, share2, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-7)


def test_target_outside_its_support() -> None:
    logits, support, target, g_lp, g_ent = _case()
    lo = int(support.indptr[5])
    bad = target.clone()
    outside = sorted(set(range(V)) - set(support.ids[lo:int(support.indptr[6])].tolist()))
    bad[5] = outside[0]
    bad[7] = sorted(set(range(V)) - set(support.ids[int(support.indptr[7]):int(support.indptr[8])].tolist()))[-1]
    with pytest.raises(ValueError, match=r"target: 2 token\(s\) lie outside their captured_support.*first is token 5"):
        vocab_parallel_logprobs(logits, bad, captured_support=support)
    with deferred_checks():  # as on a GPU: counted on the device, raised at check_errors with the first token
        vocab_parallel_logprobs(logits, bad, captured_support=support)
        with pytest.raises(ValueError, match=r"the first is token 5 .*\[recorded on the device"):
            check_errors()
    # unchecked: -inf, no gradient from it (its entropy's still flows), counted
    lp, _, grad = _logits_path(logits, support, bad, g_lp, g_ent, check_inputs=False)
    assert torch.isneginf(lp[[5, 7]]).all() and torch.isfinite(lp[[0, 1, 3, 4, 6, 8]]).all()
    assert int(count_outside_filter(lp, bad)) == 2
    x = logits.clone().requires_grad_()
    lp = vocab_parallel_logprobs(x, bad, captured_support=support, check_inputs=False, temperature=TEMPERATURE)
    lp.where(torch.isfinite(lp), 0.0).sum().backward()
    assert (x.grad[[2, 5, 7]] == 0).all() and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("build,match", [
    (lambda: CapturedSupport(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3])),
     r"captured_support.indptr must be a 1-D int64 tensor"),
    (lambda: CapturedSupport(torch.tensor([0, 1]), torch.tensor([[3]])), r"captured_support.ids must be a 1-D int64"),
    (lambda: CapturedSupport(torch.tensor([0, 2]), torch.tensor([3, 4])),
     r"captured_support.indptr has 2 entries but target \(3,\) holds 3 tokens"),
    (lambda: CapturedSupport(torch.tensor([0, 2, 1, 2]), torch.tensor([3, 4])), r"captured_support: \d violation"),
    (lambda: CapturedSupport(torch.tensor([0, 1, 2, 3]), torch.tensor([3, 4, 8])), r"ids in \[0, 8\)"),
    (lambda: CapturedSupport(torch.tensor([0, 2, 2, 3]), torch.tensor([4, 3, 1])),
     r"captured_support: 1 violation.*strictly increasing"),
    (lambda: CapturedSupport(torch.tensor([0, 2, 2, 3]), torch.tensor([3, 3, 1])), r"strictly increasing"),
    (lambda: CapturedSupport(torch.tensor([0, 1, 2, 4]), torch.tensor([3, 4, 1])), r"indptr\[-1\] = len\(ids\) = 3"),
])
def test_bad_supports_are_named(build, match) -> None:
    logits, target = torch.randn(3, 8), torch.tensor([3, 4, 1])
    with pytest.raises((TypeError, ValueError), match=match):
        vocab_parallel_logprobs(logits, target, captured_support=build())


def test_unchecked_bad_support_reads_nothing_out_of_bounds() -> None:
    """check_inputs=False: a malformed CSR runs without reading out of bounds — a row whose end is not past its start
    reads as empty (unrestricted), an id outside the vocabulary belongs to no shard."""
    logits, target = torch.randn(3, 8), torch.tensor([3, 4, 1])
    broken = CapturedSupport(torch.tensor([0, 5, 2, 9]), torch.tensor([3, 4, 7, 100, -3]))
    lp = vocab_parallel_logprobs(logits, target, captured_support=broken, check_inputs=False)
    assert lp.shape == (3,) and not torch.isnan(lp).any()


def test_support_and_filter_are_refused() -> None:
    logits, target = torch.randn(2, 8), torch.tensor([3, 4])
    support = CapturedSupport.from_lists([[3], [4, 5]])
    with pytest.raises(ValueError, match="captured_support and sampling_filter: pass one"):
        vocab_parallel_logprobs(logits, target, captured_support=support, sampling_filter=SamplingFilter(top_k=2))


def test_sorted_orders_each_token() -> None:
    support = CapturedSupport.from_lists([[5, 1, 3], [], [7, 2]]).sorted()
    assert support.ids.tolist() == [1, 3, 5, 2, 7] and support.indptr.tolist() == [0, 3, 3, 5]


def test_tensor_parallel() -> None:
    """TP = 2 under torchrun: each rank's shard of the logits (the support's ids on both), the logits path and both
    fused ops, fp32 and bf16 (logits path), against the float64 reference; the top-K log-probs
    (tests/ops/test_top_k_logprobs.py) in the same launch."""
    torchrun(__file__, "case_tensor_parallel", nproc=2)


def case_tensor_parallel() -> None:
    import torch.distributed as dist

    from tests.ops.test_top_k_logprobs import check_top_k_tensor_parallel

    size, rank = dist.get_world_size(), dist.get_rank()
    tp = dict(tp_group=dist.group.WORLD)
    v_local = V // size
    for dtype in (torch.float32, torch.bfloat16):
        logits, support, target, g_lp, g_ent = _case(dtype, seed=5)
        owners = {i // v_local for i in support.ids.tolist()}
        assert owners == set(range(size)), "the supports' ids lie on every shard"
        ref_lp, ref_ent, ref_grad = _reference(logits, support, target, g_lp, g_ent)
        shard = logits[:, rank * v_local:(rank + 1) * v_local].contiguous()
        lp, ent, grad = _logits_path(shard, support, target, g_lp, g_ent, **tp)
        _assert_matches(lp, ent, grad, (ref_lp, ref_ent, ref_grad[:, rank * v_local:(rank + 1) * v_local]), dtype,
                        f"TP {size} logits path, {dtype}")
        if dtype == torch.float32:
            for name, fn in (("fused_linear_logprobs", _fused_logprobs), ("fused_linear_loss", _fused_loss)):
                lp, ent, grad_h = fn(logits, support, target, g_lp, g_ent, rank=rank, size=size, **tp)
                dist.all_reduce(grad_h)  # the hidden state's gradient: summed over the shards by the caller
                _assert_matches(lp, ent, grad_h, (ref_lp, ref_ent, ref_grad), dtype, f"TP {size} {name}")
    check_top_k_tensor_parallel()


if __name__ == "__main__":
    worker_main({"case_tensor_parallel": case_tensor_parallel})
