"""The captured-support and top-K rows of ``scripts/bench_fused.py`` on the CPU: the rows' code through the script's
``--dry-run`` (Triton's interpreter, tiny sizes, one untimed call each), and their target lines written from made-up
results (met, not met, not measured)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.distributed import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))

import fused_report  # noqa: E402


def test_dry_run_of_the_replay_rows(tmp_path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "scripts/bench_fused.py", "--dry-run", "--only", "loss_support@128",
                           "loss_top_k@128", "--out", str(tmp_path)], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "fused.json").read_text())
    rows = {r["key"]: r for r in result["rows"]}
    assert set(rows) == {"loss_support", "loss_top_k"}
    for row in rows.values():  # the dry run's small supports (the GPU run's: 512 ids a token, K = 20)
        assert row["V"] == 128 and "fwd_bwd_ms" in row and "extra_peak_GiB" in row, row
    assert rows["loss_support"]["case"] == f"{fused_report.WITH_LOSS}, captured support of 8 ids a token"
    assert rows["loss_top_k"]["case"] == f"{fused_report.WITH_LOSS}, the trainer's log-probs at K = 4 top-K ids"


def test_replay_target_lines() -> None:
    def row(key, ms, **extra):
        return {"key": key, "V": 151936, "case": key, "fwd_bwd_ms": ms, "extra_peak_GiB": 0.7, **extra}

    result = {"rows": [row("loss", 100.0), row("loss_support", 109.0), row("loss_top_k", 120.0),
                       {"key": "bare", "V": 18992, "case": "bare", "error": "x"},
                       {"key": "loss_support", "V": 18992, "case": "loss_support", "error": "boom"}]}
    lines = "\n".join(fused_report._targets(result))
    assert "loss_support: fwd+bwd 109.00 ms = 1.090x the op without it (100.00 ms); target ≤ 1.10x: met" in lines
    assert "loss_top_k: fwd+bwd 120.00 ms = 1.200x the op without it (100.00 ms); target ≤ 1.15x: NOT MET" in lines
    assert f"V = 18992: {fused_report.WITH_LOSS} {fused_report.NOT_MEASURED}" in lines
