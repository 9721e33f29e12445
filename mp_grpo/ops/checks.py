"""Argument checks shared by the log-prob ops, and the deferred error ledger. Each error names the argument at fault.

**Checks that never synchronize** (:func:`record_errors`, :func:`check_errors`). Some input errors can only
be seen on the device — a target id outside the vocabulary, vocabulary shards of unequal size across the
TP group (counted by the log-prob merge kernel), a loss mask whose content differs from the one the step's
GlobalBatch counted. Reading such a count on the host costs a synchronization per call. Instead:

* on the CPU the count is read at once (a CPU read is free) and the error raised immediately;
* on a GPU the count is added, in place and asynchronously, into a per-(kind, device) accumulator of
  this ledger — no host read; the outputs concerned are NaN meanwhile, so nothing is silently wrong —
  and :func:`check_errors` reads every accumulator with one host read per device and raises the first
  error, naming the argument. ``mp_grpo.reduce_metrics`` and ``GlobalBatch.skip_step`` call it (sync
  points a step already has); call ``mp_grpo.check_errors()`` yourself anywhere else, e.g. after a
  forward-only pass.

:func:`deferred_checks` makes the CPU defer too (tests of the mechanism).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

_ledger: dict[tuple[str, torch.device], tuple[torch.Tensor, Callable[[int], str], type[Exception]]] = {}
_defer_on_cpu = False


def record_errors(
    kind: str, count: torch.Tensor, message: Callable[[int], str], error: type[Exception] = ValueError
) -> None:
    """Raise ``error(message(n))`` if the 0-dim integer ``count`` n is nonzero — at once on the CPU, at the
    next :func:`check_errors` on a GPU (``count`` is then accumulated on the device without a host read)."""
    if count.device.type == "cpu" and not _defer_on_cpu:
        n = int(count)
        if n:
            raise error(message(n))
        return
    key = (kind, count.device)
    held = _ledger.get(key)
    if held is None:
        _ledger[key] = (count.detach().reshape(()).to(torch.int64).clone(), message, error)
    else:
        held[0].add_(count.detach().reshape(()))
        _ledger[key] = (held[0], message, error)  # the latest call's message (its shapes) describes the error


def check_errors() -> None:
    """Raise the first error recorded by :func:`record_errors` since the last check (one host read per device)."""
    if not _ledger:
        return
    held = list(_ledger.items())
    _ledger.clear()
    by_device: dict[torch.device, list[int]] = {}
    for i, ((_, device), _) in enumerate(held):
        by_device.setdefault(device, []).append(i)
    counts = [0] * len(held)
    for device, idx in by_device.items():
        for i, n in zip(idx, torch.stack([held[i][1][0] for i in idx]).tolist()):
            counts[i] = int(n)
    for ((kind, _), (_, message, error)), n in zip(held, counts):
        if n:
            raise error(f"{message(n)} [recorded on the device since the last mp_grpo.check_errors(): {kind}]")


@contextlib.contextmanager
def deferred_checks() -> Iterator[None]:
    """Defer CPU errors to :func:`check_errors` as on a GPU (to test the mechanism without one)."""
    global _defer_on_cpu
    before, _defer_on_cpu = _defer_on_cpu, True
    try:
        yield
    finally:
        _defer_on_cpu = before

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_logits_and_target(logits: torch.Tensor, target: torch.Tensor, *, logits_name: str = "logits") -> None:
    """Dtypes, shapes and devices of a ``[..., V_local]`` logits shard and its ``[...]`` targets."""
    if not isinstance(logits, torch.Tensor) or logits.dtype not in _FLOAT_DTYPES:
        got = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise TypeError(f"{logits_name} must be a float32, bfloat16 or float16 tensor, got {got}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"{logits_name} must have a non-empty last (vocabulary) dimension, got shape {tuple(logits.shape)}")
    check_target(target, expected_shape=logits.shape[:-1], device=logits.device, expected_from=f"{logits_name}.shape[:-1]")


def check_target(target: torch.Tensor, *, expected_shape: torch.Size, device: torch.device, expected_from: str) -> None:
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.int32):
        got = target.dtype if isinstance(target, torch.Tensor) else type(target).__name__
        raise TypeError(f"target must be an int64 (or int32) tensor of token ids, got {got}")
    if target.shape != expected_shape:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal {expected_from} = {tuple(expected_shape)}"
        )
    if target.device != device:
        raise ValueError(f"target is on {target.device} but the logits are on {device}")


def check_temperature(temperature: float) -> float:
    """Return ``1 / temperature`` as a Python float after checking it."""
    if isinstance(temperature, torch.Tensor) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a Python float, got {type(temperature).__name__}")
    if not temperature > 0.0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return 1.0 / float(temperature)


def check_runs_here(x: torch.Tensor, name: str) -> None:
    """Triton runs on CUDA tensors, or on CPU tensors only under its interpreter."""
    from triton import knobs

    if x.device.type != "cuda" and not knobs.runtime.interpret:
        raise RuntimeError(
            f"{name} is on {x.device}: the Triton kernels run on CUDA tensors, or on CPU tensors only with "
            "TRITON_INTERPRET=1 set before mp_grpo is imported"
        )


def raise_on_kernel_errors(errors: torch.Tensor, *, v_global: int, ignore_index: int, shard_sizes: torch.Tensor) -> None:
    """The merge kernel's error counters, through :func:`record_errors`: raised at once on the CPU, at the next
    :func:`check_errors` on a GPU (no host read here)."""
    def shards(n: int) -> str:
        sizes = [int(v) for v in shard_sizes.tolist()]
        return (f"logits: the vocabulary shards differ in size across the tensor-parallel group (V_local per rank: "
                f"{sizes}); every rank must hold an equal, contiguous shard (Megatron's layout)")

    def targets(n: int) -> str:
        return f"target has {n} token id(s) outside [0, {v_global}) that are not ignore_index ({ignore_index})"

    record_errors("unequal vocabulary shards", errors[1], shards)
    record_errors("target id outside the vocabulary", errors[0], targets)


def check_hidden_weight_and_target(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> None:
    """``hidden`` ``[..., H]`` and ``weight`` ``[V_local, H]`` of one float dtype and device; ``target`` ``[...]``."""
    for name, x in (("hidden", hidden), ("weight", weight)):
        if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_DTYPES:
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"{name} must be a float32, bfloat16 or float16 tensor, got {got}")
    if hidden.dim() < 1 or hidden.shape[-1] == 0:
        raise ValueError(f"hidden must have a non-empty last (hidden-size) dimension, got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[0] == 0:
        raise ValueError(
            f"weight must be a 2-D [V_local, H] tensor (Megatron's output-layer layout) with V_local > 0, "
            f"got shape {tuple(weight.shape)}"
        )
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight shape {tuple(weight.shape)} is [V_local, H] with H = {weight.shape[1]}, but hidden's last "
            f"dimension is {hidden.shape[-1]} (hidden shape {tuple(hidden.shape)})"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"weight dtype {weight.dtype} must equal hidden dtype {hidden.dtype} (the output layer runs in one dtype)"
        )
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden is on {hidden.device}")
    check_target(target, expected_shape=hidden.shape[:-1], device=hidden.device, expected_from="hidden.shape[:-1]")


def check_chunk_size(value: int | None, name: str) -> int | None:
    """``None`` (automatic) or a positive Python int."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be None or a positive int, got {value!r}")
    return value


def check_main_grad(weight: torch.Tensor) -> torch.Tensor:
    """Megatron's ``weight.main_grad`` gradient buffer, checked: same shape as ``weight``, fp32 or weight's dtype."""
    main_grad = getattr(weight, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor):
        raise ValueError(
            "accumulate_into_main_grad=True needs weight.main_grad (the gradient buffer Megatron's "
            "DistributedDataParallel attaches to every parameter); weight has none"
        )
    if main_grad.shape != weight.shape or main_grad.device != weight.device:
        raise ValueError(
            f"weight.main_grad must match weight's shape {tuple(weight.shape)} and device {weight.device}, got "
            f"{tuple(main_grad.shape)} on {main_grad.device}"
        )
    if main_grad.dtype not in (torch.float32, weight.dtype):
        raise TypeError(f"weight.main_grad must be float32 or weight's dtype {weight.dtype}, got {main_grad.dtype}")
    if not main_grad.is_contiguous():
        raise ValueError("weight.main_grad must be contiguous (its row blocks are written in place)")
    return main_grad
