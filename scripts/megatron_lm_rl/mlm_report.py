"""The launcher's runs side by side: reward curves, whether each rose beyond its noise, the loss parity.

    python scripts/megatron_lm_rl/mlm_report.py RUN_DIR [RUN_DIR ...] --out docs/benchmarks/megatron_lm_rl

Reads each run's ``argv.json``, ``rewards.jsonl`` and ``parity.json`` (``run.py``'s outputs) and writes ``OUT.json``,
``OUT.md`` and ``OUT.png``. A run's reward *rose beyond its noise* when the mean over its last ``WINDOW`` steps
exceeds the mean over its first ``WINDOW`` steps by more than ``NOISE_Z`` standard errors of that difference (the
steps' own standard errors over their 128 rollouts, combined).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

WINDOW = 5
"""Steps averaged at each end of a run."""
NOISE_Z = 3.0
"""Standard errors the rise must exceed."""


def rise(rows: list[dict]) -> dict:
    """First / last ``WINDOW`` steps' mean reward, the difference, its standard error, and whether it exceeds
    ``NOISE_Z`` of them."""
    if len(rows) < 2 * WINDOW:
        return {"steps": len(rows), "rose": None, "why": f"fewer than {2 * WINDOW} steps"}
    first, last = rows[:WINDOW], rows[-WINDOW:]
    mean = lambda rs: sum(r["mean_reward"] for r in rs) / len(rs)  # noqa: E731
    sem = lambda rs: math.sqrt(sum(r["sem"] ** 2 for r in rs)) / len(rs)  # noqa: E731
    diff, err = mean(last) - mean(first), math.hypot(sem(first), sem(last))
    return {"steps": len(rows), "first": mean(first), "last": mean(last), "diff": diff, "sem": err,
            "rose": diff > NOISE_Z * err}


def load(run_dir: Path) -> dict:
    meta = json.loads((run_dir / "argv.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "rewards.jsonl").read_text().splitlines() if line.strip()]
    parity_file = run_dir / "parity.json"
    return {"run": meta["run"], "setup": meta["setup"], "rewards": rows, "rise": rise(rows),
            "parity": json.loads(parity_file.read_text()) if parity_file.is_file() else None}


def markdown(runs: list[dict]) -> str:
    lines = ["| run | steps | reward, first 5 steps | reward, last 5 steps | rise / its s.e. | rose beyond noise |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        x = r["rise"]
        if x.get("rose") is None:
            lines.append(f"| {r['run']} | {x['steps']} | | | | {x['why']} |")
        else:
            lines.append(f"| {r['run']} | {x['steps']} | {x['first']:.4f} | {x['last']:.4f} | "
                         f"{x['diff'] / x['sem'] if x['sem'] else float('inf'):.1f} | {'yes' if x['rose'] else 'no'} |")
    lines += ["", "| run | logits | mp_grpo vs Megatron-LM (float64): objective | gradient | Megatron-LM's own "
              "precision vs float64: objective | gradient | passed |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        p = r["parity"]
        if p is None or "skipped" in p:
            continue
        lines.append(f"| {r['run']} | {p['logits_dtype']} | {p['mp_grpo']['objective_rel_diff']:.1e} | "
                     f"{p['mp_grpo']['grad_max_diff_rel']:.1e} | {p['megatron_lm']['objective_rel_diff']:.1e} | "
                     f"{p['megatron_lm']['grad_max_diff_rel']:.1e} | {p['passed']} |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        it = [row["iteration"] for row in r["rewards"]]
        mean = [row["mean_reward"] for row in r["rewards"]]
        sem = [row["sem"] for row in r["rewards"]]
        ax.errorbar(it, mean, yerr=sem, label=r["run"], capsize=2)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward (± s.e.)")
    ax.set_title("Megatron-LM's RL loop, successor counting, tiny GPT")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, required=True, help="path without suffix")
    opts = parser.parse_args(argv)
    runs = [load(d) for d in opts.runs]
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"window": WINDOW, "noise_z": NOISE_Z, "runs": runs}
    opts.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    opts.out.with_suffix(".md").write_text(markdown(runs))
    plot(runs, opts.out.with_suffix(".png"))
    return report


if __name__ == "__main__":
    main()
