"""One entry point for every Triton launch of :mod:`mp_grpo.ops`: :func:`launch`, with a cheaper host path.

Why: ``kernel[grid](*args, **constexprs)`` costs the host tens of µs more per launch than launching the
compiled kernel directly (``scripts/profile_loss_host.py`` profiles it; the *normal launch* column of
``docs/benchmarks/logprob.md`` measures the difference): Triton's ``JITFunction.run`` specializes every argument
(a C++ call per argument), builds its cache key as a string, builds launch metadata for the launch hooks
and calls the (empty) hook chain. A logits → loss forward+backward makes several launches, so at V = 18992
the host, not the GPU, sets the step time.

Schedule of :func:`launch` (one call; CUDA, not the interpreter)

    1. The fast path is off (``set_fast_launch(False)``, the interpreter, a Triton without the API used
       here, launch hooks installed, the kernel's pre-run hooks): launch through ``kernel[grid](...)``.
    2. Build this call's specialization key (:func:`specialization_key`): for each runtime argument what
       Triton specializes on — a tensor's dtype and whether its address is 16-byte aligned; an int's
       ``== 1``, ``% 16 == 0`` and its range (i32 / i64 / u64); the Python type of everything else —,
       the constexpr and launch-option keywords with their types, the current device, and the debug /
       instrumentation knobs Triton puts in its own key. The key is finer than or equal to Triton's: two
       calls with one key compile to one kernel.
    3. Key seen before: launch its ``CompiledKernel`` directly — its launcher with the grid, the current
       stream, and the runtime arguments followed by the constexpr values in signature order (as Triton
       passes them), no launch metadata and no hooks (none are installed: step 1).
    4. Key new: launch through ``kernel[grid](...)`` (compiling if needed), keep the ``CompiledKernel`` it
       returns under the key for step 3.

Call convention the fast path relies on: runtime arguments positional, every constexpr and option
(``num_warps``) by keyword, grid a tuple. A kernel called otherwise (a parameter not given, e.g. a
default) always takes the normal path. Global values a kernel reads are ``tl.constexpr`` module
constants that never change, so Triton's per-launch "global changed" check is not repeated.

Feature detection happens once at import (:data:`FAST_LAUNCH_AVAILABLE`, :data:`FAST_LAUNCH_REASON`,
logged at debug level); no version string is parsed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import triton
from triton import knobs

from mp_grpo.kernels.launch_config import INTERPRETER

_log = logging.getLogger(__name__)

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_U64_MIN = 2**63
_ALIGN_MASK = 15
"""Triton's pointer and integer divisibility specialization is by 16 (bytes for pointers)."""


def _detect() -> tuple[bool, str]:
    if INTERPRETER:
        return False, "Triton interpreter (TRITON_INTERPRET): kernels run on the CPU through kernel[grid]"
    try:
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime.jit import JITFunction
    except ImportError as err:  # pragma: no cover - depends on the installed Triton
        return False, f"triton lacks CompiledKernel / JITFunction ({err})"
    missing = [f"{owner.__name__}.{name}" for owner, name in
               ((JITFunction, "run"), (CompiledKernel, "run"), (CompiledKernel, "launch_metadata"))
               if not hasattr(owner, name)]
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "launch_enter_hook") or not hasattr(runtime, "launch_exit_hook"):
        missing.append("knobs.runtime.launch_{enter,exit}_hook")
    if missing:
        return False, f"triton {triton.__version__} lacks {', '.join(missing)}"
    return True, f"triton {triton.__version__}: direct CompiledKernel launches"


FAST_LAUNCH_AVAILABLE, FAST_LAUNCH_REASON = _detect()
"""Whether this Triton offers what the fast path uses, and why (or why not)."""
_log.debug("mp_grpo fast launch: %s (%s)", "available" if FAST_LAUNCH_AVAILABLE else "off", FAST_LAUNCH_REASON)

_enabled = FAST_LAUNCH_AVAILABLE
_compiled: dict[tuple, tuple] = {}
"""(kernel, specialization key) → (CompiledKernel, its launcher, function handle, packed metadata, constexpr tail)."""
_UNCACHEABLE = ()
"""Marker entry of a key whose kernel cannot take the fast path (called against the convention)."""
_device_fns: tuple | None = None


