"""scripts/bench_tp_collective.py's bookkeeping on CPU, without ranks: the merge of every rank's timings into one row
(the slowest rank's median, the host clocks' spread), the ratio to the no-collective twin in the same mode (the
median per-round ratio for rows timed in the same interleaved rounds), the report with the predictions beside the
measurements, and the plot. (The whole script runs on CPU under gloo with
``--dry-run``: ``.coord``'s GPU step runs it that way first.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.distributed import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))

import bench_tp_collective as btc  # noqa: E402


def _rank_row(variant: str, mode: str, part: str, ms: float, start: float, twin: str | None) -> dict:
    return {"V": 151936, "N": 16384, "tp": 2, "variant": variant, "twin": twin, "mode": mode, "part": part,
            "ms": ms, "times": [ms, ms + 0.1, ms - 0.1], "starts": [start, start + 1.0, start + 2.0],
            "phases": {"forward": [0.5, 0.2], "backward": [ms, 0.3]} if part == "fwd_bwd" else {},
            "cuda_mallocs": 0, "alloc_retries": 0}


def test_merge_ranks_ratio_report_and_plot(tmp_path: Path) -> None:
    rows = []
    for variant, twin, ms in (("op local", None, 1.0), ("op tp", "op local", 1.1)):
        for mode in ("eager", "host_ahead"):
            for part in btc.PARTS:
                per_rank = [_rank_row(variant, mode, part, ms, 100.0, twin),
                            _rank_row(variant, mode, part, ms + 0.2, 100.00005, twin)]
                rows.append(btc.merge_ranks(per_rank))
    eager = next(r for r in rows if (r["variant"], r["mode"], r["part"]) == ("op tp", "eager", "fwd_bwd"))
    assert eager["ms"] == 1.3 and eager["ms_per_rank"] == [1.1, 1.3]  # the slowest rank's median
    assert abs(eager["start_spread_us"]["median"] - 50.0) < 1e-3  # 50 µs between the ranks' host clocks
    assert abs(btc.ratio(rows, eager) - 1.3 / 1.2) < 1e-12  # against the twin's slowest rank, same mode and part
    failed = btc.merge_ranks([{**_rank_row("op tp", "graph", "fwd", 1.0, 0.0, "op local")},
                              {"V": 151936, "variant": "op tp", "mode": "graph", "part": "fwd", "error": "boom"}])
    assert failed["error"] == "boom" and "ms" not in failed
    result = {"tp": 2, "tokens": 16384, "vocab": [151936], "iters": 3, "device": "NVIDIA H100 80GB HBM3",
              "torch": "x", "triton": "y", "command": "torchrun ...", "dry_run": False,
              "manual_gradient_bitwise_equal_to_op": {"151936": {"manual tp": True}}, "rows": rows + [failed]}
    btc.write_report(result, tmp_path)
    text = (tmp_path / "tp_collective_tp2.md").read_text()
    assert "| op tp | eager | 1.300 [1.100 / 1.300] | 1.083 |" in text
    assert "| 151936 | fwd_bwd | eager | 1.01 | 1.083 |" in text  # prediction beside the measurement
    assert "manual tp: yes" in text and "boom" in text
    assert json.loads((tmp_path / "tp_collective_tp2.json").read_text())["rows"][0]["variant"] == "op local"
    btc.plot(tmp_path)
    assert (tmp_path / "tp_collective.png").stat().st_size > 10_000


def test_excess_lines_and_report_from_json(tmp_path: Path, monkeypatch) -> None:
    """The report's "where the time goes": the graph replay's excess over the twin, and each rank's gather end after
    the last rank's statistics (a wait for a slower rank's statistics left out); ``--report`` rewrites the reports
    from the JSON alone."""
    def row(variant: str, mode: str, part: str, ms: float, phases=None) -> dict:
        return {"V": 151936, "variant": variant, "mode": mode, "part": part, "ms": ms, "ms_per_rank": [ms, ms],
                "phases_per_rank": phases or [{}, {}], "cuda_mallocs": 0, "alloc_retries": 0,
                "start_spread_us": {"median": 1.0, "max": 2.0},
                "twin": None if "local" in variant else variant.replace("tp", "local").split(",")[0]}

    manual = [{"statistics": [0.40, 0.1], "gather": [0.45, 0.2]}, {"statistics": [0.42, 0.1], "gather": [0.60, 0.2]}]
    copy = [{"statistics": [0.40, 0.1], "gather": [0.43, 0.2]}, {"statistics": [0.42, 0.1], "gather": [0.43, 0.2]}]
    rows = [row("op local", "graph", "fwd", 0.5), row("op tp", "graph", "fwd", 0.6),
            row("op local", "graph", "fwd_bwd", 1.5), row("op tp", "graph", "fwd_bwd", 1.6),
            row("manual tp", "host_ahead", "fwd_bwd", 1.6, manual),
            row("manual tp, no NCCL", "host_ahead", "fwd_bwd", 1.5, copy)]
    result = {"tp": 2, "tokens": 16384, "vocab": [151936], "iters": 3, "device": "NVIDIA H100 80GB HBM3",
              "torch": "x", "triton": "y", "command": "torchrun ...", "dry_run": False,
              "manual_gradient_bitwise_equal_to_op": {"151936": {"manual tp": True}}, "rows": rows}
    assert btc.gather_times(rows, 151936, "manual tp", "host_ahead") == [0.45 - 0.42, 0.60 - 0.42]
    (line,) = btc.excess_lines(result)
    assert "forward +0.100 ms (1.200×), forward+backward +0.100 ms (1.067×)" in line
    assert "NCCL's all-gather 0.030 / 0.180 ms; a local copy in its place 0.010 / 0.010 ms" in line
    source = tmp_path / "run" / "tp_collective_tp2.json"
    source.parent.mkdir()
    source.write_text(json.dumps(result))
    monkeypatch.setattr(sys, "argv", ["bench_tp_collective.py", "--report", str(source), "--out", str(tmp_path / "docs")])
    btc.main()
    text = (tmp_path / "docs" / "tp_collective_tp2.md").read_text()
    assert "## Where the time over the twin goes" in text and line in text
    assert (tmp_path / "docs" / "tp_collective.png").exists()


def test_interleaved_rows_are_compared_round_by_round() -> None:
    """Rows timed in the same interleaved rounds: the figure is the median over the rounds of the slowest ranks'
    per-round ratio — here 1.10, where the ratio of the two medians would say 1.0 — with its interval in the cell."""
    def per_rank(variant: str, twin, times: list[float]) -> dict:
        return {"V": 151936, "N": 16384, "tp": 2, "variant": variant, "twin": twin, "mode": "eager", "part": "fwd",
                "ms": sorted(times)[len(times) // 2], "times": times, "starts": [0.0] * len(times), "phases": {},
                "cuda_mallocs": 0, "alloc_retries": 0, "interleaved_with": ["op local", "op tp"]}

    local = [1.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0]  # the machine alternates between two speeds, round by round
    tp = [1.1 * t for t in local]
    rows = [btc.merge_ranks([per_rank("op local", None, local), per_rank("op local", None, [0.5 * t for t in local])]),
            btc.merge_ranks([per_rank("op tp", "op local", tp), per_rank("op tp", "op local", [0.5 * t for t in tp])])]
    assert rows[1]["round_max_ms"] == tp and rows[1]["interleaved_with"] == ["op local", "op tp"]
    interval = btc.ratio_interval(rows, rows[1])
    assert abs(btc.ratio(rows, rows[1]) - 1.1) < 1e-12 and interval.n == 7 and abs(interval.high - 1.1) < 1e-12
    rows[1]["ms"] = rows[0]["ms"]  # what separate medians could show on such a machine: the same figure
    assert abs(btc.ratio(rows, rows[1]) - 1.1) < 1e-12  # the rounds decide, not the medians
    assert btc._ratio_cell(rows, rows[1]) == "1.100 (1.100–1.100)"
    del rows[1]["interleaved_with"]  # a row timed before the rounds: the ratio of the medians
    assert btc.ratio(rows, rows[1]) == 1.0 and btc.ratio_interval(rows, rows[1]) is None
