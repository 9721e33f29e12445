"""The learning job's run directory: one per config, never silently overwritten (mp_grpo/train/outputs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mp_grpo.config import ConfigError
from mp_grpo.config.job import load_job_config
from mp_grpo.train.outputs import config_digest, plan_outputs, write_log

CPU = Path(__file__).resolve().parents[2] / "mp_grpo" / "train" / "configs" / "grpo_cpu.yaml"


def test_a_directory_per_config_and_seed() -> None:
    base = plan_outputs(load_job_config(CPU), "grpo_cpu")
    assert base.dir == Path("out") / f"grpo_cpu-seed0-{config_digest(load_job_config(CPU))}"
    assert base.log == base.dir / "log.json" and base.plot == base.dir / "curves.png"
    seed1 = plan_outputs(load_job_config(CPU, ["train.seed=1"]), "grpo_cpu")
    lr = plan_outputs(load_job_config(CPU, ["train.lr=0.01"]), "grpo_cpu")
    assert seed1.dir.name.startswith("grpo_cpu-seed1-")
    assert len({base.dir, seed1.dir, lr.dir}) == 3
    # the output section itself does not change the directory
    assert plan_outputs(load_job_config(CPU, ["output.progress_bar=false"]), "grpo_cpu").dir == base.dir
    assert plan_outputs(load_job_config(CPU, ["output.plot=false"]), "grpo_cpu").plot is None


def test_same_config_replaces_other_config_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = load_job_config(CPU, [f"output.dir={run_dir}"])
    first = plan_outputs(cfg, "grpo_cpu")
    assert first.note is None
    write_log(first, cfg, {"layout": {}}, [dict(step=0, reward=0.1, metrics={"loss": float("nan")}, completions=None)])
    logged = json.loads(first.log.read_text())
    assert logged["config_digest"] == first.digest and logged["steps"] == [dict(step=0, reward=0.1, metrics={"loss": None})]
    assert "replacing the files of an earlier run of the same config" in plan_outputs(cfg, "grpo_cpu").note
    other = load_job_config(CPU, [f"output.dir={run_dir}", "train.lr=0.01"])
    with pytest.raises(ConfigError, match=r"^output\.dir: .* holds the log of a run of another config"):
        plan_outputs(other, "grpo_cpu")
    forced = load_job_config(CPU, [f"output.dir={run_dir}", "train.lr=0.01", "output.overwrite=true"])
    assert "overwriting" in plan_outputs(forced, "grpo_cpu").note
