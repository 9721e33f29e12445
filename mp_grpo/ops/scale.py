"""Host launcher of :mod:`mp_grpo.kernels.scale`: scale a tensor by a 0-dim device tensor in one pass.

:func:`scale_into` — ``out = cast(scale · x)`` (in place when ``out`` is ``x``), or ``out += scale · x``
with ``accumulate=True`` (Megatron's ``main_grad``). The scale is read by the kernel from its device
pointer: no host synchronization, whatever its value. No intermediate buffer, nothing zero-filled.

Used by the backward of :func:`mp_grpo.ops.fused_linear_loss.fused_linear_loss` (its gradients are made in
forward; backward only scales them by the upstream gradient, casts them to the parameter's dtype and,
under gradient-accumulation fusion, adds the weight's into ``main_grad``), through
:func:`scale_into_unchecked`: its own buffers need no check.
"""

from __future__ import annotations

import torch

from mp_grpo.kernels.launch_config import ceil_div
from mp_grpo.kernels.scale import scale_kernel
from mp_grpo.ops.checks import check_runs_here
from mp_grpo.ops.launcher import launch

SCALE_BLOCK = 4096
"""Elements per program: 16 per thread at 8 warps (two to four 16-byte accesses per thread and tensor).
A memory-bound pass; not swept (any block of 1024–8192 elements keeps the H100's memory busy)."""

SCALE_WARPS = 8

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor) -> None:
    for name, t in (("x", x), ("out", out), ("scale", scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if scale.numel() != 1:
        raise ValueError(f"scale must hold one element (a 0-dim tensor), got shape {tuple(scale.shape)}")
    if out.shape != x.shape:
        raise ValueError(f"out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")
    for name, t in (("out", out), ("scale", scale)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: the kernel reads both on one device")
    for name, t in (("x", x), ("out", out)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel walks it as one flat array); call .contiguous()")
    if x.numel() > 0 and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        if out.data_ptr() != x.data_ptr() or out.dtype != x.dtype:
            raise ValueError("out overlaps x other than as x itself: in place needs out to be x (same start, dtype)")
    check_runs_here(x, "x")


def scale_into(
    x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None, *, dtype: torch.dtype | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """``out = (scale · x)`` in out's dtype, or ``out += scale · x`` with ``accumulate``; returns ``out``.

    Args:
        x: contiguous float tensor.
        scale: one-element float tensor on x's device (e.g. the upstream gradient of a 0-dim loss); read on
            the device, never on the host.
        out: contiguous, x's shape, on x's device; may be ``x`` itself (in place). None: a new tensor of
            ``dtype`` (default x's dtype), allocated without a fill (not with ``accumulate``).
        dtype: the dtype of a new ``out``; only when ``out`` is None.
        accumulate: add into ``out`` instead of overwriting it (Megatron's ``main_grad``).

    The product and sum are computed in fp32 and rounded once into out's dtype.
    """
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out (the tensor to add into)")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a tensor, got {type(x).__name__}")
        out = torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device)
    elif dtype is not None and dtype != out.dtype:
        raise ValueError(f"dtype={dtype} disagrees with out's dtype {out.dtype} (give one of them)")
    _check(x, out, scale)
    return scale_into_unchecked(x, scale, out, accumulate=bool(accumulate))


def scale_into_unchecked(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, *, accumulate: bool) -> torch.Tensor:
    """:func:`scale_into` without its argument checks, for a caller whose tensors are right by construction (the
    backward of :func:`~mp_grpo.ops.fused_linear_loss.fused_linear_loss`, on the buffers its forward made):
    ``x`` and ``out`` contiguous, of one shape, on one device the kernels run on, ``out`` is ``x`` or does not
    overlap it, ``scale`` one float element there."""
    n = x.numel()
    if n == 0:
        return out
    launch(scale_kernel, (ceil_div(n, SCALE_BLOCK),),
        x, out, scale,
        n,
        ACCUMULATE=accumulate,
        BLOCK=SCALE_BLOCK,
        num_warps=SCALE_WARPS,
    )
    return out
