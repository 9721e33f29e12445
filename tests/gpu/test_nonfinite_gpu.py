"""Non-finite inputs on a GPU: deferred to ``check_errors()`` (no host read at the call), counted in a CUDA-graph
replay too, the gradient finite.

    python -m pytest tests/gpu/test_nonfinite_gpu.py -v

``GRPOLoss.on_logits`` (DAPO) with a NaN logit in one trained row and a NaN old log-prob at another trained
position: no error at the call, the loss and the logits' gradient finite (0 in the NaN row), and
``check_errors()`` raises; captured into a CUDA graph, every replay adds its counts. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

import mp_grpo
from mp_grpo import GlobalBatch, GRPOLoss, LossBackend
from mp_grpo.config.loss import LossConfig, PolicyConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

B, T, V = 4, 100, 18992


def test_nonfinite_logits_and_old_logprobs_on_a_gpu_eager_and_in_a_replay() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    mask = torch.ones(B, T, dtype=torch.bool, device="cuda")
    old = -torch.rand(B, T, generator=gen, device="cuda") * 3
    adv = torch.randn(B, generator=gen, device="cuda")
    batch = GlobalBatch.from_masks([mask])
    loss_fn = GRPOLoss(LossConfig(policy=PolicyConfig(eps_high=0.28)), backend=LossBackend.TRITON)
    logits = (torch.randn(B, T, V, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    target = torch.randint(0, V, (B, T), generator=gen, device="cuda")
    logits[1, 7, 5] = float("nan")
    old[2, 3] = float("nan")
    mp_grpo.check_errors()

    def step(x):
        loss, metrics = loss_fn.on_logits(x, target, old, adv, mask, batch=batch)
        (grad,) = torch.autograd.grad(loss, x)
        return loss.detach(), grad, metrics["nonfinite_inputs"]

    x = logits.detach().requires_grad_()
    loss, grad, count = step(x)  # no host read: nothing raised here
    torch.cuda.synchronize()
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and (grad[1, 7] == 0).all()
    assert count[0].item() == 2
    with pytest.raises(ValueError, match=r"(logits|logprobs|old_logprobs)"):
        mp_grpo.check_errors()
    mp_grpo.check_errors()

    static = logits.detach().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(static)
    torch.cuda.current_stream().wait_stream(side)
    with pytest.raises(ValueError):  # the warm-up's counts
        mp_grpo.check_errors()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(static)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], loss) and torch.equal(out[1], grad)
    with pytest.raises(ValueError, match=r"2 (row|trained)"):  # one bad row / position per kind, twice
        mp_grpo.check_errors()
