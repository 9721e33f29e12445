"""The loss-rows benchmarks on the CPU, measuring nothing: ``scripts/bench_loss_rows.py --dry-run`` end to end (its rows,
its check against every row's op, its report and plot), and ``scripts/bench_step.py --loss-fraction`` (the synthetic
micro-batches' mask, the driver end to end in a dry run); bad arguments refused before any work (a dry run under
``docs/``, a fraction outside (0, 1], a JSON of another fraction)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.distributed import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))

import step_model  # noqa: E402


def _script(name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / name), *args], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"{name} {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def test_bench_loss_rows_dry_run(tmp_path) -> None:
    _script("bench_loss_rows.py", "--dry-run", "--out", str(tmp_path), "--fractions", "0.5")
    result = json.loads((tmp_path / "loss_rows.json").read_text())
    assert result["dry_run"] and result["check_worst_error_over_tolerance"] <= 1.0
    assert {r["key"] for r in result["fractions"]} == {"bare", "all_rows", "rows", "logits_rows"}
    assert {r["key"] for r in result["long"]} == {"rows", "all_rows", "bare"}
    assert result["rows_host_read"]["64"]["cpu_mask_us"] > 0
    assert all("fwd_bwd_ms" in r and "vs_bare" in r for r in result["fractions"] + result["long"]), result
    report = (tmp_path / "loss_rows.md").read_text()
    assert "DRY RUN" in report and "target ≤ 0.55x" in report and "3% loss tokens: not measured this run" in report
    assert (tmp_path / "loss_rows.png").stat().st_size > 0


def _main_exits(module, argv: list[str], monkeypatch, capsys) -> str:
    """``module.main()`` with ``argv`` must stop with its parser's error (before any work); returns the message."""
    monkeypatch.setattr(sys, "argv", [module.__file__, *argv])
    with pytest.raises(SystemExit):
        module.main()
    return capsys.readouterr().err


def test_bad_arguments_refused(tmp_path, monkeypatch, capsys) -> None:
    import bench_loss_rows
    import bench_step

    def too_far(*_args, **_kwargs):
        raise AssertionError("the arguments were not refused before the run started")

    monkeypatch.setattr(bench_step, "init_distributed", too_far)
    monkeypatch.setattr(bench_loss_rows, "run", too_far)
    docs = str(REPO_ROOT / "docs" / "benchmarks")
    assert "never go under docs/" in _main_exits(bench_loss_rows, ["--dry-run", "--out", docs], monkeypatch, capsys)
    assert "--loss-fraction: must lie in (0, 1]" in _main_exits(
        bench_step, ["--dry-run", "--loss-fraction", "1.5", "--out", str(tmp_path)], monkeypatch, capsys)
    (tmp_path / "step_local.json").write_text(json.dumps({"meta": {"loss_fraction": 0.5}, "rows": [
        {"shape": "tiny", "seq": 128, "recompute": "selective", "kind": "train", "path": "floor", "ms": 1.0}]}))
    assert "use another --out" in _main_exits(
        bench_step, ["--dry-run", "--spec", "local", "--loss-fraction", "0.1", "--out", str(tmp_path)], monkeypatch,
        capsys)


@pytest.mark.parametrize("fraction", [None, 0.5, 0.03, 1.0])
def test_synthetic_micro_batches_loss_fraction(fraction) -> None:
    (mb,) = step_model.synthetic_micro_batches(1, 2, 64, 32, seed=1, device="cpu", loss_fraction=fraction)
    trained = int(mb.loss_mask[0].sum())  # the mask moved to the logits' positions: the last has no target
    expected = 64 - 64 // step_model.PROMPT_FRACTION if fraction is None else min(round(fraction * 64), 63)
    assert trained in (expected - 1, expected), (trained, expected)
    assert mb.loss_rows.numel() == int(mb.loss_mask.sum())


def test_bench_step_loss_fraction_dry_run(tmp_path) -> None:
    args = ["--dry-run", "--spec", "local", "--shape", "tiny", "--seq", "128", "--recompute", "selective", "--paths",
            "floor", "fused", "--rows", "train", "--no-search", "--no-check", "--rounds", "1", "--warmup", "0", "--out",
            str(tmp_path)]
    _script("bench_step.py", *args, "--loss-fraction", "0.5")
    result = json.loads((tmp_path / "step_local.json").read_text())
    assert result["meta"]["loss_fraction"] == 0.5 and {r["path"] for r in result["rows"]} == {"floor", "fused"}
