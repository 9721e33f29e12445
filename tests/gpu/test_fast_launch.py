"""mp_grpo.ops.launcher's fast path vs Triton's own launch path, on one GPU: bitwise equal outputs.

    python -m pytest tests/gpu/test_fast_launch.py -v

Each case runs with the fast launch off (Triton's ``kernel[grid]``), then on three times (the first call of a
specialization goes through ``kernel[grid]`` and keeps its CompiledKernel, the next ones launch it directly),
over inputs that change what Triton specializes on: N (== 1, a multiple of 16 or not), misaligned views,
dtypes. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from mp_grpo import GlobalBatch, GRPOLoss, LossBackend, vocab_parallel_logprobs
from mp_grpo.config.loss import (
    Aggregation,
    AggregationConfig,
    LossConfig,
    Objective,
    PolicyConfig,
    RatioLevel,
    RolloutCorrectionConfig,
)
from mp_grpo.ops import launcher
from mp_grpo.ops.scale import scale_into

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

V = 3000


@pytest.fixture(autouse=True)
def _restore_fast_launch():
    yield
    launcher.set_fast_launch(True)


def test_fast_launch_is_available_on_cuda() -> None:
    assert launcher.FAST_LAUNCH_AVAILABLE, launcher.FAST_LAUNCH_REASON
    assert launcher.fast_launch_enabled()


def _normal_then_fast(step):
    """(outputs with the fast launch off, [outputs of three calls with it on]); the cache starts empty."""
    launcher.clear_launch_cache()
    launcher.set_fast_launch(False)
    normal = step()
    launcher.set_fast_launch(True)
    fast = [step() for _ in range(3)]
    assert launcher._compiled, "the fast path kept no CompiledKernel"
    return normal, fast


def _assert_bitwise(normal, fast, what: str) -> None:
    for call, outs in enumerate(fast):
        for i, (a, b) in enumerate(zip(normal, outs)):
            assert a.dtype == b.dtype and a.shape == b.shape
            same = torch.equal(a, b) or (
                torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))
            assert same, f"{what}: output {i} of fast call {call} differs from the normal launch"


def _logits(n: int, dtype: torch.dtype, offset: int, seed: int) -> torch.Tensor:
    """[n, V] logits; with ``offset`` a view starting ``offset`` elements into a wider buffer (misaligned)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    wide = (torch.randn(n, V + offset, generator=gen, device="cuda") * 3).to(dtype)
    return wide[:, offset:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logprob_op_with_entropy_fwd_bwd(dtype: torch.dtype) -> None:
    for n, offset in ((1000, 0), (1, 0), (1024, 1), (1007, 3), (1024, 0)):
        logits = _logits(n, dtype, offset, seed=n + offset)
        gen = torch.Generator(device="cuda").manual_seed(7)
        target = torch.randint(0, V, (n,), generator=gen, device="cuda")
        target[::5] = -100
        g_lp, g_ent = torch.randn(n, generator=gen, device="cuda"), torch.randn(n, generator=gen, device="cuda")

        def step():
            x = logits.detach().requires_grad_()
            lp, ent = vocab_parallel_logprobs(x, target, with_entropy=True, temperature=0.7)
            (grad,) = torch.autograd.grad([lp, ent], [x], [g_lp, g_ent])
            return lp, ent, grad

        normal, fast = _normal_then_fast(step)
        _assert_bitwise(normal, fast, f"log-prob op n={n} offset={offset} {dtype}")


CONFIGS = {
    "dapo": LossConfig(policy=PolicyConfig(eps_high=0.28)),
    "gspo seq tis": LossConfig(
        policy=PolicyConfig(objective=Objective.GSPO, eps_low=3e-4, eps_high=4e-4),
        aggregation=AggregationConfig(mode=Aggregation.SEQ_MEAN_TOKEN_MEAN),
        rollout_correction=RolloutCorrectionConfig(weight_level=RatioLevel.SEQUENCE, weight_max=2.0),
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_grpo_loss_fused_path(name: str) -> None:
    cfg = CONFIGS[name]
    for b, t in ((8, 125), (4, 64), (3, 37)):
        gen = torch.Generator(device="cuda").manual_seed(b * t)
        mask = torch.arange(t, device="cuda") < torch.randint(t // 4, t + 1, (b, 1), generator=gen, device="cuda")
        old = -torch.rand(b, t, generator=gen, device="cuda") * 3
        rollout = old + 0.01 * torch.randn(b, t, generator=gen, device="cuda")
        adv = torch.randn(b, generator=gen, device="cuda")
        lp0 = old + 0.05 * torch.randn(b, t, generator=gen, device="cuda")
        batch = GlobalBatch.from_rollouts(cfg, [mask], old_logprobs=[old], rollout_logprobs=[rollout])
        loss_fn = GRPOLoss(cfg, backend=LossBackend.TRITON)

        def step():
            lp = lp0.clone().requires_grad_()
            loss, metrics = loss_fn(lp, old, adv, mask, rollout_logprobs=rollout, batch=batch)
            (grad,) = torch.autograd.grad(loss, [lp])
            return loss.detach(), grad, *(m.detach() for m in metrics.values())

        normal, fast = _normal_then_fast(step)
        if name == "dapo":  # no per-sequence sums: no atomics, every bit is fixed
            _assert_bitwise(normal, fast, f"GRPOLoss {name} [{b}, {t}]")
        else:  # per-sequence sums meet through float64 atomics (order-dependent far below fp32's last bit)
            for outs in fast:
                for a, o in zip(normal, outs):
                    torch.testing.assert_close(o, a, rtol=1e-6, atol=1e-9, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scale_kernel(dtype: torch.dtype) -> None:
    scale = torch.tensor(0.37, device="cuda")
    for n, offset in ((5000, 0), (4096, 0), (1, 0), (4097, 1), (4096, 8)):
        gen = torch.Generator(device="cuda").manual_seed(n)
        wide = torch.randn(n + offset, generator=gen, device="cuda").to(dtype)
        x = wide[offset:]
        acc0 = torch.randn(n, generator=gen, device="cuda").to(dtype)

        def step():
            acc = acc0.clone()
            return scale_into(x, scale), scale_into(x, scale, acc, accumulate=True)

        normal, fast = _normal_then_fast(step)
        _assert_bitwise(normal, fast, f"scale n={n} offset={offset} {dtype}")
