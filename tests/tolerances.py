"""One tolerance per dtype, used by every numerical test and by the benchmarks' sanity checks.

Figures are relative to the float64 reference. fp32 kernels accumulate in fp32 over at most a few
thousand terms; bf16/fp16 inputs are rounded before the reference sees them (the reference is
computed from the *same* rounded values upcast to float64), so only the kernel's fp32 arithmetic and
the rounding of its bf16/fp16 outputs remain.
"""

from __future__ import annotations

import torch

_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    # dtype: (rtol, atol)
    torch.float64: (1e-10, 1e-12),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """``dict(rtol=..., atol=...)`` for comparing an output of ``dtype`` with a float64 reference."""
    rtol, atol = _TOLERANCES[dtype]
    return {"rtol": rtol, "atol": atol}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, msg: str = "") -> None:
    """``torch.testing.assert_close`` at ``tolerance(dtype)``, comparing in float64; NaN never passes."""
    assert not torch.isnan(actual).any(), f"NaN in result {msg}"
    torch.testing.assert_close(
        actual.detach().double().cpu(), expected.detach().double().cpu(), **tolerance(dtype), msg=msg or None
    )
