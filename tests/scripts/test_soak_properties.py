"""scripts/soak_properties.py and tests/property_stats.py: hypothesis' own counts of a property's examples, summed
over parallel runs with distinct seeds, failures with their seeds and falsifying examples, the report table.

The end-to-end cases soak tests/scripts/soak_dummy_property.py (integers: a few seconds a run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import soak_properties as S  # noqa: E402

DUMMY = "tests/scripts/soak_dummy_property.py"


def _suites(monkeypatch, **extra) -> None:
    monkeypatch.setitem(S.SUITES, "dummy", S.Suite("dummy", DUMMY, "dev", ("parity=even", "parity=odd"),
                                                   description="integers"))
    monkeypatch.setitem(S.SUITES, "dummy-fails", S.Suite("dummy-fails", DUMMY, "dev", env=(("MP_GRPO_SOAK_DUMMY_FAIL", "1"),),
                                                         description="integers, failing"))
    monkeypatch.setitem(S.SUITES, "dummy-fails-slowly", S.Suite(
        "dummy-fails-slowly", DUMMY, "dev", env=(("MP_GRPO_SOAK_DUMMY_FAIL", "1"), ("MP_GRPO_SOAK_DUMMY_SLOW", "1")),
        description="integers, failing slowly"))


def test_counts_come_from_hypothesis_and_add_up_over_runs(monkeypatch, tmp_path: Path) -> None:
    _suites(monkeypatch)
    out = tmp_path / "soak.json"
    # 15 even and 15 odd passing examples: more than one run of the dev profile's 20 examples
    rc = S.main(["run", "dummy=15", "--cpus", "0,0", "--time-limit", "240", "--nice", "0", "--seed", "3",
                 "--work", str(tmp_path / "work"), "--out", str(out)])
    assert rc == 0
    suite = json.loads(out.read_text())["suites"]["dummy"]
    assert suite["reached"] and suite["failed"] == 0 and suite["failing_runs"] == 0
    assert suite["by"]["parity=even"] >= 15 and suite["by"]["parity=odd"] >= 15
    assert suite["passed"] == suite["by"]["parity=even"] + suite["by"]["parity=odd"]
    assert suite["gave_up"] > 0  # x = 3, rejected by assume: counted apart
    assert len(suite["runs"]) >= 2 and len({r["seed"] for r in suite["runs"]}) == len(suite["runs"])
    assert sum(r["passed"] for r in suite["runs"]) == suite["passed"]
    assert all(r["cpu_s"] is not None and r["cpu_s"] > 0 for r in suite["runs"])


def _soak_failing(tmp_path: Path, name: str, target: int) -> tuple[int, dict, Path]:
    """One run of a failing dummy suite on one core, one failing run allowed: (exit code, its suite's entry, JSON)."""
    out = tmp_path / "soak.json"
    rc = S.main(["run", f"{name}={target}", "--cpus", "0", "--time-limit", "240", "--nice", "0",
                 "--max-failing-runs", "1", "--work", str(tmp_path / "work"), "--out", str(out)])
    return rc, json.loads(out.read_text())["suites"][name], out


def test_a_failure_is_reported_with_its_seed_and_example(monkeypatch, tmp_path: Path) -> None:
    _suites(monkeypatch)
    rc, suite, out = _soak_failing(tmp_path, "dummy-fails", 1000)
    assert rc == 1
    assert suite["failing_runs"] == 1 and suite["failed"] >= 1 and not suite["reached"]
    failure = suite["failures"][0]
    assert f"--hypothesis-seed={failure['seed']}" in failure["reproduce"]
    assert "MP_GRPO_SOAK_DUMMY_FAIL=1" in failure["reproduce"]
    assert "x=5" in failure["falsifying"][0]["representation"]  # shrunk to the smallest failing draw
    assert "@reproduce_failure" in failure["falsifying"][0]["reproduce"]
    table = S.report([out])
    assert "`dummy-fails`" in table and "**" in table  # failures stand out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip of a GPU suite on a machine without a GPU")
def test_a_gpu_suite_without_a_gpu_is_skipped_once(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    rc = S.main(["run", "gpu:logprob=5", "--cpus", "0", "--time-limit", "240", "--nice", "0",
                 "--work", str(tmp_path / "work"), "--out", str(out)])
    assert rc == 0
    suite = json.loads(out.read_text())["suites"]["gpu:logprob"]
    assert len(suite["runs"]) == 1 and suite["passed"] == 0 and not suite["reached"]
    assert "no CUDA device" in suite["skipped"]
    assert "skipped: MP_GRPO_PROPERTY_DEVICE=cuda" in S.report([out])


def test_report_between_markers(tmp_path: Path) -> None:
    data = {"wall_s": 12.0, "cores": 4, "host": {}, "suites": {"cp": {
        "description": "d", "device": "cpu", "profile": "soak", "labels": ["backend=torch"], "by": {"backend=torch": 7},
        "passed": 9, "failed": 0, "failing_runs": 0, "gave_up": 1, "runs": [{}], "reached": False, "target": 10}}}
    src = tmp_path / "r.json"
    src.write_text(json.dumps(data))
    md = tmp_path / "doc.md"
    md.write_text(f"intro\n{S.BEGIN}\nold table\n{S.END}\noutro\n")
    S.write_between_markers(md, S.report([src]))
    text = md.read_text()
    assert "old table" not in text and text.startswith("intro\n") and text.endswith("outro\n")
    assert "| `cp` | d | cpu (4 CPU cores), `soak` | 9 (target 10 not reached) | backend=torch 7 | 0 | 1 | 1 |" in text
    with pytest.raises(SystemExit, match="soak-results"):
        S.write_between_markers(src, "x")


def test_cpu_lists() -> None:
    assert S.parse_cpus("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert S.parse_cpus(None)


def test_unknown_suite_is_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown suite 'nope'"):
        S.main(["run", "nope", "--out", str(tmp_path / "x.json")])


def test_cpu_suites_are_skipped_where_the_interpreter_fails(monkeypatch, tmp_path: Path) -> None:
    """Where Triton's interpreter cannot run the kernels (Triton 3.6 with numpy >= 2.4), the CPU suites get no runs
    and say why, rather than counting every example as a failure."""
    _suites(monkeypatch)
    monkeypatch.setattr(S, "INTERPRETER_CHECK", "raise SystemExit('TypeError: only 0-dimensional arrays')")
    out = tmp_path / "soak.json"
    rc = S.main(["run", "dummy=5", "--cpus", "0", "--time-limit", "60", "--nice", "0",
                 "--work", str(tmp_path / "work"), "--out", str(out)])
    assert rc == 0
    suite = json.loads(out.read_text())["suites"]["dummy"]
    assert suite["runs"] == [] and suite["passed"] == 0 and not suite["reached"]
    assert "only 0-dimensional arrays" in suite["skipped"]
    assert "(skipped: " in S.report([out])


def _soak_json(passed_even: int, passed_odd: int, failed: int, target: int, seed: int) -> dict:
    failures = [{"seed": seed, "reproduce": f"--hypothesis-seed={seed}"}] if failed else []
    return {"command": f"soak {seed}", "started": "t", "wall_s": 10.0, "cores": 4, "slots": 4, "host": {},
            "suites": {"dummy": {
                "skipped": None, "description": "integers", "node": DUMMY, "profile": "dev", "device": "cpu", "env": {},
                "labels": ["parity=even", "parity=odd"], "target": target, "reached": False,
                "passed": passed_even + passed_odd, "failed": failed, "gave_up": 2,
                "by": {"parity=even": passed_even, "parity=odd": passed_odd},
                "runs": [{"seed": seed, "passed": passed_even + passed_odd}], "failing_runs": len(failures),
                "failures": failures, "cpu_s": 5.0, "cpu_s_per_example": 0.1}}}


def test_merge_sums_counts_and_checks_the_target_on_the_sum() -> None:
    merged = S.merge([_soak_json(6, 9, 0, 10, 1), _soak_json(5, 1, 1, 10, 2)])
    suite = merged["suites"]["dummy"]
    assert suite["passed"] == 21 and suite["by"] == {"parity=even": 11, "parity=odd": 10}
    assert suite["reached"]  # neither soak reached 10 of each label alone; their sum does
    assert suite["failed"] == 1 and suite["failing_runs"] == 1 and suite["failures"][0]["seed"] == 2
    assert [r["seed"] for r in suite["runs"]] == [1, 2] and merged["wall_s"] == 20.0 and merged["merged_from"] == 2
    assert not S.merge([_soak_json(6, 9, 0, 10, 1), _soak_json(3, 0, 0, 10, 2)])["suites"]["dummy"]["reached"]


def test_merge_refuses_different_draws() -> None:
    other = _soak_json(1, 1, 0, 10, 2)
    other["suites"]["dummy"]["profile"] = "soak"
    with pytest.raises(ValueError, match="'dummy' has profile"):
        S.merge([_soak_json(1, 1, 0, 10, 1), other])


def test_merge_refuses_soaks_of_different_code() -> None:
    one, other = _soak_json(1, 1, 0, 10, 1), _soak_json(1, 1, 0, 10, 2)
    one["source"] = {"mp_grpo": "a", "tests": "t", "files": {"mp_grpo/x.py": "1", "tests/y.py": "2"}}
    other["source"] = {"mp_grpo": "b", "tests": "t", "files": {"mp_grpo/x.py": "3", "tests/y.py": "2"}}
    with pytest.raises(ValueError, match=r"ran different code \(mp_grpo/x.py\)"):
        S.merge([one, other])
    other["source"] = dict(one["source"])
    assert S.merge([one, other])["source"] == one["source"]


def test_source_digest_follows_every_file_of_the_library_and_tests(tmp_path: Path) -> None:
    for name in S.SOURCE_DIRS:
        (tmp_path / name / "sub").mkdir(parents=True)
        (tmp_path / name / "sub" / "a.py").write_text("x = 1\n")
    before = S.source_digest(tmp_path)
    (tmp_path / "mp_grpo" / "sub" / "a.py").write_text("x = 2\n")
    changed = S.source_digest(tmp_path)
    assert changed["mp_grpo"] != before["mp_grpo"] and changed["tests"] == before["tests"]
    assert S.source_changes(before, changed) == ["mp_grpo/sub/a.py"] and S.source_changes(changed, changed) == []
    (tmp_path / "tests" / "sub" / "a.py").rename(tmp_path / "tests" / "sub" / "b.py")  # a rename is other code too
    assert S.source_digest(tmp_path)["tests"] != before["tests"]
    (tmp_path / "mp_grpo" / "notes.txt").write_text("not code")
    assert S.source_digest(tmp_path)["mp_grpo"] == changed["mp_grpo"]


def test_gpu_runs_go_to_the_least_busy_gpu() -> None:
    def run(gpu):
        return S.Run(S.SUITES["gpu:logprob"], 0, [0], Path("."), Path("."), None, 0.0, gpu=gpu)

    assert S.pick_gpu(["0", "1"], []) == "0"
    assert S.pick_gpu(["0", "1"], [run("0")]) == "1"
    assert S.pick_gpu(["0", "1"], [run("0"), run("1"), run("1")]) == "0"


def test_a_failing_run_is_not_stopped_at_its_suites_target(monkeypatch, tmp_path: Path) -> None:
    """The dummy's slowly failing flavour (1 s a failing example: shrinking takes seconds) reaches a target of 1
    passing example while its run shrinks — the run still reports its shrunk example (stopped at the target, it
    left only a count)."""
    _suites(monkeypatch)
    rc, suite, _ = _soak_failing(tmp_path, "dummy-fails-slowly", 1)
    assert rc == 1
    assert suite["failing_runs"] == 1 and suite["failures"][0]["falsifying"], suite["failures"]
    assert "x=5" in suite["failures"][0]["falsifying"][0]["representation"]


def test_a_soak_stops_when_the_code_under_test_changes(monkeypatch, tmp_path: Path) -> None:
    """The digest is read when the soak begins and watched: a tree copied over mid-soak (a second device call sending
    other code) stops it, the counts so far kept, the JSON naming the files — runs started after the change would
    have imported other code than those before."""
    _suites(monkeypatch)
    digests = iter([{"mp_grpo": "a", "tests": "t", "files": {"mp_grpo/x.py": "1"}}] * 4)
    changed = {"mp_grpo": "b", "tests": "t", "files": {"mp_grpo/x.py": "2"}}
    monkeypatch.setattr(S, "source_digest", lambda root=S.REPO_ROOT: next(digests, changed))
    out = tmp_path / "soak.json"
    S.main(["run", "dummy=100000", "--cpus", "0", "--time-limit", "240", "--nice", "0", "--print-every", "0",
            "--work", str(tmp_path / "work"), "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["source"]["mp_grpo"] == "a" and data["stopped_on_source_change"]["files"] == ["mp_grpo/x.py"]
    assert data["wall_s"] < 60 and not data["suites"]["dummy"]["reached"]
