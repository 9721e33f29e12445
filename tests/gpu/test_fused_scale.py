"""The with-loss op's backward scaling on a GPU (mp_grpo/ops/scale.py, kernels/scale.py); skipped without CUDA.

* ``scale_into`` against the float64 reference for every dtype pairing, at sizes the launcher specializes as
  16-byte aligned (vector accesses) and at odd ones, in place, cast and accumulated into ``main_grad``;
* past 2^31 elements (int64 offsets: a ``[V_local, H]`` weight gradient may be that large);
* ``fused_linear_loss`` forward + backward — GRPOLoss given its GlobalBatch, default ``check_inputs``, the
  weight gradient into an fp32 ``main_grad`` or returned, its buffer fp32 or of weight's dtype — under
  ``torch.cuda.set_sync_debug_mode("error")``: the upstream gradient is read on the device, nothing synchronizes;
  and its gradients against the float64 reference with the weight-dtype buffer (the benchmark's correctness
  check covers the fp32 one).

    python -m pytest tests/gpu/test_fused_scale.py -v
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mp_grpo.ops.fused_linear_loss import fused_linear_loss
from mp_grpo.ops.scale import scale_into
from tests.reference import linear_logprobs_reference, scale_reference
from tests.tolerances import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("numel,x_dtype,out_dtype", [
    *((2**20, x, out) for x, out in itertools.product(DTYPES, DTYPES)),  # aligned: 16-byte vector accesses
    (1_000_003, torch.bfloat16, torch.bfloat16), (1_000_003, torch.float32, torch.bfloat16),  # a ragged tail
])
def test_scale_matches_reference_on_gpu(numel, x_dtype, out_dtype):
    gen = torch.Generator(device="cuda").manual_seed(numel % 97)
    x = (torch.randn(numel, device="cuda", generator=gen) * 3).to(x_dtype)
    scale = torch.rand((), device="cuda", generator=gen) * 3 + 0.25
    assert_close(scale_into(x, scale, dtype=out_dtype), scale_reference(x, scale), out_dtype, "cast")
    main = torch.randn(numel, device="cuda", generator=gen).to(out_dtype)
    expected = scale_reference(x, scale, main)
    scale_into(x, scale, out=main, accumulate=True)
    assert_close(main, expected, out_dtype, "accumulate")
    if x_dtype == out_dtype:
        expected = scale_reference(x, scale)
        scale_into(x, scale, out=x)
        assert_close(x, expected, x_dtype, "in place")


def test_scale_past_2_31_elements():
    n = 2**31 + 3 * 4096 + 5
    x = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    x[-7:] = torch.arange(7, device="cuda", dtype=torch.bfloat16)
    scale_into(x, torch.tensor(2.0, device="cuda"), out=x)
    for lo in (0, 2**31 - 2048, n - 4096):
        expected = torch.full((4096,), 2.0, device="cuda", dtype=torch.float64)
        if lo == n - 4096:
            expected[-7:] = 2.0 * torch.arange(7, device="cuda", dtype=torch.float64)
        assert torch.equal(x[lo : lo + 4096].double(), expected), f"elements {lo}..{lo + 4096}"
    del x


def _grpo_loss_fn(shape, device):
    from mp_grpo.config.loss import LossConfig
    from mp_grpo.loss import GlobalBatch, GRPOLoss

    gen = torch.Generator(device=device).manual_seed(5)
    mask = torch.ones(shape, device=device, dtype=torch.bool)
    mask[0, -3:] = False
    adv = torch.randn(shape[0], device=device, generator=gen)
    old = -torch.rand(shape, device=device, generator=gen) * 4 - 2
    loss = GRPOLoss(LossConfig())
    batch = GlobalBatch.from_masks([mask])

    def loss_fn(lp, ent):
        return loss(lp.view(shape), old, adv, mask, entropy=None if ent is None else ent.view(shape), batch=batch)

    return loss_fn


@pytest.mark.parametrize("main_grad", [False, True])
@pytest.mark.parametrize("weight_dtype_buffer", [False, True])
def test_fused_linear_loss_no_host_sync(monkeypatch, main_grad, weight_dtype_buffer):
    import mp_grpo.ops.fused_linear_loss as op

    if weight_dtype_buffer:
        monkeypatch.setattr(op, "WEIGHT_GRAD_FP32_BYTES", 0)
    shape, hidden_size, vocab = (4, 96), 256, 5000
    gen = torch.Generator(device="cuda").manual_seed(1)
    h = (torch.randn(*shape, hidden_size, device="cuda", generator=gen)).to(torch.bfloat16).requires_grad_()
    w = torch.nn.Parameter((torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 0.05).to(torch.bfloat16))
    t = torch.randint(0, vocab, shape, device="cuda", generator=gen)
    if main_grad:
        w.main_grad = torch.zeros(w.shape, device="cuda")
        w.grad_added_to_main_grad = False
    loss_fn = _grpo_loss_fn(shape, "cuda")
    g = torch.tensor(0.37, device="cuda")

    def step():
        h.grad = w.grad = None
        loss, _ = fused_linear_loss(h, w, t, loss_fn, with_entropy=True, chunk_tokens=100,
                                    accumulate_into_main_grad=main_grad)
        loss.backward(g)

    step()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert h.grad is not None and torch.isfinite(h.grad).all()


@pytest.mark.parametrize("main_grad", [False, True])
def test_fused_linear_loss_weight_dtype_buffer_matches_reference(monkeypatch, main_grad):
    """V_local·H above WEIGHT_GRAD_FP32_BYTES (V = 151936 at H = 4096): the weight gradient summed in bf16 and
    scaled in place, or added into an fp32 main_grad; cuBLAS, real kernels, several row chunks."""
    import mp_grpo.ops.fused_linear_loss as op

    monkeypatch.setattr(op, "WEIGHT_GRAD_FP32_BYTES", 0)
    n, hidden_size, vocab = 1000, 256, 5000
    gen = torch.Generator(device="cuda").manual_seed(2)
    hidden = (torch.randn(n, hidden_size, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 0.2).to(torch.bfloat16)
    t = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    coef = torch.randn(n, device="cuda", generator=gen)

    def loss_fn(lp, ent):
        return (torch.exp(lp) * coef + lp).sum() - (ent * coef).sum(), None

    h, w = hidden.clone().requires_grad_(), torch.nn.Parameter(weight.clone())
    if main_grad:
        w.main_grad = torch.zeros(w.shape, device="cuda")
        w.grad_added_to_main_grad = False
    loss, _ = fused_linear_loss(h, w, t, loss_fn, with_entropy=True, chunk_tokens=300,
                                accumulate_into_main_grad=main_grad)
    loss.backward(torch.tensor(0.5, device="cuda"))

    ref_h, ref_w = hidden.cpu().double().requires_grad_(), weight.cpu().double().requires_grad_()
    lp, ent = linear_logprobs_reference(ref_h, ref_w, t.cpu(), logits_dtype=torch.bfloat16)
    c = coef.cpu().double()
    ((torch.exp(lp) * c + lp).sum() - (ent * c).sum()).mul(0.5).backward()
    grad_w = w.main_grad if main_grad else w.grad
    for name, actual, expected in (("grad hidden", h.grad, ref_h.grad), ("grad weight", grad_w, ref_w.grad)):
        scale = expected.abs().max()
        assert_close(actual.cpu().double() / scale, expected / scale, torch.bfloat16, name)
