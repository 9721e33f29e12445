"""CUDA-graph capture after the other paths ran eagerly ON THE SAME TENSORS, in one process, on one GPU.

    python -m pytest tests/gpu/test_cuda_graph_after_eager.py -v

PyTorch keeps one ``AccumulateGrad`` node per leaf tensor for as long as any autograd graph refers to it, and
that node remembers the stream that was current when it was made. Eager calls on the default stream make it
there; while an eager output (its graph) is alive, a captured backward that reaches the leaf makes the legacy
default stream wait on the capturing stream: ``cudaErrorStreamCaptureImplicit`` ("operation would make the
legacy stream depend on a capturing blocking stream"), for any op — plain ``torch.log_softmax`` too. So a
capture works after eager use of the same leaves once the eager outputs are dropped (or, with PyTorch's
``torch.autograd.graph.set_override_stale_capture_stream(True)``, even while they live) — provided mp_grpo
keeps no autograd graph alive itself (``tests/ops/test_no_graph_kept.py`` checks that on the CPU).

Here every path runs eagerly first on the default stream (``backward`` and ``torch.autograd.grad``, the two
ops, ``GRPOLoss.on_logits``, the fused output ops), the eager outputs are dropped, and then each path is
captured on the same leaf tensors, replayed, and compared BITWISE with its eager result; then new values are
copied into the leaves and a replay is compared bitwise with eager on them. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

import mp_grpo
from mp_grpo import GlobalBatch, GRPOLoss, LossBackend, fused_linear_logprobs, vocab_parallel_logprobs
from mp_grpo.config.loss import LossConfig, PolicyConfig
from mp_grpo.ops.fused_linear_loss import fused_linear_loss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

B, T, V, H = 8, 125, 18992, 256  # V of the reported failure; rows not a multiple of any block


def _loss_setup():
    gen = torch.Generator(device="cuda").manual_seed(5)
    mask = torch.arange(T, device="cuda") < torch.randint(T // 4, T + 1, (B, 1), generator=gen, device="cuda")
    old = -torch.rand(B, T, generator=gen, device="cuda") * 3
    adv = torch.randn(B, generator=gen, device="cuda")
    cfg = LossConfig(policy=PolicyConfig(eps_high=0.28))  # DAPO clip, token-mean
    return GRPOLoss(cfg, backend=LossBackend.TRITON), mask, old, adv, GlobalBatch.from_masks([mask])


def _eager(step):
    """``step()``'s outputs, cloned (the eager graph dropped with the step's locals)."""
    return tuple(t.detach().clone() for t in step())


def _capture(step):
    """Warm ``step`` up on a side stream, capture it; (graph, static outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def _check_replays(name, step, leaves, fresh_values):
    """Capture ``step`` on ``leaves``; its replay equals eager bitwise, on the current values and on new ones."""
    expected = _eager(step)
    graph, static = _capture(step)
    for values in (None, fresh_values):
        if values is not None:
            with torch.no_grad():
                for leaf, value in zip(leaves, values):
                    leaf.copy_(value)
            expected = _eager(step)
        graph.replay()
        torch.cuda.synchronize()
        for i, (g, e) in enumerate(zip(static, expected)):
            assert torch.equal(g, e), f"{name}: output {i} of the replay differs from eager"
    mp_grpo.check_errors()


def _leaf_grad_step(leaves, forward):
    """A step that zeroes the leaves' .grad, runs ``forward()`` (a 0-dim loss) and its backward into them."""
    def step():
        for leaf in leaves:
            leaf.grad = None
        loss = forward()
        loss.backward()
        return (loss.detach(), *[leaf.grad for leaf in leaves])
    return step


def test_capture_after_every_path_ran_eagerly_on_the_same_tensors() -> None:
    loss_fn, mask, old, adv, batch = _loss_setup()
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(B, T, V, generator=gen, device="cuda") * 3).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=gen, device="cuda")
    h = (torch.randn(B * T, H, generator=gen, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, generator=gen, device="cuda") * H**-0.5).to(torch.bfloat16).requires_grad_()
    g_lp, g_ent = torch.randn(B * T, generator=gen, device="cuda"), torch.randn(B * T, generator=gen, device="cuda")
    fresh_x = (torch.randn(B, T, V, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    fresh_h = (torch.randn(B * T, H, generator=gen, device="cuda") * 0.5).to(torch.bfloat16)
    fresh_w = (torch.randn(V, H, generator=gen, device="cuda") * H**-0.5).to(torch.bfloat16)

    def two_ops():
        return loss_fn(vocab_parallel_logprobs(x, ids), old, adv, mask, batch=batch)[0]

    def on_logits():
        return loss_fn.on_logits(x, ids, old, adv, mask, batch=batch)[0]

    def fused_logprobs():
        lp, ent = fused_linear_logprobs(h, w, ids.view(-1), with_entropy=True, chunk_tokens=384)
        return (lp * g_lp).sum() + (ent * g_ent).sum()

    def fused_loss():
        return fused_linear_loss(h, w, ids.view(-1),
                                 lambda lp, ent: loss_fn(lp.view(B, T), old, adv, mask, batch=batch))[0]

    # --- every path eagerly on the default stream, on the same leaves: backward and autograd.grad ---
    for forward, leaves in ((two_ops, [x]), (on_logits, [x]), (fused_logprobs, [h, w]), (fused_loss, [h, w])):
        for leaf in leaves:
            leaf.grad = None
        forward().backward()
        torch.autograd.grad(forward(), leaves)
    a, b = on_logits(), two_ops()  # as a benchmark's agreement check does
    torch.autograd.grad(a, x), torch.autograd.grad(b, x)
    del a, b  # the eager graphs go: x's AccumulateGrad node (made on the default stream) with them
    torch.cuda.synchronize()

    # --- then each path captured on those leaves, replayed bitwise equal to eager ---
    _check_replays("on_logits", _leaf_grad_step([x], on_logits), [x], [fresh_x])
    _check_replays("two ops", _leaf_grad_step([x], two_ops), [x], [fresh_x])
    _check_replays("fused_linear_logprobs", _leaf_grad_step([h, w], fused_logprobs), [h, w], [fresh_h, fresh_w])
    _check_replays("fused_linear_loss", _leaf_grad_step([h, w], fused_loss), [h, w], [fresh_h, fresh_w])


@pytest.mark.skipif(not hasattr(torch.autograd.graph, "set_override_stale_capture_stream"),
                    reason="this PyTorch has no torch.autograd.graph.set_override_stale_capture_stream")
def test_capture_while_eager_outputs_live_with_pytorchs_stale_stream_override() -> None:
    """With the eager outputs still alive the leaf's AccumulateGrad keeps the default stream; PyTorch's override
    (what Megatron's full-iteration capture turns on) moves it to the capturing stream."""
    loss_fn, mask, old, adv, batch = _loss_setup()
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = (torch.randn(B, T, V, generator=gen, device="cuda") * 3).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=gen, device="cuda")
    fresh_x = (torch.randn(B, T, V, generator=gen, device="cuda") * 3).to(torch.bfloat16)

    def on_logits():
        return loss_fn.on_logits(x, ids, old, adv, mask, batch=batch)[0]

    alive = on_logits()
    torch.autograd.grad(alive, x, retain_graph=True)
    torch.autograd.graph.set_override_stale_capture_stream(True)
    try:
        _check_replays("on_logits (eager output alive)", _leaf_grad_step([x], on_logits), [x], [fresh_x])
    finally:
        torch.autograd.graph.set_override_stale_capture_stream(False)
    del alive
