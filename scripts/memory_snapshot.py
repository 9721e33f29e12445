"""What a pass holds at its peak: ``torch.cuda.memory`` snapshots taken around one call, and the difference between
two passes' peaks by allocation site (``bench_step.py --memory-snapshot DIR``).

- :func:`record`: one call of a function with the caching allocator's history on (Python stacks), the snapshot
  (``torch.cuda.memory._snapshot()``: ``segments`` and ``device_traces``) taken after it — GPU only.
- :func:`at_peak`: the allocation trace of one snapshot replayed: the moment the allocated bytes (relative to the
  start of the recording) were largest, and every block live then with the frame that allocated it. A block counts
  from its ``alloc`` to its ``free_requested`` (what ``torch.cuda.max_memory_allocated`` counts); a block allocated
  before the recording and freed during it lowers the running total (its bytes are listed apart).
- :func:`by_site`: those blocks' bytes by allocation site — the innermost Python frame outside torch and the
  standard library (``file:line in function``), or ``(no Python frame)`` for what C++ code allocated (autograd's
  backward GEMMs among them).
- :func:`compare`: two passes' peaks side by side, the sites where the first holds more than the second first —
  "what the fused path holds at its peak that the floor does not" — as markdown lines.
- :func:`synthetic`: a snapshot written from a list of (site, bytes, freed-or-not) allocations, for
  ``bench_step.py --dry-run`` and the tests (no GPU): never a measurement.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

GiB = 2**30
MAX_ENTRIES = 2_000_000
"""Trace entries kept while recording: one training pass of a 28-layer model allocates ~10⁴–10⁵ blocks; the trace is
a ring buffer, so a limit that is too small silently drops the pass's first allocations."""
MIN_SITE_BYTES = 2**20
"""Sites whose difference between the two passes is below 1 MiB are summed into one line (allocator rounding,
small buffers)."""
SKIPPED_FRAMES = ("/torch/", "<frozen ", "/contextlib.py", "/functools.py", "/threading.py")
"""Frames that never name a site: torch's own Python code (autograd, modules' ``__call__``) and the standard library."""
NO_FRAME = "(no Python frame: allocated in C++, e.g. autograd's backward GEMMs)"


def record(fn: Callable[[], object], device: int | None = None) -> dict:
    """``torch.cuda.memory._snapshot()`` after one call of ``fn`` with the allocator's history recorded (Python
    stacks); the recording is turned off afterwards, whatever ``fn`` raised."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python", device=device)
    try:
        fn()
        torch.cuda.synchronize()
        return torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)


def save(snapshot: dict, path: Path) -> None:
    """The snapshot as ``torch.cuda.memory._dump_snapshot`` writes it (a pickle that https://pytorch.org/memory_viz reads)."""
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)


@dataclass
class Peak:
    """One pass's peak (see :func:`at_peak`)."""

    bytes: int
    """Allocated bytes at the peak, relative to the start of the recording."""
    live: list[tuple[int, list[dict]]] = field(default_factory=list)
    """(size, frames) of every block allocated during the recording and live at the peak."""
    freed_before_peak: int = 0
    """Bytes of blocks allocated before the recording and freed before the peak (they lower ``bytes``)."""
    entries: int = 0
    """Trace entries replayed."""
    out_of_memory: bool = False
    """The trace holds an ``oom`` entry: the pass ran out of memory (its peak is where it stopped)."""


def _trace(snapshot: dict) -> list[dict]:
    traces = snapshot.get("device_traces") or []
    longest = max(traces, key=len, default=[])  # the device the pass ran on
    return list(longest)


