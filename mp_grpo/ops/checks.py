"""Argument checks shared by the log-prob ops, and the deferred error ledger. Each error names the argument at fault.

**Checks that never synchronize** (:func:`record_errors`, :func:`check_errors`). Some input errors can only
be seen on the device — a target id outside the vocabulary, vocabulary shards of unequal size across the
TP group (counted by the log-prob merge kernel), a loss mask whose content differs from the one the step's
GlobalBatch counted. Reading such a count on the host costs a synchronization per call. Instead
(:class:`CheckInputs`, the ops' ``check_inputs``):

* ``DEFERRED`` (the default): on the CPU the count is read at once (a CPU read is free) and the error
  raised immediately; on a GPU the count is added, in place and asynchronously, into one slot of a
  per-device int64 counter vector (one slot per kind of error, allocated once; the log-prob merge kernel
  adds into its slots itself, :func:`kernel_counters`, so its check launches nothing) — no host read,
  nothing allocated, so a call can be captured into a CUDA graph and every replay adds its own count; the
  outputs concerned are NaN meanwhile, so nothing is silently wrong — and :func:`check_errors` reads
  every counter vector (one host read per device), zeroes it and raises the first error, naming the
  argument. ``mp_grpo.reduce_metrics`` and ``GlobalBatch.skip_step`` call it (sync points a step already
  has); call ``mp_grpo.check_errors()`` yourself anywhere else, e.g. after a forward-only pass or after
  replaying a graph.
* ``SYNC``: read the count at the call (one host read) and raise there, on a GPU too (debugging).
* ``OFF``: nothing recorded; the outputs concerned are still NaN.

A device's counter vector is allocated by its first eager record: capture a graph after one eager
(warm-up) call, as ``torch.cuda.graphs`` asks anyway. :func:`deferred_checks` makes the CPU defer too
(tests of the mechanism).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator

import torch


class CheckInputs(enum.Enum):
    """How the ops check what only the device can see (``check_inputs=``; see the module docstring).
    ``True`` means ``DEFERRED``, ``False`` means ``OFF``."""

    DEFERRED = "deferred"
    """Count on the device, raise at the next :func:`check_errors` (at once on the CPU). No host read."""
    SYNC = "sync"
    """Read the count at the call and raise there (one host read per call, on a GPU too)."""
    OFF = "off"
    """Record nothing (bad rows are NaN all the same)."""


def check_inputs_mode(value: CheckInputs | bool) -> CheckInputs:
    """``check_inputs`` as a :class:`CheckInputs` (``True``: DEFERRED, ``False``: OFF)."""
    if isinstance(value, CheckInputs):
        return value
    if isinstance(value, bool):
        return CheckInputs.DEFERRED if value else CheckInputs.OFF
    allowed = ", ".join(f"CheckInputs.{m.name}" for m in CheckInputs)
    raise TypeError(f"check_inputs must be a bool or one of {allowed}, got {value!r}")


LEDGER_SLOTS = 32
"""Kinds of deferred error one counter vector holds (the package records a handful)."""

_slots: dict[str, int] = {}
_counters: dict[torch.device, torch.Tensor] = {}
_slot_views: dict[tuple[tuple[str, ...], torch.device], torch.Tensor] = {}
_discard: dict[torch.device, torch.Tensor] = {}
_messages: dict[tuple[str, torch.device], tuple[Callable[[int], str], type[Exception]]] = {}
_index_messages: dict[tuple[str, torch.device], Callable[[int, int], str]] = {}
_index_slots: dict[str, int] = {}
"""Kinds recorded with :func:`record_flagged`: the slot that holds 1 + the first flagged index (0: none yet)."""
INDEX_SLOT_SUFFIX = " (first index)"
_defer_on_cpu = False


def _counter_vector(device: torch.device) -> torch.Tensor:
    counter = _counters.get(device)
    if counter is None:
        _no_allocation_under_capture(device)
        counter = _counters[device] = torch.zeros(LEDGER_SLOTS, dtype=torch.int64, device=device)
    return counter


def _no_allocation_under_capture(device: torch.device) -> None:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "mp_grpo's input checks allocate their error counters on the first eager call: run the op once "
            "before capturing a CUDA graph (the usual warm-up)"
        )


def _reserve_slots(kinds: tuple[str, ...]) -> int:
    """The first of ``len(kinds)`` adjacent slots for ``kinds`` (reserved together on first use)."""
    first = _slots.get(kinds[0])
    if first is not None:
        if any(_slots.get(kind) != first + i for i, kind in enumerate(kinds)):
            raise RuntimeError(f"the deferred error kinds {kinds} were reserved apart: record them as one group")
        return first
    if any(kind in _slots for kind in kinds):
        raise RuntimeError(f"the deferred error kinds {kinds} were reserved apart: record them as one group")
    if len(_slots) + len(kinds) > LEDGER_SLOTS:
        raise RuntimeError(f"more than {LEDGER_SLOTS} kinds of deferred error: raise LEDGER_SLOTS")
    first = len(_slots)
    for i, kind in enumerate(kinds):
        _slots[kind] = first + i
    return first


def defers(mode: CheckInputs, device: torch.device) -> bool:
    """Whether an error of ``mode`` found on ``device`` waits for :func:`check_errors` (DEFERRED, not on
    the CPU unless :func:`deferred_checks`)."""
    return mode is CheckInputs.DEFERRED and (device.type != "cpu" or _defer_on_cpu)


def kernel_counters(
    kinds: tuple[tuple[str, Callable[[int], str]], ...],
    device: torch.device,
    mode: CheckInputs,
) -> tuple[torch.Tensor, bool]:
    """int64 counters, one per ``(kind, message)``, for a kernel to add its error counts into, and whether
    they are the ledger's own (deferred: nothing left for the host to do — no launch, no read) or not
    (fresh zeros to pass to :func:`record_errors` after the kernel: on the CPU, with SYNC). With OFF, a
    scratch vector nobody reads. Allocates nothing after the first eager call for a device."""
    if mode is CheckInputs.OFF:
        scratch = _discard.get(device)
        if scratch is None or scratch.numel() < len(kinds):
            _no_allocation_under_capture(device)
            scratch = _discard[device] = torch.zeros(LEDGER_SLOTS, dtype=torch.int64, device=device)
        return scratch[: len(kinds)], False
    if not defers(mode, device):
        return torch.zeros(len(kinds), dtype=torch.int64, device=device), False
    names = tuple(kind for kind, _ in kinds)
    view = _slot_views.get((names, device))
    if view is None:
        first = _reserve_slots(names)
        view = _slot_views[(names, device)] = _counter_vector(device)[first: first + len(names)]
    for kind, message in kinds:
        _messages[(kind, device)] = (message, ValueError)  # the latest call's message describes the error
    return view, True


def record_errors(
    kind: str,
    count: torch.Tensor,
    message: Callable[[int], str],
    error: type[Exception] = ValueError,
    mode: CheckInputs = CheckInputs.DEFERRED,
) -> None:
    """Raise ``error(message(n))`` if the 0-dim integer ``count`` n is nonzero — at once on the CPU or with
    ``mode=SYNC``, at the next :func:`check_errors` otherwise (``count`` is then added into the device's
    counter vector without a host read); nothing with ``mode=OFF``."""
    if mode is CheckInputs.OFF:
        return
    device = count.device
    if mode is CheckInputs.SYNC or (device.type == "cpu" and not _defer_on_cpu):
        n = int(count)
        if n:
            raise error(message(n))
        return
    slot = _reserve_slots((kind,))
    _counter_vector(device)[slot].add_(count.detach().reshape(()))
    _messages[(kind, device)] = (message, error)  # the latest call's message (its shapes) describes the error


def record_flagged(
    kind: str,
    flags: torch.Tensor,
    message: Callable[[int, int], str],
    mode: CheckInputs = CheckInputs.DEFERRED,
) -> None:
    """:func:`record_errors` of the count of the bool ``flags`` (one per token, say), with the index of the first one:
    ``ValueError(message(count, first_index))`` — at once on the CPU or with SYNC; otherwise the count and
    1 + the first index are kept on the device (a second slot, set by the first call that flags any since the last
    :func:`check_errors`; no host read) and :func:`check_errors` raises with the index of that call's token."""
    if mode is CheckInputs.OFF or flags.numel() == 0:
        return
    device = flags.device
    count = flags.sum()
    first = flags.to(torch.int32).argmax()
    if mode is CheckInputs.SYNC or (device.type == "cpu" and not _defer_on_cpu):
        n = int(count)
        if n:
            raise ValueError(message(n, int(first)))
        return
    slot = _reserve_slots((kind, kind + INDEX_SLOT_SUFFIX))
    _index_slots[kind] = slot + 1
    counter = _counter_vector(device)
    counter[slot].add_(count)
    index = counter[slot + 1]
    index.copy_(torch.where((index == 0) & (count > 0), first.to(torch.int64) + 1, index))
    _index_messages[(kind, device)] = message


