"""scripts/learning_layouts.py's comparison and report on CPU, without runs: maxima over the steps with the same
completions are "none" when there is no such step (not 0, which would read as "equal"), the per-step reward
difference over every step, and ``--report`` rewriting the markdown from the JSON alone."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.distributed import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))

import learning_layouts as ll  # noqa: E402


def _steps(rewards: list[float], digests: list[str]) -> list[dict]:
    return [dict(step=i, reward=r, loss=0.1 * i, grad_norm=1.0 + i, skipped=False, completions_digest=d)
            for i, (r, d) in enumerate(zip(rewards, digests))]


def test_compare_and_report(tmp_path: Path) -> None:
    base = _steps([0.1, 0.2, 0.3, 0.4], ["a", "b", "c", "d"])
    same_start = _steps([0.1, 0.2, 0.35, 0.5], ["a", "b", "x", "y"])
    c = ll.compare(base, same_start)
    assert (c["same_completions_steps"], c["first_different_step"], c["max_abs_loss_difference"]) == (2, 2, 0.0)
    assert abs(c["max_abs_reward_difference_any_step"] - 0.1) < 1e-12
    apart = ll.compare(base, _steps([0.15, 0.2, 0.3, 0.4], ["x", "b", "c", "d"]))
    assert apart["same_completions_steps"] == 0 and apart["first_different_step"] == 0
    assert apart["max_abs_loss_difference"] is None and apart["max_rel_grad_norm_difference"] is None
    runs = {"fp32_tp1": {"steps": base}, "fp32_tp2": {"steps": same_start},
            "bf16_tp1": {"steps": base}, "bf16_tp2": {"steps": _steps([0.15, 0.2, 0.3, 0.4], ["x", "b", "c", "d"])}}
    report = dict(command="python scripts/learning_layouts.py --out OUT", date="2026-01-01",
                  machine=dict(gpu="GPU"), config="gpu", dtype_overrides=ll.DTYPE_OVERRIDES,
                  summary=ll.summarize(runs), runs=runs)
    # a JSON written before maxima over no step were None holds 0.0 there: still shown as none
    report["summary"]["bf16"]["tp2_vs_tp1"].update(max_abs_loss_difference=0.0, max_rel_grad_norm_difference=0.0)
    del report["summary"]["bf16"]["tp2_vs_tp1"]["max_abs_reward_difference_any_step"]  # recomputed from the runs
    source = tmp_path / "learning_layouts.json"
    source.write_text(json.dumps(report))
    ll.main(["--report", str(source), "--out", str(tmp_path / "docs")])
    text = (tmp_path / "docs" / "learning_layouts.md").read_text()
    assert "| bf16 | `as shipped` | 0 of 4 | 0 | — | — | 0.050 |" in text
    assert "| fp32 | `model.params_dtype=fp32 engine.dtype=fp32` | 2 of 4 | 2 | 0.0e+00 | 0.0e+00 | 0.100 |" in text
    assert "- bf16: the completions differ from the first step" in text
