"""``logit_dtype``: log-probs and entropy from fp32 logits of the same bf16 operands, on every op that makes logits.

Against float64 logits of the same bf16 hidden states and weight, at the logit scales of trained models (row
maxima ~15 and ~30): with ``LogitDtype.FP32`` the log-prob and the entropy are within ``CPU_FP32_MAX_ABS`` of
float64 (the fp32 accumulation is all that remains); with ``LogitDtype.BF16`` they carry the logits' bf16 rounding,
more than ``CPU_BF16_MIN_MAX_ABS`` at these scales (what the fp32 setting removes, measured here so that a test
which cannot tell the two apart would fail). A mutant that rounds the fp32 logits to bf16 fails the fp32 check.
The gradients (through a random upstream gradient) are those of the float64 reference whose logits' gradient is
rounded to bf16, as the backward GEMMs take it. Ops: ``fused_linear_logprobs`` (forward chunks and the backward
recompute, the gradient narrowed in place), ``fused_linear_loss`` (the loss's log-probs and gradient in forward),
``batch_major_linear`` (the logits path's output layer) + ``vocab_parallel_logprobs``; TP = 2 under torchrun.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from mp_grpo import LogitDtype, fused_linear_logprobs, fused_linear_loss, vocab_parallel_logprobs
from mp_grpo.ops.batch_major_linear import batch_major_linear
from mp_grpo.ops.output_chunks import logits_dtype
from tests.distributed import torchrun, worker_main
from tests.logit_precision import CPU_BF16_MIN_MAX_ABS, CPU_FP32_MAX_ABS
from tests.reference import linear_logprobs_reference
from tests.tolerances import assert_close

# the modules (mp_grpo.ops re-exports functions of the same names as two of them)
chunks_module = importlib.import_module("mp_grpo.ops.output_chunks")
OPS_MODULES = [importlib.import_module(f"mp_grpo.ops.{name}")
               for name in ("fused_linear_logprobs", "fused_linear_loss", "batch_major_linear")]

LOGIT_MAX = [15.0, 30.0]
N, H, V = 48, 64, 300


def _case(logit_max: float, seed: int):
    """bf16 hidden states and weight whose logits have row maxima near ``logit_max``; half the targets sampled from
    the model (the tokens a policy writes), half uniform."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen)
    # The max of V normals of std s is ~2.9 s at V = 300.
    scale = logit_max / (2.9 * H**0.5)
    hidden, weight = hidden.bfloat16(), (weight * scale).bfloat16()
    logits = hidden.double() @ weight.double().T
    sampled = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)[:, 0]
    uniform = torch.randint(0, V, (N,), generator=gen)
    target = torch.where(torch.arange(N) % 2 == 0, sampled, uniform)
    return hidden, weight, target


def _fused(h, w, t, logit_dtype):
    return fused_linear_logprobs(h, w, t, with_entropy=True, chunk_tokens=16, chunk_vocab=96, logit_dtype=logit_dtype)


def _logits_path(h, w, t, logit_dtype):
    logits = batch_major_linear(h.unsqueeze(1), w, logit_dtype=logit_dtype)  # [S, B = 1, V]
    return vocab_parallel_logprobs(logits[:, 0], t, with_entropy=True)


def _fused_loss(h, w, t, logit_dtype):
    """fused_linear_loss of Σ g_lp·logp + g_ent·H: its log-probs and entropy come out through ``aux``."""
    def loss_fn(lp, ent):
        return (lp * _UPSTREAM[0]).sum() + (ent * _UPSTREAM[1]).sum(), (lp.detach().clone(), ent.detach().clone())

    loss, (lp, ent) = fused_linear_loss(h, w, t, loss_fn, with_entropy=True, chunk_tokens=16, logit_dtype=logit_dtype)
    return _LossOutputs.apply(loss, lp, ent)


class _LossOutputs(torch.autograd.Function):
    """(log-probs, entropy) whose backward is the loss's: fused_linear_loss took the upstream gradients
    ``_UPSTREAM`` in forward, so the test's backward through Σ g·x must reach the loss with gradient 1."""

    @staticmethod
    def forward(ctx, loss, lp, ent):
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        return torch.ones((), dtype=torch.float32), None, None


_UPSTREAM: list[torch.Tensor] = []
PATHS = {"fused_linear_logprobs": _fused, "fused_linear_loss": _fused_loss, "logits path": _logits_path}


def _set_upstream() -> None:
    _UPSTREAM[:] = [torch.randn(N, generator=torch.Generator().manual_seed(7)),
                    torch.randn(N, generator=torch.Generator().manual_seed(8))]


