"""vocab_parallel_logprobs with a sampling filter on a CUDA GPU, at real vocabulary sizes, vs the float64
reference that filters the full softmax (tests/reference.py), on a trained policy's rows (the candidates of the
statistics' read finish the search) and on flat rows (top-p takes the radix fallback). Skipped without a GPU.

    python -m pytest tests/gpu/test_logprob_filter.py tests/gpu/test_logprob_batch_invariance.py -v
"""

from __future__ import annotations

import pytest
import torch

from mp_grpo import check_errors, vocab_parallel_logprobs
from mp_grpo.ops import SamplingFilter, count_outside_filter
from tests.policy_logits import flat_logits, policy_logits
from tests.reference import filtered_logprobs_reference, sampling_filter_keep_reference
from tests.tolerances import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FILTERS = [
    dict(top_k=20),
    dict(top_k=50),
    dict(top_p=0.9),
    dict(top_p=0.95),
    dict(min_p=0.05),
    dict(top_k=50, top_p=0.95, min_p=0.01),
]


@pytest.mark.parametrize("rows", ["policy", "flat"])
@pytest.mark.parametrize("vocab", [151936, 18992])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("filt", FILTERS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_filter_matches_reference_on_gpu(vocab, dtype, filt, rows):
    make = policy_logits if rows == "policy" else flat_logits
    logits = make(16, vocab, seed=vocab % 97, dtype=dtype)
    temperature = 0.9
    keep_ref = sampling_filter_keep_reference(logits.cpu(), temperature=temperature, **filt)
    # The op's kept set: the float64 reference's, up to the one boundary tie group that fp32 mass sums may
    # put on the other side (top-p; at V = 151936 in fp32 a boundary token's mass is ~3e-6 of the total, and
    # p * S falls within fp32 rounding of it in a few % of rows). The values are then compared on that set.
    keep = _kept_set(logits, filt, temperature)
    _assert_admissible(keep, keep_ref, logits, filt)
    gen = torch.Generator().manual_seed(1)
    target = torch.multinomial((keep & keep_ref).double(), 1, generator=gen).squeeze(1).cuda()
    target[3] = -100
    x = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(x, target, temperature=temperature, with_entropy=True,
                                      sampling_filter=SamplingFilter(**filt))
    x_ref = logits.cpu().double().requires_grad_()
    lp_ref, ent_ref = filtered_logprobs_reference(x_ref, target.cpu(), temperature=temperature, keep=keep)
    assert_close(lp, lp_ref, torch.float32, "logprobs")
    assert_close(ent, ent_ref, torch.float32, "entropy")
    g_lp, g_ent = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    ((lp.double().cpu() * g_lp).sum() + (ent.double().cpu() * g_ent).sum()).backward()
    ((lp_ref * g_lp).sum() + (ent_ref * g_ent).sum()).backward()
    assert_close(x.grad, x_ref.grad, dtype, "grad")


def test_per_row_filters_and_outside_targets_on_gpu():
    logits = flat_logits(8, 18992, seed=3)
    filt = dict(top_k=torch.tensor([20, 0, 50, 1, 5, 100, 0, 7], device="cuda"),
                top_p=torch.tensor([0.9, 0.95, 1.0, 0.5, 0.8, 0.9, 0.99, 1.0], device="cuda"))
    keep = sampling_filter_keep_reference(logits.cpu(), **{k: v.cpu() for k, v in filt.items()})
    target = torch.multinomial(keep.double(), 1, generator=torch.Generator().manual_seed(2)).squeeze(1)
    target[5] = int((~keep[5]).nonzero()[0])  # outside the kept set
    target = target.cuda()
    lp = vocab_parallel_logprobs(logits, target, sampling_filter=SamplingFilter(**filt), check_inputs=False)
    lp_ref, _ = filtered_logprobs_reference(logits.cpu(), target.cpu(), **{k: v.cpu() for k, v in filt.items()})
    assert_close(lp, lp_ref, torch.float32, "logprobs")
    assert int(count_outside_filter(lp, target)) == 1
    # Checked: recorded on the device (no host read), raised at the next check_errors().
    vocab_parallel_logprobs(logits, target, sampling_filter=SamplingFilter(**filt))
    with pytest.raises(ValueError, match="outside the sampling_filter's kept set"):
        check_errors()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_threshold_search_kept_set_exact_on_gpu(dtype):
    """The threshold search's kept set (candidates and radix fallback) equals the float64 reference's at V = 151936,
    flat and trained-policy rows, rows with ties included."""
    logits = flat_logits(12, 151936, seed=5, dtype=dtype)
    logits[6:] = policy_logits(6, 151936, seed=5, dtype=dtype)
    logits[:4] = (logits[:4].float() * 2).round().to(dtype) / 2  # heavy ties
    for filt in (dict(top_k=20), dict(top_p=0.9), dict(top_k=50, top_p=0.95), dict(min_p=0.01, top_p=0.99)):
        keep = _kept_set(logits, filt, 0.9)
        keep_ref = sampling_filter_keep_reference(logits.cpu(), temperature=0.9, **filt)
        _assert_admissible(keep, keep_ref, logits, filt)


def _kept_set(logits: torch.Tensor, filt: dict, temperature: float) -> torch.Tensor:
    """The op's kept set (CPU bool): logits >= the threshold its search finds."""
    from mp_grpo.ops.sampling_filter import filter_threshold

    tau = filter_threshold(logits, SamplingFilter(**filt), logits.shape[:-1], tp_group=None,
                           inv_temperature=1 / temperature)
    return (logits.float() >= tau[:, None]).cpu()


def _assert_admissible(keep: torch.Tensor, keep_ref: torch.Tensor, logits: torch.Tensor, filt: dict) -> None:
    """``keep`` equals the float64 reference's kept set; with top-p or min-p, a row may differ by one tie group
    at the boundary (the smallest kept value of either set) — top-p's masses are fp32 sums and min-p's
    threshold an fp32 sum, the reference's float64 — and nothing else. Top-k's counts are exact."""
    if "top_p" not in filt and "min_p" not in filt:
        assert torch.equal(keep, keep_ref), (filt, (keep != keep_ref).sum(-1))
        return
    for row in (keep != keep_ref).any(-1).nonzero().flatten().tolist():
        values = logits[row].float().cpu()
        differing = values[keep[row] != keep_ref[row]]
        boundary = values[keep[row] | keep_ref[row]].min()
        assert (differing == boundary).all(), (filt, row, differing[:8], boundary)


def test_fused_ops_with_filter_on_gpu():
    """fused_linear_logprobs / fused_linear_loss with a filter equal the per-token op on hidden @ weightᵀ (bf16)."""
    from mp_grpo.ops.fused_linear_logprobs import fused_linear_logprobs
    from mp_grpo.ops.fused_linear_loss import fused_linear_loss

    gen = torch.Generator(device="cuda").manual_seed(8)
    n, hidden_size, vocab = 512, 256, 18992
    hidden = torch.randn(n, hidden_size, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 0.2).bfloat16()
    filt = SamplingFilter(top_k=torch.randint(0, 60, (n,), device="cuda", generator=gen),
                          top_p=torch.rand(n, device="cuda", generator=gen) * 0.3 + 0.7)
    logits = hidden @ weight.t()
    keep = sampling_filter_keep_reference(logits.cpu(), top_k=filt.top_k.cpu(), top_p=filt.top_p.cpu())
    target = torch.multinomial(keep.double(), 1, generator=torch.Generator().manual_seed(3)).squeeze(1).cuda()
    g = torch.randn(n, device="cuda", generator=gen)
    out = {}
    for name in ("per_token", "fused", "fused_loss"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if name == "per_token":
            lp = vocab_parallel_logprobs(h @ w.t(), target, sampling_filter=filt)
        elif name == "fused":
            lp = fused_linear_logprobs(h, w, target, sampling_filter=filt, chunk_tokens=128)
        if name == "fused_loss":
            loss, _ = fused_linear_loss(h, w, target, lambda lp, _e: ((lp * g).sum(), None), sampling_filter=filt,
                                        chunk_tokens=128)
            loss.backward()
        else:
            (lp * g).sum().backward()
            out[name + "_lp"] = lp.detach()
        out[name] = (h.grad.float(), w.grad.float())
    check_errors()
    assert_close(out["fused_lp"], out["per_token_lp"], torch.float32, "fused log-probs")
    for name in ("fused", "fused_loss"):
        for actual, expected, what in zip(out[name], out["per_token"], ("grad hidden", "grad weight")):
            err = (actual - expected).norm() / expected.norm()
            assert err < 2e-2, f"{name} {what}: relative L2 error {err:.2e}"


def test_trained_policy_rows_finish_on_the_candidates_and_flat_rows_fall_back():
    """At V = 151936 (bf16): top-k (k <= 128) and top-k + top-p finish on the candidates for every row; top-p on a
    trained policy's rows too, on flat rows never — and the kept sets are the reference's either way."""
    from mp_grpo.ops.sampling_filter import threshold_search

    policy = policy_logits(32, 151936, seed=2)
    flat = flat_logits(32, 151936, seed=2)
    for logits, filt, expect in ((policy, dict(top_k=50), True), (flat, dict(top_k=128), True),
                                 (policy, dict(top_p=0.95), True), (flat, dict(top_p=0.95), False),
                                 (flat, dict(top_k=50, top_p=0.95), True)):
        search = threshold_search(logits, SamplingFilter(**filt), logits.shape[:-1], tp_group=None,
                                  inv_temperature=1.0)
        finished = search.finished.bool().cpu()
        assert finished.all() if expect else not finished.any(), (filt, finished)
        keep_ref = sampling_filter_keep_reference(logits.cpu(), **filt)
        _assert_admissible((logits.float() >= search.tau[:, None]).cpu(), keep_ref, logits, filt)
