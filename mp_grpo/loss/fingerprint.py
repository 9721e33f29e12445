"""What every rank of a GlobalBatch's group must hold alike, fingerprinted into the step's one all-reduce.

Ranks that disagree — another LossConfig (say another ``aggregation.mode``: it normalizes differently),
another step's batch, another trainer setting (Megatron's ``calculate_per_token_loss`` scales every gradient)
— each compute a consistent-looking step, and together a wrong one. :class:`~mp_grpo.GlobalBatch` carries a
fingerprint of these items in the float64 all-reduce it makes anyway (no collective of its own) and every rank
checks it there; a disagreement is raised as :class:`RankDisagreementError` naming the items that differ (at once
on the CPU, at the next ``mp_grpo.check_errors()`` on a GPU — no host read), and the batch's counts are NaN
meanwhile, so that the step cannot quietly normalize by them.

The items (:func:`fingerprint_items`): how the batch was built (with a LossConfig, from masks only, or from
counts), every leaf of the LossConfig by its dotted key (``aggregation.mode``; "absent" without a config), the
step id, and the caller's ``same_on_all_ranks`` mapping (one item); for ``GlobalBatch.from_counts`` also every
count and statistic it takes (NaN where not given), by its bit pattern (cut into chunks on the device: no host
read). Their number depends only on the code, never on the values, so every rank's all-reduce has the same
length.

Encoding. Each item's canonical text (:func:`canonical`: deterministic across processes, which ``hash()`` is not;
``1`` and ``1.0`` alike) is digested (BLAKE2b, 64 bits) into :data:`CHUNKS` chunks c of :data:`CHUNK_BITS` bits.
The all-reduce sums c and c² over the n ranks; both sums are exact integers in float64 (n · (2¹⁶)² < 2⁵³ for
n < 2²¹ ranks). A rank's chunk agrees with the group iff Σc = n·c and Σc² = n·c²: then Σ_r (c_r − c)² =
Σc² − 2cΣc + n·c² = 0, so every rank holds c. Every rank reads the same sums, so either every rank passes or —
when any two differ — none does: the verdict is the same on every rank (no rank steps while another raises).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Callable, Mapping

import torch

from mp_grpo.ops.checks import record_errors

CHUNK_BITS = 16
"""Bits of a digest per float64 lane: the group's sums of chunks and of their squares stay exact (see above)."""
CHUNKS = 4
"""Chunks per item: 64-bit digests (a disagreement goes unseen with probability 2⁻⁶⁴)."""
MAX_RANKS = 2 ** (53 - 2 * CHUNK_BITS)
"""Largest group whose sums of squared chunks stay exact in float64: n · (2¹⁶ − 1)² < 2⁵³."""


class RankDisagreementError(ValueError):
    """The ranks of a GlobalBatch's group were built for different configs, steps or trainer settings."""


def canonical(value: object, name: str = "value") -> str:
    """A text of ``value`` that is the same in every process for equal values (numbers as floats, enums by
    value, dataclasses field by field); raises TypeError naming ``name`` for types without one."""
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    if isinstance(value, enum.Enum):
        return canonical(value.value, name)
    if isinstance(value, (int, float)):
        return repr(float(value))
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(canonical(v, f"{name}[{i}]") for i, v in enumerate(value)) + ")"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value).__name__ + canonical(
            tuple((f.name, getattr(value, f.name)) for f in dataclasses.fields(value)), name)
    raise TypeError(f"{name}: {type(value).__name__} has no canonical form; use None, bool, int, float, str, an "
                    "enum, a dataclass of these, or a tuple / list of them")


