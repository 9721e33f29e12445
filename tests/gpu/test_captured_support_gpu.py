"""The captured support and the top-K log-probs on a CUDA GPU, at real vocabulary sizes (the compiled kernels: 128-id
steps, scattered loads), against the float64 references (tests/reference.py): supports of up to 512 ids — prime-rl's
cap — on a trained policy's rows (the support: each row's largest logits, the sampled token among them), empty rows,
single ids; bf16 and fp32 logits; the logits path, both fused ops, the top-K log-probs at K = 20. Skipped without a GPU.

    python -m pytest tests/gpu/test_captured_support_gpu.py -v
"""

from __future__ import annotations

import pytest
import torch

from mp_grpo import (
    CapturedSupport,
    TokenIds,
    check_errors,
    fused_linear_logprobs,
    fused_linear_loss,
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_with_top_k,
)
from tests.policy_logits import policy_logits
from tests.reference import logprobs_at_ids_reference, support_keep_reference, support_logprobs_reference
from tests.tolerances import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROWS, TEMPERATURE, K = 16, 0.9, 20


def _support(logits: torch.Tensor, gen: torch.Generator) -> tuple[CapturedSupport, torch.Tensor]:
    """Each row's 1 … 512 largest logits (row 0: none; row 1: one id), ids increasing, and a target drawn from the
    support's renormalized distribution."""
    sizes = torch.randint(2, 513, (ROWS,), generator=gen)
    sizes[0], sizes[1] = 0, 1
    rows = [sorted(logits[i].float().topk(int(sizes[i])).indices.tolist()) for i in range(ROWS)]
    support = CapturedSupport.from_lists(rows, device="cuda")
    keep = support_keep_reference(support.indptr.cpu(), support.ids.cpu(), logits.shape)
    z = torch.where(keep, logits.cpu().double() / TEMPERATURE, float("-inf"))
    target = torch.multinomial(torch.softmax(z, -1), 1, generator=gen).squeeze(1)
    target[3] = -100
    return support, target.cuda()


@pytest.mark.parametrize("vocab", [151936, 18992])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_support_matches_reference_on_gpu(vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(vocab % 89)
    logits = policy_logits(ROWS, vocab, seed=vocab % 97, dtype=dtype)
    support, target = _support(logits, gen)
    x = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(x, target, temperature=TEMPERATURE, with_entropy=True, captured_support=support)
    x_ref = logits.cpu().double().requires_grad_()
    lp_ref, ent_ref = support_logprobs_reference(x_ref, target.cpu(), support.indptr.cpu(), support.ids.cpu(),
                                                 temperature=TEMPERATURE)
    assert_close(lp, lp_ref, torch.float32, "logprobs")
    assert_close(ent, ent_ref, torch.float32, "entropy")
    assert lp[1] == 0 and ent[1] == 0, "a support of the target alone"
    g_lp, g_ent = torch.randn(ROWS, dtype=torch.float64), torch.randn(ROWS, dtype=torch.float64)
    ((lp.double().cpu() * g_lp).sum() + (ent.double().cpu() * g_ent).sum()).backward()
    ((lp_ref * g_lp).sum() + (ent_ref * g_ent).sum()).backward()
    assert_close(x.grad, x_ref.grad, dtype, "grad")
    # the top-K log-probs at the engine's K largest ids, over the support (-inf outside it)
    ids = TokenIds.from_lists([logits[i].float().topk(K).indices.tolist() for i in range(ROWS)], device="cuda")
    top_k = vocab_parallel_logprobs_with_top_k(logits, target, ids, temperature=TEMPERATURE,
                                               captured_support=support).top_k
    keep = support_keep_reference(support.indptr.cpu(), support.ids.cpu(), logits.shape)
    want = logprobs_at_ids_reference(logits.cpu(), ids.indptr.cpu(), ids.ids.cpu(), temperature=TEMPERATURE,
                                     keep=keep)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isneginf(top_k.cpu()), torch.isneginf(want))
    assert_close(top_k.cpu()[finite], want[finite], torch.float32, "top-K log-probs")
    check_errors()


@pytest.mark.parametrize("op", ["fused_linear_logprobs", "fused_linear_loss"])
def test_fused_ops_over_a_support_equal_the_logits_path(op: str) -> None:
    """At N = 4096, H = 1024, V = 151936 (several row chunks each way): the fused ops over a support give the logits
    path's log-probs and gradients on the same bf16 logits (to bf16 rounding of the logits' GEMM)."""
    n, hidden_size, vocab = 4096, 1024, 151936
    gen = torch.Generator(device="cuda").manual_seed(3)
    h = (torch.randn(n, hidden_size, device="cuda", generator=gen) * 0.5).bfloat16()
    w = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 0.05).bfloat16()
    logits = (h @ w.t()).float()
    ids = logits.topk(256, dim=-1).indices.sort(dim=-1).values
    support = CapturedSupport(torch.arange(n + 1, device="cuda") * 256, ids.reshape(-1).contiguous())
    target = ids[:, 5]
    g = torch.randn(n, device="cuda", generator=gen)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp = vocab_parallel_logprobs(h1 @ w1.t(), target, captured_support=support)
    (lp * g).sum().backward()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    if op == "fused_linear_logprobs":
        lp2 = fused_linear_logprobs(h2, w2, target, captured_support=support, chunk_tokens=1024)
        (lp2 * g).sum().backward()
    else:
        seen = {}

        def loss_fn(x, _entropy):
            seen["lp"] = x.detach().clone()  # the last call sees every row
            return (x * g).sum(), None

        loss, _ = fused_linear_loss(h2, w2, target, loss_fn, captured_support=support, chunk_tokens=1024)
        loss.backward()
        lp2 = seen["lp"]
    assert_close(lp2, lp.detach(), torch.bfloat16, f"{op} log-probs")
    assert_close(h2.grad.float() / h1.grad.abs().max(), h1.grad.float() / h1.grad.abs().max(), torch.bfloat16,
                 f"{op} hidden gradient")
    check_errors()
