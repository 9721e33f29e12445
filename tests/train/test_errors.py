"""The learning job's command line refuses a bad config or layout in one line on stderr, with exit status 2.

Each case runs ``python -m mp_grpo.train`` (or torchrun) as a user would, in a subprocess: the job stops before
any training, so each takes about the time of importing torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mp_grpo.config import preset_names

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAIN_KEYS = "steps | num_microbatches | micro_batch_size | updates_per_rollout | lr | clip_grad | seed"
PRESETS = " | ".join(preset_names())  # every packaged preset, in the order the error lists them


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MP_GRPO_TRACEBACK")}
    env.update(OMP_NUM_THREADS="1", TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])), **extra)
    return env


def _job(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mp_grpo.train", *args], env=_env(**env), capture_output=True, text=True,
                          timeout=120, cwd=cwd)


ONE_PROCESS = "parallel.tensor_model_parallel_size=1"
CASES = {  # name: (arguments, the exact line on stderr)
    "typo in a key": (["train.stesp=5"],
                      f"error: train.stesp: no such key (given 5; did you mean train.steps?); allowed keys: {TRAIN_KEYS}"),
    "typo in a section": (["trian.steps=5"], "error: trian: no such key (did you mean train?); allowed keys: "
                          "model | parallel | train | rollout | engine | task | loss_preset | loss | output"),
    "negative learning rate": (["train.lr=-0.01"], "error: train.lr: got -0.01; allowed: a float > 0"),
    "zero steps": (["train.steps=0"], "error: train.steps: got 0; allowed: an integer ≥ 1"),
    "unknown dtype": (["engine.dtype=fp8"], "error: engine.dtype: got 'fp8'; allowed: bf16 | fp32"),
    "misspelt dtype": (["engine.dtype=bf61"], "error: engine.dtype: got 'bf61' (did you mean bf16?); allowed: bf16 | fp32"),
    "not an integer": (["train.steps=abc"],
                       "error: train.steps: Value 'abc' of type 'str' could not be converted to Integer; allowed: int"),
    "group of one": (["rollout.group_size=1"], "error: rollout.group_size: got 1; allowed: an integer ≥ 2 (advantages are "
                     "normalized within a group: with one completion per prompt every advantage is 0 and nothing is learned)"),
    "misspelt preset": (["loss_preset=mismatch_sfe"],
                        f"error: loss_preset: no preset named 'mismatch_sfe' (did you mean mismatch_safe?); allowed: {PRESETS}"),
    "misspelt config": (["--config", "cpuu"], "error: --config: got 'cpuu', neither a packaged config nor a YAML file "
                        "(did you mean cpu?); allowed: cpu | gpu | a YAML path"),
    "group does not divide the batch": ([ONE_PROCESS, "rollout.group_size=5"], "error: rollout.group_size: 5 does not divide "
                                        "the global batch DP·M·micro_batch_size = 1·2·24 = 48; allowed: a divisor of 48"),
    "TP = 2 without torchrun": (["train.steps=3"], "error: parallel.tensor_model_parallel_size: got 2, which needs 2 processes, "
                                "but this is one process (not launched by torchrun); run `torchrun --standalone "
                                "--nproc_per_node 2 -m mp_grpo.train --config cpu train.steps=3`, or add "
                                "parallel.tensor_model_parallel_size=1 to run on one process"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_one_line_and_status_2(name: str, tmp_path: Path) -> None:
    args, line = CASES[name]
    proc = _job(["--config", "cpu", *args] if "--config" not in args else args, tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [line]
    assert proc.stdout == ""
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_traceback_when_asked(how: str, tmp_path: Path) -> None:
    args, line = CASES["zero steps"]
    if how == "flag":
        proc = _job(["--config", "cpu", "--traceback", *args], tmp_path)
    else:
        proc = _job(["--config", "cpu", *args], tmp_path, MP_GRPO_TRACEBACK="1")
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):" and "ConfigError" in lines[-2] and lines[-1] == line


def test_run_directory_of_another_config_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    (run_dir / "log.json").write_text(json.dumps({"config_digest": "0123abcd"}))
    proc = _job(["--config", "cpu", ONE_PROCESS, f"output.dir={run_dir}"], tmp_path)
    assert proc.returncode == 2
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"error: output.dir: {run_dir} holds the log of a run of another config (digest 0123abcd, this one ")
    assert line.endswith("allowed: a new directory, null (a directory per config), or output.overwrite=true")


def test_torchrun_every_rank_exits_2_and_the_line_ends_the_report(tmp_path: Path) -> None:
    """Under torchrun: the line is shown once, as the root cause at the end of torchrun's failure report; both
    ranks exit with status 2 (torchrun itself exits with 1, as it does for any failed worker)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO_ROOT / "scripts" / "grpo_step.py"), "--config", "cpu", "train.stesp=5"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 1
    output = proc.stdout + proc.stderr
    _, line = CASES["typo in a key"]
    assert output.count(line) == 1
    report = output[output.index("Root Cause"):].splitlines()
    assert report[-2] == f"  traceback : {line}" and report[-1].startswith("=====")
    assert report[4] == "  rank      : 0 (local_rank: 0)"
    assert output.count("exitcode  : 2 ") == 2  # both ranks
