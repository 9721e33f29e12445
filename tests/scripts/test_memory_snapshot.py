"""scripts/memory_snapshot.py on hand-written allocation traces (no GPU): the replay to the peak, the sites, the
comparison of two passes, the synthetic snapshot of the dry run."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

from tests.distributed import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))

import memory_snapshot as ms  # noqa: E402

MiB = 2**20


def _frames(*where: str) -> list[dict]:
    return [{"filename": f, "line": i + 1, "name": f"fn{i}"} for i, f in enumerate(where)]


def _trace(*entries: tuple) -> dict:
    out = []
    for action, addr, size, *frames in entries:
        out.append({"action": action, "addr": addr, "size": size, "frames": _frames(*frames), "stream": 0})
    return {"segments": [], "device_traces": [[], out]}  # the pass ran on device 1: the longer trace is read


def test_peak_is_the_highest_running_total_and_its_live_blocks() -> None:
    snap = _trace(
        ("alloc", 1, 100 * MiB, "/site-packages/torch/nn/modules/module.py", "/repo/mp_grpo/ops/a.py"),
        ("alloc", 2, 50 * MiB, "/repo/megatron/core/b.py"),
        ("free_requested", 9, 30 * MiB),  # a block allocated before the recording: lowers the total
        ("free_requested", 1, 100 * MiB),
        ("free_completed", 1, 100 * MiB),  # not counted again
        ("alloc", 3, 120 * MiB),  # no Python frame
        ("free_requested", 3, 120 * MiB),
        ("alloc", 4, 10 * MiB, "/repo/x.py"),
    )
    peak = ms.at_peak(snap)
    # running totals 100, 150, 120, 20, 140, 20, 30: the peak is 150 with blocks 1 and 2 live
    assert peak.bytes == 150 * MiB and peak.freed_before_peak == 0 and peak.entries == 8 and not peak.out_of_memory
    assert sorted(size for size, _ in peak.live) == [50 * MiB, 100 * MiB]
    assert ms.by_site(peak) == {"mp_grpo/ops/a.py:2 in fn1": 100 * MiB, "megatron/core/b.py:1 in fn0": 50 * MiB}
    later = _trace(("alloc", 1, 10 * MiB, "/a.py"), ("free_requested", 7, 40 * MiB), ("alloc", 2, 35 * MiB, "/b.py"),
                   ("oom", 0, 2**30))
    peak = ms.at_peak(later)  # totals 10, -30, 5: the peak is the first block; the old block freed after it
    assert peak.bytes == 10 * MiB and peak.freed_before_peak == 0 and peak.out_of_memory
    third = _trace(("free_requested", 7, 40 * MiB), ("alloc", 1, 60 * MiB, "/a.py"))
    assert ms.at_peak(third).bytes == 20 * MiB and ms.at_peak(third).freed_before_peak == 40 * MiB


def test_site_skips_torch_and_the_standard_library() -> None:
    frames = _frames("/usr/lib/python3.12/contextlib.py", "/x/site-packages/torch/autograd/function.py",
                     "/work/repo/mp_grpo/megatron/fused_output.py", "/work/repo/scripts/step_paths.py")
    assert ms.site(frames) == "mp_grpo/megatron/fused_output.py:3 in fn2"
    assert ms.site([]) == ms.NO_FRAME


def test_compare_names_what_the_first_holds_that_the_second_does_not(tmp_path: Path) -> None:
    floor = ms.at_peak(ms.synthetic([("/r/decoder.py:10 in layer", 900 * MiB, True), ("/r/tiny.py:1 in t", 100, True)]))
    fused = ms.at_peak(ms.synthetic([("/r/decoder.py:10 in layer", 900 * MiB, True),
                                     ("/r/fused_output.py:42 in chunk", 300 * MiB, True),
                                     ("/r/tiny.py:1 in t", 200, True)]))
    lines = ms.compare("fused", fused, "floor", floor)
    assert lines[0].startswith("- `fused` peaks 1.172 GiB above the memory allocated before the pass, `floor` 0.879 GiB: "
                               "+0.293 GiB")
    assert lines[1] == "  - +0.293 GiB (0.293 vs 0.000) `/r/fused_output.py:42 in chunk`"
    assert lines[2].startswith("  - +0.0000 GiB in sites that differ by less than 1 MiB")  # the 100-byte difference
    assert len(lines) == 3  # the decoder's equal share is no line
    path = tmp_path / "s.pickle"
    ms.save(ms.synthetic([("/a.py:1 in f", 5, False)]), path)
    assert pickle.loads(path.read_bytes())["device_traces"][0][0]["size"] == 5
