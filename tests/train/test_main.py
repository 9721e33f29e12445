"""The main job, scripts/grpo_step.py, end to end on CPU (2 gloo ranks, tiny sizes)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run_job(tmp_path: Path, *overrides: str) -> tuple[str, dict]:
    log = tmp_path / "log.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO_ROOT / "scripts" / "grpo_step.py"), "--config", str(REPO_ROOT / "configs" / "grpo_step_cpu.yaml"),
           "train.steps=2", "output.progress_bar=false", f"output.json_log={log}", *overrides]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert proc.returncode == 0, f"job failed\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    return proc.stdout, json.loads(log.read_text())


@pytest.mark.parametrize("overrides", [(), ("parallel.tensor_model_parallel_size=1", "parallel.context_parallel_size=2",
                                             "parallel.calculate_per_token_loss=true", "loss.kl.coef=0.01"),
                                       ("model.output_path=fused", "loss.kl.coef=0.01")],
                         ids=["tp2_packed", "cp2_per_token_kl", "tp2_packed_fused_kl"])
def test_cpu_job_runs_and_logs(tmp_path: Path, overrides) -> None:
    stdout, log = _run_job(tmp_path, *overrides)
    assert "CPU: megatron-core 0.16's GPTModel and forward_backward_func need CUDA" in stdout
    assert log["layout"]["backend"] == "gloo" and log["layout"]["world"] == 2
    assert log["layout"]["output_path"] == ("fused" if "model.output_path=fused" in overrides else "logits")
    assert [row["step"] for row in log["steps"]] == [0, 1]
    for row in log["steps"]:
        assert math.isfinite(row["metrics"]["loss"]) and row["metrics"]["valid_tokens"] > 0
        assert row["grad_norm"] is not None and row["grad_norm"] > 0
    # the second update of the rollout batch is off-policy: its ratios moved away from 1
    assert log["steps"][1]["metrics"]["ratio/max"] > 1.0