def check_errors() -> None:
    """Raise the first error recorded by :func:`record_errors` (or :func:`record_flagged`) since the last check (one
    host read per device that ever recorded one; the counters are zeroed when read nonzero)."""
    names = {slot: kind for kind, slot in _slots.items()}
    index_slots = set(_index_slots.values())
    for device, counter in _counters.items():
        counts = counter.tolist()
        if not any(counts):
            continue
        counter.zero_()
        for slot, n in enumerate(counts):
            if n and slot not in index_slots:
                kind = names[slot]
                if kind in _index_slots:
                    text, error = _index_messages[(kind, device)](n, counts[_index_slots[kind]] - 1), ValueError
                else:
                    message, error = _messages[(kind, device)]
                    text = message(n)
                raise error(f"{text} [recorded on the device since the last mp_grpo.check_errors(): {kind}]")


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
    check_logits(logits, logits_name=logits_name)
    check_target(target, expected_shape=logits.shape[:-1], device=logits.device, expected_from=f"{logits_name}.shape[:-1]")


def check_logits(logits: torch.Tensor, *, logits_name: str = "logits") -> None:
    """A ``[..., V_local]`` logits shard: a float32 / bfloat16 / float16 tensor with a non-empty last dimension (for
    a caller that checks its targets' shape against it in its own terms, as ``MegatronGRPO.loss_func``)."""
    if not isinstance(logits, torch.Tensor) or logits.dtype not in _FLOAT_DTYPES:
        got = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise TypeError(f"{logits_name} must be a float32, bfloat16 or float16 tensor, got {got}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"{logits_name} must have a non-empty last (vocabulary) dimension, got shape {tuple(logits.shape)}")


def check_target(target: torch.Tensor, *, expected_shape: torch.Size, device: torch.device, expected_from: str) -> None:
    """``target``: int64 / int32 token ids of ``expected_shape`` on ``device``."""
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
    from mp_grpo.kernels.launch_config import INTERPRETER

    if x.device.type != "cuda" and not INTERPRETER:
        raise RuntimeError(
            f"{name} is on {x.device}: the Triton kernels run on CUDA tensors, or on CPU tensors only with "
            "TRITON_INTERPRET=1 set before mp_grpo is imported"
        )


def merge_error_kinds(
    *, v_global: int, ignore_index: int, gathered_stats: torch.Tensor
) -> tuple[tuple[str, Callable[[int], str]], ...]:
    """The merge kernel's three error counters, in its order: (kind, message) of unequal shards (the cause of
    every NaN, so raised first), of the targets outside the vocabulary (``gathered_stats`` ``[TP, N + 1, 4]``:
    row N holds each rank's V_local, read only when the error is raised) and of the rows with non-finite logits
    (``mp_grpo/kernels/logprob_merge.py``)."""
    def targets(n: int) -> str:
        return f"target has {n} token id(s) outside [0, {v_global}) that are not ignore_index ({ignore_index})"

    def shards(n: int) -> str:
        sizes = [int(v) for v in gathered_stats[:, -1, 0].tolist()]
        return (f"logits: the vocabulary shards differ in size across the tensor-parallel group (V_local per rank: "
                f"{sizes}); every rank must hold an equal, contiguous shard (Megatron's layout)")

    def nonfinite(n: int) -> str:
        return (f"logits: {n} row(s) whose target is not ignore_index hold a NaN or +inf logit (or are -inf "
                "throughout): their log-prob and entropy are NaN and they get no gradient (-inf logits elsewhere "
                "are probability 0 and allowed)")

    return (("unequal vocabulary shards", shards), ("target id outside the vocabulary", targets),
            ("non-finite logits", nonfinite))


NONFINITE_INPUTS = ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs", "advantages", "entropy")
"""GRPOLoss's token inputs whose NaN / ±inf values at trained positions are counted (in this order: the fused
kernels' ``SUM_NONFINITE_*`` columns)."""


def nonfinite_input_kinds() -> tuple[tuple[str, Callable[[int], str]], ...]:
    """(kind, message) of each of :data:`NONFINITE_INPUTS`: trained positions of the loss where that input is NaN
    or ±inf (GRPOLoss dropped them; both of its paths record them)."""
    def message(name: str) -> Callable[[int], str]:
        if name == "logprobs":
            why = ("the policy's log-prob (from its logits: a NaN or +inf logit, or a target of probability 0 — "
                   "a -inf logit)")
            fix = "look for a NaN / inf in the model's output"
        else:
            why = "a NaN or ±inf value"
            fix = ("fix the input, or set nonfinite.skip_step to skip such steps on every rank (GlobalBatch."
                   "from_rollouts must be given the input)")
        return lambda n: (f"{name}: {n} trained position(s) hold {why}; GRPOLoss dropped them from the loss (no "
                          f"value, no gradient). {fix[0].upper()}{fix[1:]}")

    return tuple((f"non-finite {name}", message(name)) for name in NONFINITE_INPUTS)


def raise_on_kernel_errors(
    errors: torch.Tensor, kinds: tuple[tuple[str, Callable[[int], str]], ...], mode: CheckInputs
) -> None:
    """Counters a kernel filled that are not the ledger's own (:func:`kernel_counters`), in ``kinds``' order:
    raised at once on the CPU and with SYNC."""
    for i, (kind, message) in enumerate(kinds):
        record_errors(kind, errors[i], message, mode=mode)


def check_hidden_weight_and_target(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> None:
    """``hidden`` ``[..., H]`` and ``weight`` ``[V_local, H]`` of one float dtype and device; ``target`` ``[...]``."""
    check_hidden_and_weight(hidden, weight)
    check_target(target, expected_shape=hidden.shape[:-1], device=hidden.device, expected_from="hidden.shape[:-1]")


def check_hidden_and_weight(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    """``hidden`` ``[..., H]`` and ``weight`` ``[V_local, H]`` of one float dtype and device (for a caller that
    checks its targets' shape against ``hidden`` in its own terms, as ``MegatronGRPO.loss_func``)."""
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
