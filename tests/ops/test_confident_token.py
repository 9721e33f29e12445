"""The sampled token's own logit gradient, exact for confident tokens, on every path that makes a logit gradient.

The gradient of a token's own logit is ``((p_t - 1)·g_lp - p_t (log p_t + H)·g_H) / T``. Formed from an fp32 p_t, the
factor 1 - p_t keeps fp32's absolute spacing near 1 (6e-8): a relative error of 6e-8 / (1 - p_t) — 2e-3 at
p_t = 1 - 1e-4, 20 % at 1 - 1e-6, the whole gradient (0) at 1 - 1e-7. An RL policy samples such tokens all the time
(most tokens of a trained model's rollouts are low-entropy). The kernels sum the other tokens' mass apart
(``kernels/logprob_merge.py``): 1 - p_t and log p_t + H keep fp32's relative rounding for p_t up to 1 - 1e-7.

Against float64 of the same logits (fp32 or bf16, temperature 0.7, logits around ±30 so that a difference of logits
scaled before it is formed would show too), rows from p_t = 0.3 to 1 - 1e-7, an entropy gradient beside the
log-prob's: the logits path (``vocab_parallel_logprobs``), ``GRPOLoss.on_logits`` on both loss backends, and the
fused output layer (``fused_linear_logprobs``, ``fused_linear_loss``; an identity output weight makes the hidden
state's gradient the logits' gradient), TP = 1 and TP = 2 under torchrun. The target's gradient is within
``TARGET_RTOL`` of float64 in fp32 and within one bf16 spacing in bf16; a mutant whose backward forms 1 - p_t and
log p_t + H from the recomputed p_t (what the kernels did) fails at p_t >= 1 - 1e-5.

The same over a captured support (``captured_support=``): rows whose 1 - p_t *over the support* runs from 0.7 down to
1e-7, with the logits outside the support above the target's (so that over the whole vocabulary it would not be
confident at all): every path, both checks, the mutant (the support's backward given the naive 1 - p_t) failing.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from mp_grpo import CapturedSupport, LogitDtype, fused_linear_logprobs, fused_linear_loss, vocab_parallel_logprobs
from mp_grpo.config import load_config
from mp_grpo.loss import GlobalBatch, GRPOLoss, LossBackend
from tests.distributed import torchrun, worker_main
from tests.reference import support_keep_reference
from tests.tolerances import assert_close

TARGET_RTOL = 1e-5
"""fp32 gradients: largest relative error of a target's own logit gradient against float64 of the same logits."""
BF16_RTOL = 2.0**-7
"""bf16 gradients: one bf16 spacing, relative (the gradient is formed in fp32 and rounded once; the interpreter
rounds toward zero, a GPU to nearest)."""
COMPLEMENTS = [0.7, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7]
"""1 - p_t of the rows (0.7: a target below the row's maximum; the others the row's confident maximum)."""
MUTANT_FAILS_FROM = 1e-5
"""The naive mutant's relative error exceeds both bounds from this 1 - p_t down (6e-8 / 1e-5 = 6e-3 > 2**-7)."""
V, TEMPERATURE, OFFSET = 48, 0.7, -30.0
SUPPORT = 12
"""Ids of each row's captured support (the target among them; every fourth id, so both TP = 2 shards hold some)."""
ENTROPY_COEF = 0.05
OP_MODULES = [importlib.import_module(f"mp_grpo.ops.{name}") for name in
              ("vocab_parallel_logprobs", "fused_linear_logprobs", "fused_linear_loss", "logits_grpo_loss")]


