"""batch_major_linear (mp_grpo/ops/batch_major_linear.py): GPTModel's output-layer GEMM with batch-major logits.

Against the float64 product on fresh random inputs: the logits, and the gradients w.r.t. the input and the
weight through a random upstream gradient, in both layouts the gradient can arrive in (batch-major, as
GPTModel's transpose hands it back; sequence-major, one copy); the weight gradient added into an fp32
``main_grad`` under gradient-accumulation fusion; no rows at all; the layout (the logits' transpose is contiguous: GPTModel's
``.contiguous()`` copies nothing); bad arguments named.
"""

from __future__ import annotations

import pytest
import torch

from mp_grpo.ops.batch_major_linear import batch_major_linear
from tests.tolerances import assert_close


def _inputs(s: int, b: int, h: int, v: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    hidden = torch.randn(s, b, h, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * h**-0.5).to(dtype).requires_grad_()
    grad = torch.randn(b, s, v, generator=gen).to(dtype)  # the loss's gradient of GPTModel's [B, S, V] output
    return hidden, weight, grad


def _reference(hidden: torch.Tensor, weight: torch.Tensor, grad_bsv: torch.Tensor):
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    logits = h64 @ w64.t()  # [S, B, V]
    logits.backward(grad_bsv.double().transpose(0, 1))
    return logits, h64.grad, w64.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 3, 16, 40), (5, 1, 8, 24)])  # (S, B, H, V); B = 1: no transposes at all
@pytest.mark.parametrize("grad_layout", ["batch_major", "sequence_major"])
def test_values_and_gradients_equal_the_float64_product(dtype, shape, grad_layout) -> None:
    s, b, h, v = shape
    hidden, weight, grad = _inputs(s, b, h, v, dtype)
    logits = batch_major_linear(hidden, weight)
    assert logits.shape == (s, b, v) and logits.dtype == dtype
    assert logits.transpose(0, 1).is_contiguous(), "GPTModel's transpose of the logits must be contiguous"
    out = logits.transpose(0, 1).contiguous()  # what GPTModel returns
    assert out.data_ptr() == logits.data_ptr(), "GPTModel's .contiguous() copied the logits"
    upstream = grad if grad_layout == "batch_major" else grad.transpose(0, 1).contiguous().transpose(0, 1)
    out.backward(upstream)
    ref_logits, ref_h, ref_w = _reference(hidden, weight, grad)
    assert_close(logits, ref_logits, dtype, msg="logits")
    # Gradients are sums of rounded products: compared on the scale of their largest entry.
    for name, actual, expected in (("grad hidden", hidden.grad, ref_h), ("grad weight", weight.grad, ref_w)):
        scale = expected.abs().max()
        assert_close(actual.double() / scale, expected / scale, dtype, msg=name)


def test_no_rows() -> None:
    """A micro-batch without a loss row (``OutputRows.LOSS``): ``[0, 1, V]`` logits, a zero weight gradient."""
    hidden, weight, _ = _inputs(0, 1, 8, 24, torch.float32)
    logits = batch_major_linear(hidden, weight)
    assert logits.shape == (0, 1, 24)
    logits.transpose(0, 1).contiguous().backward(torch.zeros(1, 0, 24))
    assert hidden.grad.shape == (0, 1, 8) and torch.equal(weight.grad, torch.zeros_like(weight))


def test_weight_gradient_into_main_grad() -> None:
    """Gradient-accumulation fusion: added into the fp32 main_grad (bf16 operands, fp32 sums), zero placeholder."""
    hidden, weight, grad = _inputs(6, 2, 16, 32, torch.bfloat16)
    start = torch.randn(weight.shape, dtype=torch.float32)
    weight.main_grad = start.clone()
    weight.grad_added_to_main_grad = False
    batch_major_linear(hidden, weight, accumulate_into_main_grad=True).transpose(0, 1).backward(grad)
    _, ref_h, ref_w = _reference(hidden, weight, grad)
    assert weight.grad_added_to_main_grad
    assert weight.grad is not None and torch.count_nonzero(weight.grad) == 0, "the placeholder must be zeros"
    scale = ref_w.abs().max()
    assert_close((weight.main_grad - start).double() / scale, ref_w / scale, torch.bfloat16, msg="main_grad")
    assert_close(hidden.grad.double() / ref_h.abs().max(), ref_h / ref_h.abs().max(), torch.bfloat16, msg="grad hidden")


def test_no_weight_gradient_when_frozen() -> None:
    hidden, weight, grad = _inputs(4, 2, 8, 12, torch.float32)
    weight.requires_grad_(False)
    batch_major_linear(hidden, weight).transpose(0, 1).backward(grad)
    assert weight.grad is None and hidden.grad is not None


def test_bad_arguments_are_named() -> None:
    hidden, weight, _ = _inputs(4, 2, 8, 12, torch.float32)
    with pytest.raises(ValueError, match="hidden must be a \\[S, B, H\\]"):
        batch_major_linear(hidden[0], weight)
    with pytest.raises(ValueError, match="weight must be a \\[V_local, H=8\\]"):
        batch_major_linear(hidden, weight[:, :4])
    with pytest.raises(ValueError, match="hidden's dtype"):
        batch_major_linear(hidden, weight.double())
    with pytest.raises(ValueError, match="main_grad"):
        batch_major_linear(hidden, weight, accumulate_into_main_grad=True)