def set_fast_launch(enabled: bool) -> None:
    """Turn the fast path on or off (benchmarks time both). Turning it on where it is unavailable raises."""
    global _enabled
    if enabled and not FAST_LAUNCH_AVAILABLE:
        raise RuntimeError(f"fast launch is unavailable: {FAST_LAUNCH_REASON}")
    _enabled = bool(enabled)


def fast_launch_enabled() -> bool:
    return _enabled


def clear_launch_cache() -> None:
    """Forget every kept ``CompiledKernel`` (tests)."""
    _compiled.clear()


def _arg_key(a: Any) -> Any:
    t = type(a)
    if t is int:
        size = "i32" if _I32_MIN <= a <= _I32_MAX else ("u64" if a >= _U64_MIN else "i64")
        return (a == 1, not (a & _ALIGN_MASK), size)
    if t is float:
        return float
    return (t, a)  # tensors are keyed in specialization_key itself


def _kwargs_key(kwargs: dict) -> tuple:
    return tuple((name, type(value), value) for name, value in kwargs.items())


def specialization_key(args: tuple, kwargs: dict, device: int = 0, kwargs_key: tuple | None = None) -> tuple:
    """The key of step 2 (see the module docstring): equal keys imply an equal Triton specialization.
    ``kwargs_key``: the keywords' part, when the caller has it already (:class:`LaunchMeta`)."""
    return (
        device, knobs.runtime.debug, getattr(knobs.compilation, "instrumentation_mode", None),
        *[(a.dtype, not (a.data_ptr() & _ALIGN_MASK)) if isinstance(a, torch.Tensor) else _arg_key(a) for a in args],
        _kwargs_key(kwargs) if kwargs_key is None else kwargs_key,
    )


class LaunchMeta:
    """The keyword arguments of a launch (constexprs and options such as ``num_warps``), with their part of the
    specialization key computed once: build one per kernel configuration, keep it, and launch with
    :func:`launch_meta` (a launch's host time grows with its keywords: the loss kernels have ~30)."""

    __slots__ = ("kwargs", "key")

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.key = _kwargs_key(kwargs)


def _hooks_installed() -> bool:
    runtime = knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return getattr(runtime, "add_stages_inspection_hook", None) is not None


def launch(kernel, grid: tuple, *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, through a kept ``CompiledKernel`` when the fast path is on."""
    _launch(kernel, grid, args, kwargs, None)


def launch_meta(kernel, grid: tuple, meta: LaunchMeta, *args: Any) -> None:
    """:func:`launch` with the keywords of ``meta`` (their key part computed once)."""
    _launch(kernel, grid, args, meta.kwargs, meta.key)


def _launch(kernel, grid: tuple, args: tuple, kwargs: dict, kwargs_key: tuple | None) -> None:
    global _device_fns
    # --- 1. normal path ---
    if not _enabled or getattr(kernel, "pre_run_hooks", None) or _hooks_installed():
        kernel[grid](*args, **kwargs)
        return
    if _device_fns is None:
        from triton.runtime import driver

        _device_fns = (driver.active.get_current_device, driver.active.get_current_stream)
    get_device, get_stream = _device_fns
    device = get_device()
    # --- 2. specialization key ---
    try:
        key = (kernel, specialization_key(args, kwargs, device, kwargs_key))
        entry = _compiled.get(key)
    except TypeError:  # an unhashable keyword value: no key
        kernel[grid](*args, **kwargs)
        return
    # --- 3. known key: direct launch ---
    if entry:
        _compiled_kernel, run, function, packed, tail = entry
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        run(grid[0], g1, g2, get_stream(device), function, packed, None, None, None, *args, *tail)
        return
    # --- 4. new key: normal launch, keep the CompiledKernel ---
    compiled = kernel[grid](*args, **kwargs)
    if entry is None:
        _compiled[key] = _entry(kernel, compiled, args, kwargs)


def _entry(kernel, compiled, args: tuple, kwargs: dict) -> tuple:
    names = kernel.arg_names[len(args):]
    if hasattr(compiled, "result"):  # a future under asynchronous compilation
        compiled = compiled.result()
    if any(name not in kwargs for name in names) or not all(
        hasattr(compiled, attr) for attr in ("run", "function", "packed_metadata")
    ):
        _log.debug("mp_grpo fast launch: %s keeps the normal path (call convention / CompiledKernel API)",
                   getattr(kernel, "__name__", kernel))
        return _UNCACHEABLE
    run = compiled.run  # initializes the handles
    return (compiled, run, compiled.function, compiled.packed_metadata, tuple(kwargs[name] for name in names))