def _run(path, hidden, weight, target, logit_dtype):
    _set_upstream()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = PATHS[path](h, w, target, logit_dtype)
    ((lp * _UPSTREAM[0]).sum() + (ent * _UPSTREAM[1]).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _reference(hidden, weight, target):
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp, ent = linear_logprobs_reference(h, w, target, logits_grad_dtype=torch.bfloat16)
    ((lp * _UPSTREAM[0].double()).sum() + (ent * _UPSTREAM[1].double()).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _max_errors(got, want) -> tuple[float, float]:
    return float((got[0].double() - want[0]).abs().max()), float((got[1].double() - want[1]).abs().max())


def assert_fp32_precision(got, want, what: str) -> None:
    lp_err, ent_err = _max_errors(got, want)
    assert lp_err <= CPU_FP32_MAX_ABS and ent_err <= CPU_FP32_MAX_ABS, \
        f"{what}: max |Δ| log-prob {lp_err:.3g}, entropy {ent_err:.3g} > {CPU_FP32_MAX_ABS:g} (fp32 logits)"


@pytest.mark.parametrize("logit_max", LOGIT_MAX)
@pytest.mark.parametrize("path", sorted(PATHS))
def test_fp32_logits_are_exact_to_fp32_and_bf16_are_not(path: str, logit_max: float) -> None:
    hidden, weight, target = _case(logit_max, seed=int(logit_max))
    got32 = _run(path, hidden, weight, target, LogitDtype.FP32)
    want = _reference(hidden, weight, target)
    assert_fp32_precision(got32, want, f"{path}, logit max ~{logit_max}")
    got16 = _run(path, hidden, weight, target, LogitDtype.BF16)
    assert max(_max_errors(got16, want)) > CPU_BF16_MIN_MAX_ABS, f"{path}: bf16 logits as exact as fp32"
    # gradients: the reference's logits' gradient is rounded to bf16, as the backward GEMMs take it
    for name, ours, ref in (("hidden", got32[2], want[2]), ("weight", got32[3], want[3])):
        assert ours.dtype == torch.bfloat16
        scale = float(ref.abs().max())
        assert_close(ours.double() / scale, ref / scale, torch.bfloat16, f"{path}: d/d{name}, fp32 logits")


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_mutant_that_rounds_the_logits_to_bf16_fails(path: str, monkeypatch) -> None:
    """The fp32 check catches a GEMM whose fp32 output is rounded to bf16 (what the bf16 setting does)."""
    real = chunks_module.matmul_into

    def rounding_matmul_into(out, a, b, *, accumulate):
        real(out, a, b, accumulate=accumulate)
        if out.dtype == torch.float32 and a.dtype == torch.bfloat16 and not accumulate:
            out.copy_(out.bfloat16())

    for module in OPS_MODULES:
        monkeypatch.setattr(module, "matmul_into", rounding_matmul_into)
    hidden, weight, target = _case(30.0, seed=3)
    got = _run(path, hidden, weight, target, LogitDtype.FP32)
    with pytest.raises(AssertionError, match="fp32 logits"):
        assert_fp32_precision(got, _reference(hidden, weight, target), path)


def test_fp32_model_and_bad_values() -> None:
    hidden, weight, target = _case(15.0, seed=5)
    assert logits_dtype(LogitDtype.FP32, hidden.float()) == torch.float32
    assert logits_dtype(LogitDtype.BF16, hidden) == torch.bfloat16
    assert logits_dtype(LogitDtype.FP32, hidden) == torch.float32
    with pytest.raises(TypeError, match="logit_dtype must be a LogitDtype"):
        fused_linear_logprobs(hidden, weight, target, logit_dtype="fp32")
    with pytest.raises(TypeError, match="logit_dtype must be a LogitDtype"):
        batch_major_linear(hidden.unsqueeze(1), weight, logit_dtype=torch.float32)


def test_refused_where_the_torch_has_no_fp32_output_gemm(monkeypatch) -> None:
    """On CUDA without cuBLAS's mixed-dtype GEMM, fp32 logits would need fp32 copies and an fp32 GEMM: refused."""
    monkeypatch.setattr(chunks_module, "_MIXED_DTYPE_GEMM", False)
    cuda_bf16 = SimpleNamespace(dtype=torch.bfloat16, is_cuda=True)
    with pytest.raises(ValueError, match="logit_dtype=fp32: this torch .* no CUDA GEMM"):
        logits_dtype(LogitDtype.FP32, cuda_bf16)
    assert logits_dtype(LogitDtype.BF16, cuda_bf16) == torch.bfloat16


def test_tensor_parallel() -> None:
    """TP = 2 under torchrun: each rank's vocabulary shard, fp32 logits on both fused ops and the logits path."""
    torchrun(__file__, "case_tensor_parallel", nproc=2)


def case_tensor_parallel() -> None:
    import torch.distributed as dist

    tp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    _set_upstream()
    for logit_max in LOGIT_MAX:
        hidden, weight, target = _case(logit_max, seed=11)
        want = _reference(hidden, weight, target)
        shard = weight[rank * V // tp:(rank + 1) * V // tp]
        for name, fn in (
            ("fused", lambda ld: fused_linear_logprobs(hidden, shard, target, tp_group=group, with_entropy=True,
                                                       chunk_tokens=16, chunk_vocab=64, logit_dtype=ld)),
            ("logits", lambda ld: vocab_parallel_logprobs(
                batch_major_linear(hidden.unsqueeze(1), shard, logit_dtype=ld)[:, 0], target, tp_group=group,
                with_entropy=True)),
        ):
            assert_fp32_precision(fn(LogitDtype.FP32), want, f"TP {tp} {name}, logit max ~{logit_max}")
            assert max(_max_errors(fn(LogitDtype.BF16), want)) > CPU_BF16_MIN_MAX_ABS


if __name__ == "__main__":
    worker_main({"case_tensor_parallel": case_tensor_parallel})
