"""The torch path of the per-token formulas written once in :mod:`mp_grpo.kernels.token_math` (issue 17, item 3).

:func:`torch_formula` takes one of those ``@triton.jit`` functions and returns its Python source compiled
against torch instead of Triton: the same code object, with ``tl`` bound to :class:`TorchLanguage` (the
subset of ``triton.language`` the dialect allows), ``K`` to the plain-int codes of
:mod:`mp_grpo.kernels.grpo_loss_common`, and the dialect's helpers to their torch equivalents
(:data:`TORCH_HELPERS`). Nothing is re-derived: a formula edited in ``token_math.py`` changes both paths.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import triton.language as tl

from mp_grpo.kernels import grpo_loss_common


class TorchLanguage:
    """The part of ``triton.language`` the dialect allows, on torch tensors."""

    where = staticmethod(torch.where)
    zeros_like = staticmethod(torch.zeros_like)


CODES = types.SimpleNamespace(
    **{name: value.value for name, value in vars(grpo_loss_common).items() if isinstance(value, tl.constexpr)}
)
"""The kernels' codes and slots (``K.*``) as plain ints (torch.compile traces ints, not Triton constexprs)."""

TORCH_HELPERS: dict[str, Callable] = {"expm1": torch.expm1, "stop_gradient": torch.Tensor.detach}
"""The dialect's helper functions and what they are on torch tensors."""


def torch_formula(formula) -> Callable:
    """``formula`` (a ``@triton.jit`` function of ``token_math``) as a plain function of torch tensors; its
    ``tl.constexpr`` arguments become plain Python values (pass the codes of :data:`CODES`)."""
    raw = formula.fn
    namespace = dict(raw.__globals__, tl=TorchLanguage, K=CODES, **TORCH_HELPERS)
    return types.FunctionType(raw.__code__, namespace, raw.__name__, raw.__defaults__, raw.__closure__)