def at_peak(snapshot: dict) -> Peak:
    """Replays the snapshot's allocation trace (the device with the most entries) up to its highest point: a first
    pass finds the entry where the running total is largest, a second one rebuilds the live blocks there."""
    trace = _trace(snapshot)
    current = best = 0
    best_index = -1
    for i, entry in enumerate(trace):
        action = entry.get("action")
        if action == "alloc":
            current += int(entry["size"])
            if current > best:
                best, best_index = current, i
        elif action == "free_requested":
            current -= int(entry["size"])
    live: dict[int, tuple[int, list[dict]]] = {}
    freed_old = 0
    for entry in trace[:best_index + 1]:
        action = entry.get("action")
        if action == "alloc":
            live[entry["addr"]] = (int(entry["size"]), entry.get("frames") or [])
        elif action == "free_requested" and live.pop(entry["addr"], None) is None:
            freed_old += int(entry["size"])
    return Peak(bytes=best, live=list(live.values()), freed_before_peak=freed_old, entries=len(trace),
                out_of_memory=any(entry.get("action") == "oom" for entry in trace))


def site(frames: list[dict]) -> str:
    """The innermost frame outside torch and the standard library, as ``file:line in function``."""
    for frame in frames:
        filename = str(frame.get("filename", ""))
        if not filename or any(skip in filename for skip in SKIPPED_FRAMES):
            continue
        short = "/".join(filename.split("/")[-3:])
        return f"{short}:{frame.get('line')} in {frame.get('name')}"
    return NO_FRAME


def by_site(peak: Peak) -> dict[str, int]:
    """Bytes live at the peak by allocation site (:func:`site`)."""
    out: dict[str, int] = {}
    for size, frames in peak.live:
        key = site(frames)
        out[key] = out.get(key, 0) + size
    return out


def compare(name: str, peak: Peak, base_name: str, base: Peak) -> list[str]:
    """Markdown lines: both peaks, then every site where ``name`` holds at least ``MIN_SITE_BYTES`` more (or less)
    than ``base_name`` at their peaks, the largest difference first; the small ones summed."""
    mine, theirs = by_site(peak), by_site(base)
    diffs = {s: mine.get(s, 0) - theirs.get(s, 0) for s in set(mine) | set(theirs)}
    big = sorted((s for s in diffs if abs(diffs[s]) >= MIN_SITE_BYTES), key=lambda s: -diffs[s])
    small = sum(d for s, d in diffs.items() if abs(d) < MIN_SITE_BYTES)
    lines = [f"- `{name}` peaks {peak.bytes / GiB:.3f} GiB above the memory allocated before the pass, `{base_name}` "
             f"{base.bytes / GiB:.3f} GiB: {(peak.bytes - base.bytes) / GiB:+.3f} GiB"
             + ("; **the pass ran out of memory**" if peak.out_of_memory else "")
             + (f" (blocks allocated before the pass and freed before its peak: {peak.freed_before_peak / GiB:.3f} / "
                f"{base.freed_before_peak / GiB:.3f} GiB)" if peak.freed_before_peak or base.freed_before_peak else "")
             + ". Held at the peak, by allocation site:"]
    lines += [f"  - {diffs[s] / GiB:+.3f} GiB ({mine.get(s, 0) / GiB:.3f} vs {theirs.get(s, 0) / GiB:.3f}) `{s}`"
              for s in big]
    if small:
        lines.append(f"  - {small / GiB:+.4f} GiB in sites that differ by less than {MIN_SITE_BYTES // 2**20} MiB each")
    return lines


def synthetic(blocks: list[tuple[str, int, bool]]) -> dict:
    """A snapshot whose trace allocates each (site, bytes, freed) block in order and frees the ``freed`` ones at the end
    (after the peak): a stand-in with the structure of ``torch.cuda.memory._snapshot()`` — never a measurement."""
    trace = []
    for addr, (where, size, _) in enumerate(blocks, start=1):
        filename, _, rest = where.partition(":")
        line, _, name = rest.partition(" in ")
        frames = [{"filename": filename, "line": int(line or 0), "name": name or "?"}] if filename else []
        trace.append({"action": "alloc", "addr": addr * 2**40, "size": int(size), "frames": frames, "stream": 0})
    for addr, (_, size, freed) in enumerate(blocks, start=1):
        if freed:
            trace.append({"action": "free_requested", "addr": addr * 2**40, "size": int(size), "frames": [], "stream": 0})
    return {"segments": [], "device_traces": [trace]}