def _leaves(cls: type, prefix: str = "") -> list[str]:
    """Dotted keys of every leaf field of the dataclass ``cls`` (sections recursed into)."""
    keys = []
    for f in dataclasses.fields(cls):
        factory = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if factory is not None and dataclasses.is_dataclass(factory):
            keys += _leaves(factory, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def _get(config: object, key: str) -> object:
    for part in key.split("."):
        config = getattr(config, part)
    return config


def fingerprint_items(
    config: object | None, config_type: type, step: int | None, same_on_all_ranks: Mapping[str, object] | None,
    built: str = "masks",
) -> list[tuple[str, str, str]]:
    """(name, canonical text, this rank's value for messages) of every item, in a fixed order: how the batch was
    built (``built``: "masks" or "counts", and whether with a config), each leaf of ``config_type`` (a dataclass;
    ``config`` one of its instances or None), the step id, and ``same_on_all_ranks`` as one item."""
    how = f"from {built}" + (" with a LossConfig" if config is not None else " without a LossConfig")
    items = [("how the GlobalBatch was built", how, how)]
    for key in _leaves(config_type):
        if config is None:
            items.append((f"loss config {key}", "absent", "absent"))
        else:
            value = _get(config, key)
            shown = value.value if isinstance(value, enum.Enum) else value
            items.append((f"loss config {key}", canonical(value, key), repr(shown)))
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    items.append(("step", canonical(step), repr(step)))
    extra = {} if same_on_all_ranks is None else same_on_all_ranks
    if not isinstance(extra, Mapping) or not all(isinstance(k, str) for k in extra):
        raise TypeError(f"same_on_all_ranks must be a mapping of str keys or None, got {same_on_all_ranks!r}")
    text = canonical(tuple((k, extra[k]) for k in sorted(extra)), "same_on_all_ranks")
    items.append(("same_on_all_ranks", text, repr(dict(sorted(extra.items())))))
    return items


def _chunks(text: str) -> list[int]:
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=CHUNK_BITS * CHUNKS // 8).digest(), "little")
    mask = (1 << CHUNK_BITS) - 1
    return [(digest >> (CHUNK_BITS * i)) & mask for i in range(CHUNKS)]


def _device_chunks(values: list[torch.Tensor]) -> torch.Tensor:
    """``[len(values) · CHUNKS]`` float64: each 0-dim float64 value's bit pattern cut into CHUNKS chunks (on the
    device: no host read)."""
    bits = torch.stack([v.reshape(()).to(torch.float64) for v in values]).view(torch.int64)
    shifts = torch.arange(CHUNKS, device=bits.device, dtype=torch.int64) * CHUNK_BITS
    return ((bits[:, None] >> shifts) & ((1 << CHUNK_BITS) - 1)).to(torch.float64).reshape(-1)


class Fingerprint:
    """The lanes one rank adds to its all-reduce, and the verdict read from the reduced lanes."""

    def __init__(self, items: list[tuple[str, str, str]], device: torch.device,
                 values: dict[str, torch.Tensor] | None = None) -> None:
        """``items`` from :func:`fingerprint_items`; ``values``: 0-dim tensors on ``device`` that every rank must
        hold bit for bit alike too (``GlobalBatch.from_counts``' counts), fingerprinted on the device."""
        values = values or {}
        self.names = [name for name, _, _ in items] + list(values)
        self.shown = [shown for _, _, shown in items] + list(values.values())
        host = torch.tensor([c for _, text, _ in items for c in _chunks(text)], dtype=torch.float64)
        chunks = host.to(device, non_blocking=True) if device.type != "cpu" else host
        if values:
            chunks = torch.cat([chunks, _device_chunks(list(values.values()))])
        self.lanes = torch.cat([chunks, chunks * chunks])
        """[2 · items · CHUNKS] float64: the chunks, then their squares."""

    def verdict(self, reduced: torch.Tensor, ranks: int) -> torch.Tensor:
        """0-dim bool: every rank holds every item alike. ``reduced`` is :attr:`lanes` summed over the group's
        ``ranks`` ranks. A disagreement is recorded in the deferred error ledger (raised at once on the CPU) as a
        :class:`RankDisagreementError` naming the items that differ, with this rank's values."""
        if ranks >= MAX_RANKS:
            raise ValueError(f"a group of {ranks} ranks is too large for the fingerprint's exact float64 sums "
                             f"(at most {MAX_RANKS - 1})")
        half = self.lanes.numel() // 2
        agree = (reduced[:half] == ranks * self.lanes[:half]) & (reduced[half:] == ranks * self.lanes[half:])
        differs = ~agree.view(len(self.names), CHUNKS).all(dim=1)
        any_differs = differs.any()
        record_errors("ranks disagree", any_differs.to(torch.int64), self._message(differs, ranks),
                      RankDisagreementError)
        return ~any_differs

    def _message(self, differs: torch.Tensor, ranks: int) -> Callable[[int], str]:
        def message(_: int) -> str:  # read when raised (a host read then is free)
            which = [i for i, d in enumerate(differs.tolist()) if d]
            shown = [v.item() if isinstance(v, torch.Tensor) else v for v in self.shown]
            listed = "; ".join(f"{self.names[i]} (this rank: {shown[i]})" for i in which[:8])
            more = f"; and {len(which) - 8} more" if len(which) > 8 else ""
            return (f"GlobalBatch: the {ranks} ranks of its group disagree on {listed}{more}. Every rank of the group "
                    "must build the step's GlobalBatch for the same LossConfig, step and trainer settings — a rank "
                    "that differs would normalize or scale its share differently (the batch's counts are NaN)")
        return message
