"""mp_grpo keeps no autograd graph alive once the caller drops a call's outputs (CPU, Triton interpreter).

Why it matters (``tests/gpu/test_cuda_graph_after_eager.py``): PyTorch keeps a leaf's ``AccumulateGrad`` node —
and the CUDA stream it was made on — for as long as any graph refers to it. A graph held by mp_grpo (a cache, the
error ledger, a metric tensor, the GlobalBatch) would keep the default-stream node of an eager call alive into a
later CUDA-graph capture on the same leaves, whose backward then fails (``cudaErrorStreamCaptureImplicit``) in a
way the caller cannot fix. Here every path runs (forward, ``backward`` and ``torch.autograd.grad``) while the
caller keeps what a training loop keeps — the metric dicts, the GlobalBatch, the GRPOLoss — and drops the
loss: the leaf's node must then be gone (a tag set on it does not survive).
"""

from __future__ import annotations

import gc

import pytest
import torch

from mp_grpo import GlobalBatch, GRPOLoss, LossBackend, fused_linear_logprobs, vocab_parallel_logprobs
from mp_grpo.config import load_config
from mp_grpo.ops.fused_linear_loss import fused_linear_loss

B, T, V, H = 2, 5, 24, 8


def _accumulator(leaf: torch.Tensor):
    return leaf.view_as(leaf).grad_fn.next_functions[0][0]


def _node_survives(leaves: list[torch.Tensor], run) -> bool:
    """Run ``run()`` (returning (loss, kept)), tag each leaf's AccumulateGrad while the loss lives, drop the loss and
    keep ``kept``: whether any tag survived."""
    loss, kept = run()
    for leaf in leaves:
        _accumulator(leaf).metadata["tag"] = True
    torch.autograd.grad(loss, leaves, retain_graph=True)
    loss.backward()
    del loss
    gc.collect()
    survived = any("tag" in _accumulator(leaf).metadata for leaf in leaves)
    del kept
    return survived


@pytest.mark.parametrize("path", ["logprobs", "torch loss", "triton loss", "on_logits", "fused logprobs",
                                  "fused loss"])
def test_no_graph_outlives_the_callers_outputs(path: str) -> None:
    gen = torch.Generator().manual_seed(0)
    mask = torch.arange(T) < torch.tensor([[4], [2]])
    old = -torch.rand(B, T, generator=gen) * 3
    adv = torch.randn(B, generator=gen)
    target = torch.randint(0, V, (B, T), generator=gen)
    cfg = load_config("trl_dapo", ["rollout_correction.weight_level=null", "rollout_correction.reject_level=null",
                                   "rollout_correction.reject_max=null", "entropy.bonus_coef=0.01"])
    batch = GlobalBatch.from_masks([mask])
    backend = LossBackend.TORCH if path == "torch loss" else LossBackend.TRITON
    loss_fn = GRPOLoss(cfg, backend=backend)
    x = (torch.randn(B, T, V, generator=gen) * 2).requires_grad_()
    lp_leaf = (-torch.rand(B, T, generator=gen) * 3).requires_grad_()
    ent_leaf = (torch.rand(B, T, generator=gen) * 2).requires_grad_()
    h = torch.randn(B * T, H, generator=gen).requires_grad_()
    w = (torch.randn(V, H, generator=gen) * 0.3).requires_grad_()

    def run():
        if path == "logprobs":
            lp, ent = vocab_parallel_logprobs(x, target, with_entropy=True)
            return (lp * 1.3 + ent).sum(), None
        if path in ("torch loss", "triton loss"):
            loss, metrics = loss_fn(lp_leaf, old, adv, mask, entropy=ent_leaf, batch=batch)
            return loss, metrics
        if path == "on_logits":
            return loss_fn.on_logits(x, target, old, adv, mask, batch=batch)
        if path == "fused logprobs":
            lp, ent = fused_linear_logprobs(h, w, target.view(-1), with_entropy=True, chunk_tokens=4)
            return (lp * 1.3 + ent).sum(), None
        return fused_linear_loss(h, w, target.view(-1),
                                 lambda lp, ent: loss_fn(lp.view(B, T), old, adv, mask, entropy=ent.view(B, T),
                                                         batch=batch),
                                 with_entropy=True, chunk_tokens=4)

    leaves = {"logprobs": [x], "torch loss": [lp_leaf, ent_leaf], "triton loss": [lp_leaf, ent_leaf],
              "on_logits": [x]}.get(path, [h, w])
    assert not _node_survives(leaves, run), f"{path}: mp_grpo kept the autograd graph of a call alive"


def test_the_check_catches_a_kept_graph() -> None:
    """The test above can fail: a caller that keeps the loss keeps the node."""
    x = torch.randn(3, requires_grad=True)
    kept = []

    def run():
        loss = x.exp().sum()
        kept.append(loss)
        return loss, None

    assert _node_survives([x], run)
