"""The torch path of the per-token formulas written once in :mod:`mp_grpo.kernels.token_math`.

:func:`torch_formula` takes one of those ``@triton.jit`` functions and returns its Python source compiled
against torch instead of Triton: the same code object, with ``tl`` bound to :class:`TorchLanguage` (the
subset of ``triton.language`` the dialect allows), ``K`` to the plain-int codes of
:mod:`mp_grpo.kernels.grpo_loss_constants`, the dialect's helpers to their torch equivalents
(:data:`TORCH_HELPERS`) and the other formulas it calls to their own torch versions. Nothing is re-derived:
a formula edited in ``token_math.py`` changes both paths. Every per-token formula the kernels and the torch
path share runs through here (``mp_grpo/loss``: clamps, objectives, rollout correction, OPSM, top-entropy,
aggregation, KL, mismatch).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from functools import cache

import torch
import triton.language as tl

from mp_grpo.kernels import grpo_loss_constants


def _minimum(a, b):
    """``min(a, b)`` as ``torch.clamp``: its gradient goes to a tensor ``a`` wherever ``a ≤ b`` (an inclusive
    bound, as the kernels' masks; ``torch.minimum`` would split it at a tie); NaN propagates. ``b`` may be a
    Python scalar or a tensor."""
    if isinstance(a, torch.Tensor):
        return torch.clamp(a, max=b)
    if isinstance(b, torch.Tensor):
        return torch.clamp(b, max=a)
    return min(a, b)


def _maximum(a, b):
    """``max(a, b)`` as ``torch.clamp`` (gradient to a tensor ``a`` wherever ``a ≥ b``); see :func:`_minimum`."""
    if isinstance(a, torch.Tensor):
        return torch.clamp(a, min=b)
    if isinstance(b, torch.Tensor):
        return torch.clamp(b, min=a)
    return max(a, b)


def _where(condition, x, y):
    """``torch.where``; one of ``x``, ``y`` must be a tensor, whose dtype the result takes (two Python scalars
    would give torch's default dtype, where Triton gives the compute dtype)."""
    if not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor):
        raise TypeError("tl.where in a token_math formula needs a tensor operand on the torch path (both were "
                        "Python scalars); pass a 0-dim tensor of the compute dtype, or build one with tl.zeros_like")
    return torch.where(condition, x, y)


class TorchLanguage:
    """The part of ``triton.language`` the dialect allows, on torch tensors."""

    where = staticmethod(_where)
    zeros_like = staticmethod(torch.zeros_like)
    minimum = staticmethod(_minimum)
    maximum = staticmethod(_maximum)
    exp = staticmethod(torch.exp)
    log = staticmethod(torch.log)
    abs = staticmethod(torch.abs)
    sigmoid = staticmethod(torch.sigmoid)
    float64 = torch.float64
    constexpr = tl.constexpr  # annotations only


CODES = types.SimpleNamespace(
    **{name: value.value for name, value in vars(grpo_loss_constants).items() if isinstance(value, tl.constexpr)}
)
"""The kernels' codes and slots (``K.*``) as plain ints (torch.compile traces ints, not Triton constexprs)."""

TORCH_HELPERS: dict[str, Callable] = {"expm1": torch.expm1, "stop_gradient": torch.Tensor.detach}
"""The dialect's helper functions and what they are on torch tensors."""


@cache
def torch_formula(formula) -> Callable:
    """``formula`` (a ``@triton.jit`` function of ``token_math``) as a plain function of torch tensors; its
    ``tl.constexpr`` arguments become plain Python values (pass the codes of :data:`CODES`). The formulas it
    calls run as their torch versions too. Its globals are a module of their own (:func:`_torch_module`)."""
    raw = formula.fn
    namespace = _torch_module(raw.__globals__).__dict__
    for name in raw.__code__.co_names:
        value = raw.__globals__.get(name)
        if isinstance(value, type(formula)) and name not in TORCH_HELPERS:  # another formula
            namespace[name] = torch_formula(value)
    return types.FunctionType(raw.__code__, namespace, raw.__name__, raw.__defaults__, raw.__closure__)


def _torch_module(source: dict) -> types.ModuleType:
    """The globals of a formula module's torch versions: a module registered in ``sys.modules`` under its own name
    (``mp_grpo.loss.dialect.torch.`` + the source module's full name) holding the source module's names with
    ``tl``, ``K`` and the helpers rebound. A module of its own, not a copy of the source's dict under the source's
    ``__name__``: torch.compile guards a function's globals through the module its ``__name__`` names, and the
    source module's ``tl`` is ``triton.language``."""
    name = f"{__name__}.torch.{source['__name__']}"
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        module.__dict__.update({k: v for k, v in source.items() if not k.startswith("__")},
                               __builtins__=source["__builtins__"])
        module.__dict__.update(tl=TorchLanguage, K=CODES, **TORCH_HELPERS)
        sys.modules[name] = module
    return module
