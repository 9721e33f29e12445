"""scripts/bench_step.py end to end at a tiny size on one GPU (skipped without CUDA).

    python -m pytest tests/gpu/test_bench_step.py -v -s

The tiny shape (``step_model.SHAPES["tiny"]``: H 64, 2 layers, V 1024) at 128- and 512-token rows, both recompute
modes (the forward-only rows with selective recompute only), every path (``logits_model_layer`` included), the whole GRPO step at 128 tokens, the max-micro-batch search
capped at 32768 tokens; then the same command again, which must find every row measured and add none (resume).
The script's own check runs first: the loss paths' gradients on GPTModel agree within bf16 tolerance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
PATHS = ["floor", "common", "logits", "fused", "logits_model_layer"]


def _bench(out: Path) -> str:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "bench_step.py"), "--shape", "tiny", "--seq", "128", "512",
           "--paths", *PATHS, "--step-configs", "tiny@128", "--iters", "2", "--max-tokens", "32768", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=REPO_ROOT)
    assert proc.returncode == 0, f"--- stdout ---\n{proc.stdout[-8000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
    return proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_step_tiny_end_to_end(tmp_path: Path) -> None:
    print(_bench(tmp_path))
    data = json.loads((tmp_path / "step.json").read_text())
    assert data["meta"]["check_worst_relative_l2"] <= 1.6e-2
    rows = {(r["seq"], r["recompute"], r["kind"], r["path"]): r for r in data["rows"]}
    for seq in (128, 512):
        for recompute in ("selective", "full"):
            for kind in ("train", "forward"):
                for path in PATHS:
                    if kind == "forward" and recompute == "full":  # no-grad passes: measured once
                        assert (seq, recompute, kind, path) not in rows
                        continue
                    r = rows[(seq, recompute, kind, path)]
                    assert r["ms"] > 0 and r["peak_GiB"] > 0, r
                    assert r["max_tokens"] >= r["tokens"], r  # the timed micro-batch fits
                    assert r["probes"][0] == [r["B"], True]
            for path in PATHS:
                assert ((seq, recompute, "step", path) in rows) == (seq == 128)
    floor = rows[(128, "selective", "train", "floor")]
    assert floor["ms"] == pytest.approx(floor["decoder_ms"] + floor["matmul_ms"])
    assert (tmp_path / "step.md").exists() and (tmp_path / "step.png").stat().st_size > 10_000
    # Resume: nothing left to measure.
    again = _bench(tmp_path)
    assert "===" not in again, again[-3000:]
    assert json.loads((tmp_path / "step.json").read_text())["rows"] == data["rows"]
