"""The Megatron-LM RL launcher on CPU: its task's reward, the runs' command lines, the report, and a dry run through
Megatron-LM's own parser (skipped without ``MP_GRPO_MEGATRON_LM_SRC``)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from tests.distributed import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts" / "megatron_lm_rl"))
import mlm_report  # noqa: E402
from mlm_agent import make_prompt, parse_ids, successor_reward  # noqa: E402
from mlm_argv import EOD, INFERENCE_SEQ, MODULUS, PAD, RUNS, ForwardStep, RunSpec, build_argv  # noqa: E402


def test_successor_reward_counts_on_from_the_prompt() -> None:
    kw = dict(modulus=16, eod=31)
    assert successor_reward([3, 15], [0, 1, 2], budget=3, **kw) == 1.0  # 15 → 0 wraps
    assert successor_reward([3, 15], [0, 5, 6], budget=4, **kw) == 2 / 4  # 5 after 0 wrong; 6 after 5 right; 1 missing
    assert successor_reward([3], [4, 31, 5, 6], budget=4, **kw) == 1 / 4  # ends at eod
    assert successor_reward([3], [4, 5, 6, 7, 8], budget=2, **kw) == 1.0  # past the budget: not counted
    with pytest.raises(ValueError, match="budget"):
        successor_reward([3], [4], budget=0, **kw)
    assert parse_ids(" 3 4\n5 ") == [3, 4, 5]
    with pytest.raises(ValueError, match="integers"):
        parse_ids("3 x")
    rng = random.Random(0)
    prompts = [make_prompt(rng, prompt_tokens=(2, 6), modulus=MODULUS) for _ in range(200)]
    assert {len(p) for p in prompts} == {2, 3, 4, 5, 6} and all(0 <= t < MODULUS for p in prompts for t in p)
    assert max(MODULUS, PAD) < EOD and MODULUS <= PAD


def test_runs_differ_only_in_packing() -> None:
    argvs = {spec.name: build_argv(spec, REPO_ROOT / "env.yaml") for spec in RUNS}
    assert len(argvs) == 3 and {s.forward_step for s in RUNS} == set(ForwardStep)
    unpacked, packed = (build_argv(RunSpec(packing=p), REPO_ROOT / "env.yaml") for p in (False, True))
    assert [a for a in packed if a not in unpacked] == ["--rl-use-sequence-packing"]
    for argv in argvs.values():
        flags = " ".join(argv)
        for want in ("--output-logit-dtype fp32", "--num-layers 2", "--hidden-size 256", "--train-iters 20",
                     "--cuda-graph-impl none", "--tokenizer-type NullTokenizer", f"--null-tokenizer-pad-id {PAD}",
                     f"--inference-max-seq-length {INFERENCE_SEQ}", "--calculate-per-token-loss", "--micro-batch-size 1"):
            assert want in flags, want
    with pytest.raises(ValueError, match="logit_dtype"):
        build_argv(RunSpec(logit_dtype="fp16"), REPO_ROOT / "env.yaml")


def test_report_rise_and_tables(tmp_path) -> None:
    flat = [{"iteration": i, "mean_reward": 0.05, "sem": 0.01, "n": 128} for i in range(10)]
    rising = [{"iteration": i, "mean_reward": 0.05 + 0.02 * i, "sem": 0.01, "n": 128} for i in range(10)]
    assert mlm_report.rise(flat)["rose"] is False and mlm_report.rise(rising)["rose"] is True
    assert mlm_report.rise(flat[:4])["rose"] is None
    for name, rows in (("a", rising), ("b", flat)):
        run = tmp_path / name
        run.mkdir()
        (run / "argv.json").write_text(json.dumps({"run": name, "setup": {}}))
        (run / "rewards.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    parity = {"logits_dtype": "float32", "passed": True, "mp_grpo": {"objective_rel_diff": 1e-7, "grad_max_diff_rel": 2e-7},
              "megatron_lm": {"objective_rel_diff": 3e-7, "grad_max_diff_rel": 4e-7}}
    (tmp_path / "a" / "parity.json").write_text(json.dumps(parity))
    report = mlm_report.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "out" / "rl")])
    assert [r["rise"]["rose"] for r in report["runs"]] == [True, False]
    md = (tmp_path / "out" / "rl.md").read_text()
    assert "| a | 10 |" in md and "| yes |" in md and "| no |" in md and "1.0e-07" in md
    assert (tmp_path / "out" / "rl.png").stat().st_size > 0


def test_dry_run_through_megatron_lms_parser(tmp_path) -> None:
    """``run.py --dry-run`` (packing on, fp32 logits): Megatron-LM's parser accepts the argv, maps the logit dtype, and
    ``GRPOForwardStep.from_args`` picks fp32; the import report names every module the run needs."""
    if not os.environ.get("MP_GRPO_MEGATRON_LM_SRC"):
        pytest.skip("Megatron-LM's source is not available (set MP_GRPO_MEGATRON_LM_SRC): the launcher's dry run is "
                    "skipped")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "megatron_lm_rl" / "run.py"), "--dry-run",
                           "--packing", "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "dry_run.json").read_text())
    assert summary["parsed"]["logit_dtype"] == "torch.float32" and summary["from_args"]["logit_dtype"] == "fp32"
    assert summary["parsed"]["rl_use_sequence_packing"] == "True" and summary["parsed"]["perform_rl_step"] == "True"
    assert summary["from_args"]["eps"] == [0.2, 0.28] and summary["from_args"]["kl_coef"] == 0.0
    imports = summary["imports"]
    assert imports["megatron.training"] == "ok" and imports["mp_grpo.integrations.megatron_rl"] == "ok"
    assert imports["flash_attn"] == "ok" and summary["setup"]["flash_attn"] in ("stand-in", "installed")
    assert (tmp_path / "env_config.yaml").read_text().startswith("- agent_type: MpGrpoSuccessorCounting")