def confident_logits(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[len(COMPLEMENTS), V]`` logits of ``dtype`` near OFFSET whose rows have 1 - p_t ≈ COMPLEMENTS at
    TEMPERATURE (the other logits spread a little so that no two rows are alike), and their targets."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    target = torch.randint(0, V, (len(COMPLEMENTS),), generator=gen)
    for i, q in enumerate(COMPLEMENTS):
        gap = TEMPERATURE * math.log((V - 1) * (1 - q) / q)  # (V - 1) e^(-gap / T) = q / (1 - q)
        row = OFFSET - gap + 0.01 * torch.randn(V, generator=gen, dtype=torch.float64)
        row[target[i]] = OFFSET
        rows.append(row)
    return torch.stack(rows).to(dtype), target


def confident_support_logits(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, CapturedSupport]:
    """``[len(COMPLEMENTS), V]`` logits, targets and a captured support of SUPPORT ids a row, whose rows have
    1 - p_t ≈ COMPLEMENTS over the support at TEMPERATURE; the logits outside the support lie 3 above the target's."""
    gen = torch.Generator().manual_seed(seed)
    rows, supports = [], []
    target = torch.randint(0, V, (len(COMPLEMENTS),), generator=gen)
    for i, q in enumerate(COMPLEMENTS):
        ids = sorted({int(target[i])} | set(((int(target[i]) + 4 * torch.arange(1, SUPPORT)) % V).tolist()))
        gap = TEMPERATURE * math.log((SUPPORT - 1) * (1 - q) / q)
        row = OFFSET + 3.0 + 0.01 * torch.randn(V, generator=gen, dtype=torch.float64)
        row[ids] = OFFSET - gap + 0.01 * torch.randn(len(ids), generator=gen, dtype=torch.float64)
        row[target[i]] = OFFSET
        rows.append(row)
        supports.append(ids)
    return torch.stack(rows).to(dtype), target, CapturedSupport.from_lists(supports)


def support_mask(support: CapturedSupport) -> torch.Tensor:
    return support_keep_reference(support.indptr, support.ids, torch.Size([support.num_tokens, V]))


def reference_gradient(logits: torch.Tensor, target: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor,
                       keep: torch.Tensor | None = None):
    """d/dlogits of Σ g_lp · log p_t + g_ent · H in float64 of the same logits (renormalized over ``keep``); p_t."""
    x = logits.detach().double().requires_grad_()
    z = x / TEMPERATURE if keep is None else torch.where(keep, x / TEMPERATURE, float("-inf"))
    logp = torch.log_softmax(z, -1)
    lp = logp.gather(-1, target[:, None])[:, 0]
    p = logp.exp()
    entropy = -(p * torch.where(p > 0, logp, 0.0)).sum(-1)  # 0 · (-inf) selected away, in value and gradient
    (lp * g_lp.double() + entropy * g_ent.double()).sum().backward()
    return x.grad, lp.detach().exp()


def assert_target_gradient(grad: torch.Tensor, ref: torch.Tensor, target: torch.Tensor, what: str) -> None:
    """Each row's target entry within TARGET_RTOL (fp32) or BF16_RTOL (bf16) of float64; every entry to the dtype's
    tolerance."""
    rtol = BF16_RTOL if grad.dtype == torch.bfloat16 else TARGET_RTOL
    rows = torch.arange(target.shape[0])
    got, want = grad.double()[rows, target], ref[rows, target]
    assert (want != 0).all(), "the reference target gradients must not vanish"
    rel = ((got - want).abs() / want.abs())
    bad = rel > rtol
    assert not bad.any(), (f"{what}: the target's logit gradient is off by {rel.max():.3g} relative (bound {rtol:g}) "
                           f"at 1 - p_t = {[COMPLEMENTS[i] for i in bad.nonzero()[:, 0].tolist()]}: "
                           f"{got[bad].tolist()} vs {want[bad].tolist()}")
    scale = float(ref.abs().max())
    assert_close(grad.double() / scale, ref / scale, grad.dtype, what)


def upstream(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(len(COMPLEMENTS), generator=gen), 0.3 * torch.randn(len(COMPLEMENTS), generator=gen)


# ------------------------------------------------------------------------------------------------- the paths
def _logits_path(logits, target, g_lp, g_ent, **tp):
    x = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(x, target, temperature=TEMPERATURE, with_entropy=True, **tp)
    (lp * g_lp + ent * g_ent).sum().backward()
    return x.grad


def _identity_weight(logits: torch.Tensor, rank: int = 0, size: int = 1) -> torch.Tensor:
    """This rank's shard of the identity ``[V, V]``: hidden · W^T is the logits' shard, and the hidden state's
    gradient is the logits' gradient (summed over the ranks' shards)."""
    v_local = V // size
    return torch.eye(V, dtype=logits.dtype)[rank * v_local:(rank + 1) * v_local].contiguous()


def _fused_logprobs(logits, target, g_lp, g_ent, logit_dtype=LogitDtype.BF16, rank=0, size=1, **tp):
    h = logits.clone().requires_grad_()
    lp, ent = fused_linear_logprobs(h, _identity_weight(logits, rank, size), target, temperature=TEMPERATURE,
                                    with_entropy=True, chunk_tokens=4, chunk_vocab=16, logit_dtype=logit_dtype, **tp)
    (lp * g_lp + ent * g_ent).sum().backward()
    return h.grad


def _fused_loss(logits, target, g_lp, g_ent, logit_dtype=LogitDtype.BF16, rank=0, size=1, **tp):
    h = logits.clone().requires_grad_()

    def loss_fn(lp, ent):
        return (lp * g_lp).sum() + (ent * g_ent).sum(), None

    loss, _ = fused_linear_loss(h, _identity_weight(logits, rank, size), target, loss_fn, temperature=TEMPERATURE,
                                with_entropy=True, chunk_tokens=4, logit_dtype=logit_dtype, **tp)
    loss.backward()
    return h.grad


def _on_logits(backend: LossBackend):
    """On-policy ppo_clip, token_mean, an entropy bonus: d J / d log p_t = -A_t / N and d J / d H_t = -c / N, so
    that the same float64 reference applies with g_lp = -A / N, g_ent = -c / N."""

    def run(logits, target, g_lp, g_ent, **kwargs):
        n = target.shape[0]
        cfg = load_config(None, [f"entropy.bonus_coef={ENTROPY_COEF}"])
        mask = torch.ones(1, n, dtype=torch.bool)
        x = logits.clone().requires_grad_()
        adv = -g_lp * n  # per-token advantages: A_t = -N g_lp
        with torch.no_grad():
            lp, ent = vocab_parallel_logprobs(logits, target, temperature=TEMPERATURE, with_entropy=True, **kwargs)
        batch = GlobalBatch.from_rollouts(cfg, [mask], old_logprobs=[lp[None]], entropies=[ent[None]])
        loss, _ = GRPOLoss(cfg, backend=backend).on_logits(
            x[None], target[None], None, adv[None], mask, temperature=TEMPERATURE, batch=batch, **kwargs)
        loss.backward()
        return x.grad

    return run


PATHS = {
    "logits path": _logits_path,
    "on_logits[torch]": _on_logits(LossBackend.TORCH),
    "on_logits[triton]": _on_logits(LossBackend.TRITON),
    "fused_linear_logprobs": _fused_logprobs,
    "fused_linear_loss": _fused_loss,
}


def _upstream_for(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    g_lp, g_ent = upstream()
    if path.startswith("on_logits"):
        g_ent = torch.full_like(g_lp, -ENTROPY_COEF / len(COMPLEMENTS))
    return g_lp, g_ent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", list(PATHS))
def test_the_target_gradient_is_exact_for_confident_tokens(path: str, dtype: torch.dtype) -> None:
    logits, target = confident_logits(dtype)
    g_lp, g_ent = _upstream_for(path)
    ref, p_t = reference_gradient(logits, target, g_lp, g_ent)
    # the rows span what they should: 1 - p_t from 0.7 down to ~1e-7
    assert float(1 - p_t.min()) > 0.5 and float(1 - p_t.max()) < 2e-7, (1 - p_t).tolist()
    assert_target_gradient(PATHS[path](logits, target, g_lp, g_ent), ref, target, f"{path}, {dtype}")


def test_fp32_logits_of_bf16_operands_on_the_fused_ops() -> None:
    """``LogitDtype.FP32`` on bf16 hidden states: fp32 logits, the gradient narrowed in place to bf16 (over a captured
    support too: its gradient read from the fp32 logits before the row is narrowed, then scattered into it)."""
    logits, target = confident_logits(torch.bfloat16)
    g_lp, g_ent = upstream()
    ref, _ = reference_gradient(logits, target, g_lp, g_ent)
    s_logits, s_target, support = confident_support_logits(torch.bfloat16)
    s_ref, _ = reference_gradient(s_logits, s_target, g_lp, g_ent, support_mask(support))
    for name in ("fused_linear_logprobs", "fused_linear_loss"):
        grad = PATHS[name](logits, target, g_lp, g_ent, logit_dtype=LogitDtype.FP32)
        assert_target_gradient(grad, ref, target, f"{name}, bf16 operands, fp32 logits")
        grad = PATHS[name](s_logits, s_target, g_lp, g_ent, logit_dtype=LogitDtype.FP32, captured_support=support)
        assert_target_gradient(grad, s_ref, s_target, f"{name} over a support, bf16 operands, fp32 logits")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", list(PATHS))
def test_the_target_gradient_is_exact_over_a_captured_support(path: str, dtype: torch.dtype) -> None:
    logits, target, support = confident_support_logits(dtype)
    g_lp, g_ent = _upstream_for(path)
    ref, p_t = reference_gradient(logits, target, g_lp, g_ent, support_mask(support))
    assert float(1 - p_t.min()) > 0.5 and float(1 - p_t.max()) < 2e-7, (1 - p_t).tolist()
    grad = PATHS[path](logits, target, g_lp, g_ent, captured_support=support)
    assert_target_gradient(grad, ref, target, f"{path} over a support, {dtype}")


def _naive_backward(real):
    """The mutant: the backward kernel given 1 - p_t and log p_t + H formed from the recomputed fp32 p_t (what the
    kernels did) instead of the merge's sums of the other tokens (the arguments of ``logprob_backward`` and
    ``support_backward`` alike: the logits, the gradient, the targets, M, log S, 1 - p_t, H, log p_t + H first)."""

    def naive(logits, grad_logits, target, row_max, log_sum, complement, entropy, centered, *args, vocab_start,
              inv_temperature, **kwargs):
        col = target - vocab_start
        inside = (col >= 0) & (col < logits.shape[1])
        x_t = logits.gather(1, torch.where(inside, col, 0)[:, None])[:, 0].float()
        lp_t = (x_t - row_max) * inv_temperature - log_sum
        complement = torch.where(inside, 1.0 - torch.exp(lp_t), complement)
        if centered is not None and centered.numel():
            centered = torch.where(inside, lp_t + entropy, centered)
        return real(logits, grad_logits, target, row_max, log_sum, complement, entropy, centered, *args,
                    vocab_start=vocab_start, inv_temperature=inv_temperature, **kwargs)

    return naive


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("support", [False, True], ids=["vocabulary", "support"])
def test_a_mutant_forming_one_minus_p_from_p_fails(path: str, dtype: torch.dtype, support: bool, monkeypatch) -> None:
    for module in OP_MODULES:
        for name in ("logprob_backward", "support_backward"):
            monkeypatch.setattr(module, name, _naive_backward(getattr(module, name)))
    if support:
        logits, target, captured = confident_support_logits(dtype)
        kwargs, keep = {"captured_support": captured}, support_mask(captured)
    else:
        (logits, target), kwargs, keep = confident_logits(dtype), {}, None
    g_lp, g_ent = _upstream_for(path)
    ref, _ = reference_gradient(logits, target, g_lp, g_ent, keep)
    with pytest.raises(AssertionError, match="target's logit gradient is off") as failure:
        assert_target_gradient(PATHS[path](logits, target, g_lp, g_ent, **kwargs), ref, target, path)
    failed_at = eval(str(failure.value).split("1 - p_t = ")[1].split("]")[0] + "]")  # noqa: S307 (our own message)
    assert min(failed_at) <= MUTANT_FAILS_FROM, failed_at


def test_tensor_parallel() -> None:
    """TP = 2 under torchrun: the target in either shard; the logits path and both fused ops, fp32 and bf16."""
    torchrun(__file__, "case_tensor_parallel", nproc=2)


def case_tensor_parallel() -> None:
    import torch.distributed as dist

    size, rank = dist.get_world_size(), dist.get_rank()
    tp = dict(tp_group=dist.group.WORLD)
    v_local = V // size
    for dtype in (torch.float32, torch.bfloat16):
        logits, target = confident_logits(dtype, seed=2)
        assert len(set((target // v_local).tolist())) == size  # targets in every shard
        g_lp, g_ent = upstream(seed=3)
        ref, _ = reference_gradient(logits, target, g_lp, g_ent)
        # the logits path: this rank's shard of the gradient; the ranks' shards side by side are the whole
        grad = _logits_path(logits[:, rank * v_local:(rank + 1) * v_local].contiguous(), target, g_lp, g_ent, **tp)
        shards = [torch.empty_like(grad) for _ in range(size)]
        dist.all_gather(shards, grad.contiguous())
        assert_target_gradient(torch.cat(shards, dim=1), ref, target, f"TP {size} logits path, {dtype}")
        for name, fn in (("fused_linear_logprobs", _fused_logprobs), ("fused_linear_loss", _fused_loss)):
            # the hidden state's gradient: this rank's vocabulary shard's part, summed over the ranks by the caller
            # (as Megatron's column-parallel layer does)
            grad_h = fn(logits, target, g_lp, g_ent, rank=rank, size=size, **tp)
            dist.all_reduce(grad_h)
            assert_target_gradient(grad_h, ref, target, f"TP {size} {name}, {dtype}")
        # over a captured support whose ids lie on both shards
        logits, target, support = confident_support_logits(dtype, seed=4)
        ref, _ = reference_gradient(logits, target, g_lp, g_ent, support_mask(support))
        grad = _logits_path(logits[:, rank * v_local:(rank + 1) * v_local].contiguous(), target, g_lp, g_ent,
                            captured_support=support, **tp)
        shards = [torch.empty_like(grad) for _ in range(size)]
        dist.all_gather(shards, grad.contiguous())
        assert_target_gradient(torch.cat(shards, dim=1), ref, target, f"TP {size} logits path over a support, {dtype}")
        grad_h = _fused_loss(logits, target, g_lp, g_ent, rank=rank, size=size, captured_support=support, **tp)
        dist.all_reduce(grad_h)
        assert_target_gradient(grad_h, ref, target, f"TP {size} fused_linear_loss over a support, {dtype}")


if __name__ == "__main__":
    worker_main({"case_tensor_parallel": case_tensor_parallel})
