"""fp32 logits (``LogitDtype.FP32``) on a GPU: the compiled kernels' narrowed in-place gradient, determinism, cost.

The fused ops write the fp32 logits' bf16 gradient into the front half of each fp32 row (the backward kernel's
ROW_LOOP, a barrier between each column block's loads and stores). Under the Triton interpreter a program runs
whole, so only the GPU shows whether a warp ever overwrites a logit another warp has not read yet. Here, at a full
vocabulary (V = 151936, N = 2048, H = 1024, logit maxima ~30):

* ``fused_linear_logprobs`` and ``fused_linear_loss`` at fp32 against the logits path at fp32
  (``batch_major_linear`` + ``vocab_parallel_logprobs``: a gradient buffer of its own, no narrowing): log-probs
  and entropy to 2e-5, the hidden and weight gradients to bf16 rounding of the largest entry — a race would leave
  garbage in whole blocks;
* twice on the same inputs: bitwise the same outputs and gradients (no race, no atomics: deterministic). (The
  kernels' batch invariance holds for given logits at any dtype, ``tests/gpu/test_logprob_batch_invariance.py``;
  the fused ops' logits come from cuBLAS, whose kernel choice may depend on the rows, in either setting.)

    python -m pytest tests/gpu/test_fp32_logits_gpu.py -v
"""

from __future__ import annotations

import pytest
import torch

from mp_grpo import LogitDtype, fused_linear_logprobs, fused_linear_loss, vocab_parallel_logprobs
from mp_grpo.ops.batch_major_linear import batch_major_linear
from tests.tolerances import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

N, H, V = 2048, 1024, 151936
FP32 = LogitDtype.FP32


def _inputs(seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(N, H, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=gen) * (30.0 / (4.7 * H**0.5))).bfloat16()
    target = torch.randint(0, V, (N,), device="cuda", generator=gen)
    g_lp = torch.randn(N, device="cuda", generator=gen)
    g_ent = torch.randn(N, device="cuda", generator=gen)
    return hidden, weight, target, g_lp, g_ent


def _grads(fn, hidden, weight, target, g_lp, g_ent):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = fn(h, w, target)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    torch.cuda.synchronize()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _logits_path(h, w, t):
    return vocab_parallel_logprobs(batch_major_linear(h.unsqueeze(1), w, logit_dtype=FP32)[:, 0], t, with_entropy=True)


def _fused(h, w, t):
    return fused_linear_logprobs(h, w, t, with_entropy=True, logit_dtype=FP32)


def _fused_loss(g_lp, g_ent):
    def fn(h, w, t):
        def loss_fn(lp, ent):
            return (lp * g_lp).sum() + (ent * g_ent).sum(), (lp.detach().clone(), ent.detach().clone())

        loss, (lp, ent) = fused_linear_loss(h, w, t, loss_fn, with_entropy=True, logit_dtype=FP32)
        loss.backward()
        return lp.requires_grad_(), ent.requires_grad_()  # leaves: the test's own backward adds nothing
    return fn


def _compare(got, want, what: str) -> None:
    assert_close(got[0], want[0], torch.float32, f"{what}: log-probs")
    assert_close(got[1], want[1], torch.float32, f"{what}: entropy")
    for name, g, r in (("hidden", got[2], want[2]), ("weight", got[3], want[3])):
        scale = float(r.abs().max())
        assert bool(torch.isfinite(g).all()), f"{what}: non-finite d/d{name}"
        assert_close(g.double() / scale, r.double() / scale, torch.bfloat16, f"{what}: d/d{name}")


def test_fused_ops_at_fp32_equal_the_logits_path_and_are_deterministic() -> None:
    hidden, weight, target, g_lp, g_ent = _inputs()
    want = _grads(_logits_path, hidden, weight, target, g_lp, g_ent)
    for name, fn in (("fused_linear_logprobs", _fused), ("fused_linear_loss", _fused_loss(g_lp, g_ent))):
        first = _grads(fn, hidden, weight, target, g_lp, g_ent)
        _compare(first, want, name)
        second = _grads(fn, hidden, weight, target, g_lp, g_ent)
        for a, b, what in zip(first, second, ("log-probs", "entropy", "d/dhidden", "d/dweight")):
            assert a is not None and torch.equal(a, b), f"{name}: {what} differ between two runs on the same inputs"
