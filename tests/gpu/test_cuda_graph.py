"""CUDA-graph capture with the DEFAULT arguments (input checks on: ``CheckInputs.DEFERRED``), on one GPU.

    python -m pytest tests/gpu/test_cuda_graph.py -v

For the log-prob op (with entropy), the fused output-layer op and ``GRPOLoss(vocab_parallel_logprobs(logits))``
(DAPO token-mean, the fused Triton loss): forward + backward captured into one ``torch.cuda.CUDAGraph`` after
the usual warm-up on a side stream, replayed on fresh inputs copied into the static ones, and compared
BITWISE with the same computation run eagerly. Then a bad token id: eagerly (no error at the call on a GPU,
the log-prob NaN) and in a replay (the graph keeps adding into the device's error counter), the error naming
``target`` is raised by ``mp_grpo.check_errors()``. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

import mp_grpo
from mp_grpo import GlobalBatch, GRPOLoss, LossBackend, fused_linear_logprobs, vocab_parallel_logprobs
from mp_grpo.config.loss import LossConfig, PolicyConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

N, V, H = 1000, 3000, 256  # rows not a multiple of any block; V spans several BLOCK_V


def _graphed(step, static_inputs: list[torch.Tensor]):
    """Warm ``step`` up on a side stream, capture it, return (graph, its static outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(*static_inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step(*static_inputs)
    return graph, outputs


def _replay_equals_eager(step, make_inputs) -> None:
    static = make_inputs(0)
    graph, static_out = _graphed(step, static)
    for seed in (1, 2):
        fresh = make_inputs(seed)
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
        eager = step(*fresh)
        torch.cuda.synchronize()
        for name, (g, e) in enumerate(zip(static_out, eager)):
            assert torch.equal(g, e), f"output {name}: graph replay differs from eager (seed {seed})"
    mp_grpo.check_errors()  # good inputs: nothing recorded


def _logits_inputs(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(N, V, generator=gen, device="cuda").to(torch.bfloat16) * 3
    target = torch.randint(0, V, (N,), generator=gen, device="cuda")
    target[::7] = -100
    g_lp = torch.randn(N, generator=gen, device="cuda")
    g_ent = torch.randn(N, generator=gen, device="cuda")
    return [logits, target, g_lp, g_ent]


def test_logprob_op_with_entropy_is_capturable_with_default_checks() -> None:
    def step(logits, target, g_lp, g_ent):
        x = logits.detach().requires_grad_()
        lp, ent = vocab_parallel_logprobs(x, target, with_entropy=True)  # default check_inputs
        (grad,) = torch.autograd.grad([lp, ent], [x], [g_lp, g_ent])
        return lp, ent, grad

    _replay_equals_eager(step, _logits_inputs)


def test_fused_output_op_is_capturable_with_default_checks() -> None:
    def make(seed: int) -> list[torch.Tensor]:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        hidden = torch.randn(N, H, generator=gen, device="cuda").to(torch.bfloat16)
        weight = (torch.randn(V, H, generator=gen, device="cuda") * H**-0.5).to(torch.bfloat16)
        target = torch.randint(0, V, (N,), generator=gen, device="cuda")
        return [hidden, weight, target, torch.randn(N, generator=gen, device="cuda"),
                torch.randn(N, generator=gen, device="cuda")]

    def step(hidden, weight, target, g_lp, g_ent):
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        lp, ent = fused_linear_logprobs(h, w, target, with_entropy=True, chunk_tokens=384)
        grad_h, grad_w = torch.autograd.grad([lp, ent], [h, w], [g_lp, g_ent])
        return lp, ent, grad_h, grad_w

    _replay_equals_eager(step, make)


def _loss_inputs(B: int, T: int, seed: int):
    """(loss mask, old log-probs, per-sequence advantages, GlobalBatch) of a padded [B, T] micro-batch."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mask = torch.arange(T, device="cuda") < torch.randint(T // 4, T + 1, (B, 1), generator=gen, device="cuda")
    old = -torch.rand(B, T, generator=gen, device="cuda") * 3
    adv = torch.randn(B, generator=gen, device="cuda")
    return mask, old, adv, GlobalBatch.from_masks([mask])


def test_logits_to_grpo_loss_is_capturable_with_default_checks() -> None:
    cfg = LossConfig(policy=PolicyConfig(eps_high=0.28))  # DAPO clip, token-mean
    B, T = 8, N // 8
    mask, old, adv, batch = _loss_inputs(B, T, seed=5)
    loss_fn = GRPOLoss(cfg, backend=LossBackend.TRITON)

    def make(seed: int) -> list[torch.Tensor]:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        logits = torch.randn(B * T, V, generator=gen, device="cuda").to(torch.bfloat16) * 3
        return [logits, torch.randint(0, V, (B * T,), generator=gen, device="cuda")]

    def step(logits, target):
        x = logits.detach().requires_grad_()
        lp = vocab_parallel_logprobs(x, target).view(B, T)
        loss, metrics = loss_fn(lp, old, adv, mask, batch=batch)
        (grad,) = torch.autograd.grad(loss, [x])
        return loss.detach(), grad, metrics["ratio/mean"], metrics["clip_frac/high"]

    _replay_equals_eager(step, make)


@pytest.mark.parametrize("objective", ["ppo_clip", "gspo"])
def test_loss_on_logits_is_capturable_and_equals_the_two_ops(objective: str) -> None:
    """``GRPOLoss.on_logits`` (one autograd Function, the loss's backward inside the log-prob backward kernel):
    captured and replayed bitwise equal to eager, and eager equal to the two ops in turn — bitwise for ppo_clip;
    gspo's per-sequence sums of log-ratios meet through float64 atomics (order-dependent last float64 bits), so
    there to float32 rounding."""
    from mp_grpo.config.loss import Aggregation, AggregationConfig, Objective

    cfg = LossConfig(policy=PolicyConfig(objective=Objective(objective), eps_high=0.28),
                     aggregation=AggregationConfig(mode=Aggregation.SEQ_MEAN_TOKEN_MEAN))
    B, T = 8, N // 8
    mask, old, adv, batch = _loss_inputs(B, T, seed=6)
    loss_fn = GRPOLoss(cfg, backend=LossBackend.TRITON)

    def make(seed: int) -> list[torch.Tensor]:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        logits = torch.randn(B, T, V, generator=gen, device="cuda").to(torch.bfloat16) * 3
        return [logits, torch.randint(0, V, (B, T), generator=gen, device="cuda")]

    def step(logits, target):
        x = logits.detach().requires_grad_()
        loss, metrics = loss_fn.on_logits(x, target, old, adv, mask, batch=batch)
        (grad,) = torch.autograd.grad(loss * 0.5, [x])
        return loss.detach(), grad, metrics["ratio/mean"], metrics["clip_frac/high"]

    if objective == "ppo_clip":
        _replay_equals_eager(step, make)
    logits, target = make(3)
    ours = step(logits, target)
    x = logits.detach().requires_grad_()
    loss, metrics = loss_fn(vocab_parallel_logprobs(x, target), old, adv, mask, batch=batch)
    (grad,) = torch.autograd.grad(loss * 0.5, [x])
    for name, a, b in zip(("loss", "grad", "ratio", "clip"), ours,
                          (loss.detach(), grad, metrics["ratio/mean"], metrics["clip_frac/high"])):
        if objective == "ppo_clip":
            assert torch.equal(a, b), f"{name}: on_logits differs from the two ops"
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=name)


def test_loss_on_logits_with_a_sampling_filter_is_capturable_and_equals_the_two_ops() -> None:
    """``GRPOLoss.on_logits`` with a ``sampling_filter`` (the fused path; per-row top-k / top-p, peaky rows that the
    candidates finish and flat rows that take the radix fallback): captured and replayed bitwise equal to eager,
    and eager bitwise equal to ``vocab_parallel_logprobs(sampling_filter=...)`` then the loss."""
    from mp_grpo.ops import SamplingFilter

    cfg = LossConfig(policy=PolicyConfig(eps_high=0.28))
    B, T = 8, N // 8
    mask, old, adv, batch = _loss_inputs(B, T, seed=7)
    loss_fn = GRPOLoss(cfg, backend=LossBackend.TRITON)
    gen = torch.Generator(device="cuda").manual_seed(70)
    filt = SamplingFilter(top_k=torch.randint(0, 80, (B, T), generator=gen, device="cuda"),
                          top_p=torch.rand(B, T, generator=gen, device="cuda") * 0.2 + 0.8)

    def make(seed: int) -> list[torch.Tensor]:
        g = torch.Generator(device="cuda").manual_seed(seed)
        logits = torch.randn(B, T, V, generator=g, device="cuda") * 2
        logits[::2] += torch.zeros(V, device="cuda").index_fill_(0, torch.arange(3, device="cuda") * 997, 14.0)
        logits = logits.to(torch.bfloat16)
        return [logits, logits.float().argmax(-1)]  # the argmax: inside every filter's kept set

    def step(logits, target):
        x = logits.detach().requires_grad_()
        loss, metrics = loss_fn.on_logits(x, target, old, adv, mask, batch=batch, sampling_filter=filt)
        (grad,) = torch.autograd.grad(loss * 0.5, [x])
        return loss.detach(), grad, metrics["ratio/mean"], metrics["clip_frac/high"]

    _replay_equals_eager(step, make)
    logits, target = make(3)
    ours = step(logits, target)
    x = logits.detach().requires_grad_()
    loss, metrics = loss_fn(vocab_parallel_logprobs(x, target, sampling_filter=filt), old, adv, mask, batch=batch)
    (grad,) = torch.autograd.grad(loss * 0.5, [x])
    for name, a, b in zip(("loss", "grad", "ratio", "clip"), ours,
                          (loss.detach(), grad, metrics["ratio/mean"], metrics["clip_frac/high"])):
        assert torch.equal(a, b), f"{name}: on_logits with a filter differs from the two ops"
    mp_grpo.check_errors()


def test_bad_target_is_raised_at_check_errors_eager_and_in_a_replay() -> None:
    logits, target, g_lp, g_ent = _logits_inputs(3)
    mp_grpo.check_errors()
    bad = target.clone()
    bad[5] = V + 11
    lp = vocab_parallel_logprobs(logits, bad)  # default: no host read, no error at the call on a GPU
    assert torch.isnan(lp[5]) and torch.isfinite(lp[6])
    with pytest.raises(ValueError, match=r"target has 1 token id\(s\) outside \[0, 3000\)"):
        mp_grpo.check_errors()
    mp_grpo.check_errors()  # cleared

    static_target = target.clone()
    graph, (static_lp,) = _graphed(lambda t: (vocab_parallel_logprobs(logits, t),), [static_target])
    graph.replay()
    mp_grpo.check_errors()  # good targets
    static_target.copy_(bad)
    graph.replay()
    graph.replay()
    assert torch.isnan(static_lp[5])
    with pytest.raises(ValueError, match=r"target has 2 token id\(s\)"):  # both replays counted
        mp_grpo.check_errors()
    static_target.copy_(target)
    graph.replay()
    mp_grpo.check_errors()
    with pytest.raises(ValueError, match="target has 1"):
        vocab_parallel_logprobs(logits, bad, check_inputs=mp_grpo.CheckInputs.SYNC)  # the eager raise on a GPU
