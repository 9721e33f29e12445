"""scale_into (kernels/scale.py): ``out = cast(scale · x)`` / ``out += scale · x`` against the float64 reference.

Sizes that are not a multiple of the kernel's block, several programs, every float dtype of x, out and the
scale, in place, into a new tensor of another dtype, and accumulated into a ``main_grad`` of fp32 or the
parameter's dtype. The scale is a tensor on x's device (read by the kernel, never on the host).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mp_grpo.ops.scale import SCALE_BLOCK, scale_into
from tests.reference import scale_reference
from tests.tolerances import assert_close

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = ((5,), (3, SCALE_BLOCK + 7), (2 * SCALE_BLOCK,))  # one partial block, a partial last block, exact blocks


def _x(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 3).to(dtype), (torch.rand((), generator=gen) * 3 + 0.25)


@pytest.mark.parametrize("x_dtype,out_dtype", list(itertools.product(DTYPES, DTYPES)))
@pytest.mark.parametrize("shape", SIZES)
def test_cast_into_new_tensor(x_dtype, out_dtype, shape):
    x, scale = _x(shape, x_dtype, seed=len(shape) + DTYPES.index(x_dtype))
    before = x.clone()
    out = scale_into(x, scale, dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == x.shape and out.data_ptr() != x.data_ptr()
    assert_close(out, scale_reference(x, scale), out_dtype, f"{x_dtype} -> {out_dtype}, {shape}")
    assert torch.equal(x, before), "x was written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_dtype", DTYPES)
def test_in_place(dtype, scale_dtype):
    x, scale = _x((3, SCALE_BLOCK + 7), dtype, seed=7)
    scale = scale.to(scale_dtype)
    expected = scale_reference(x, scale)
    out = scale_into(x, scale, out=x)
    assert out is x
    assert_close(x, expected, dtype, f"in place, {dtype}, scale {scale_dtype}")


@pytest.mark.parametrize("main_dtype,x_dtype", [
    (torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
])
def test_accumulate_into_main_grad(main_dtype, x_dtype):
    """main_grad += scale · grad, twice (two micro-batches), onto a nonzero main_grad."""
    x, scale = _x((SCALE_BLOCK + 300,), x_dtype, seed=11)
    x2, scale2 = _x((SCALE_BLOCK + 300,), x_dtype, seed=12)
    main_grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(13)).to(main_dtype)
    expected = scale_reference(x2, scale2, scale_reference(x, scale, main_grad))
    assert scale_into(x, scale, out=main_grad, accumulate=True) is main_grad
    scale_into(x2, scale2, out=main_grad, accumulate=True)
    assert main_grad.dtype == main_dtype
    # bf16 main_grad rounds after each of the two additions: twice the one-rounding tolerance.
    if main_dtype == torch.bfloat16:
        err = (main_grad.double() - expected).abs() / (1.6e-2 + 1.6e-2 * expected.abs())
        assert err.max() <= 2.0, f"main_grad ({main_dtype}) off by {err.max():.2f} tolerances"
    else:
        assert_close(main_grad, expected, main_dtype, f"main_grad {main_dtype} += scale * {x_dtype}")


def test_scale_zero_and_negative():
    x, _ = _x((100,), torch.float32, seed=2)
    assert scale_into(x, torch.tensor(0.0)).eq(0).all()
    assert_close(scale_into(x, torch.tensor(-2.5)), -2.5 * x.double(), torch.float32, "negative scale")
    one_element = torch.tensor([1.5])  # a [1] tensor is one element too
    assert_close(scale_into(x, one_element), 1.5 * x.double(), torch.float32, "scale of shape [1]")


def test_empty():
    x = torch.empty(0, 4)
    assert scale_into(x, torch.tensor(2.0)).shape == (0, 4)
    main = torch.empty(0, 4)
    assert scale_into(x, torch.tensor(2.0), out=main, accumulate=True) is main


def test_bad_inputs_name_the_argument():
    x = torch.randn(4, 6)
    s = torch.tensor(2.0)
    with pytest.raises(ValueError, match="x must be contiguous"):
        scale_into(x.t(), s)
    with pytest.raises(ValueError, match="out must be contiguous"):
        scale_into(x.t().contiguous(), s, out=torch.empty(6, 4).t().contiguous().t())
    with pytest.raises(ValueError, match="out must have x's shape"):
        scale_into(x, s, out=torch.empty(6, 4))
    with pytest.raises(ValueError, match="scale must hold one element"):
        scale_into(x, torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="scale must be float32"):
        scale_into(x, torch.tensor(2))
    with pytest.raises(TypeError, match="x must be float32"):
        scale_into(x.double(), s)
    with pytest.raises(TypeError, match="out must be float32"):
        scale_into(x, s, out=torch.empty(4, 6, dtype=torch.int32))
    with pytest.raises(ValueError, match="scale is on meta"):
        scale_into(x, torch.tensor(2.0, device="meta"))  # a scale elsewhere than x: the kernel could not read it
    with pytest.raises(ValueError, match="accumulate=True needs out"):
        scale_into(x, s, accumulate=True)
    with pytest.raises(ValueError, match="disagrees with out's dtype"):
        scale_into(x, s, out=torch.empty(4, 6), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="overlaps x"):
        scale_into(x.view(-1)[:12], s, out=x.view(-1)[6:18])
    with pytest.raises(ValueError, match="overlaps x"):
        x16 = x.to(torch.bfloat16)
        scale_into(x16, s, out=x16.view(torch.float16))  # x's memory read as another dtype
