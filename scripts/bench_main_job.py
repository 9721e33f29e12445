#!/usr/bin/env python
"""The README's main job, run and timed as a newcomer runs it: wall time, machine load, what it learned.

    python scripts/bench_main_job.py --seeds 0 1 2 --out docs/benchmarks

For each seed, one after the other: ``OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2
scripts/grpo_step.py --config cpu train.seed=SEED`` (the README's command; seed 0 is the config's own), timed
wall-clock around the whole command (start-up included), with the 1-minute load average before and after
it — on a shared machine other jobs' load slows the run, so every time is reported beside its load. From the
run's ``log.json``: the mean reward over the first and last 5 steps with the noise of the difference
(:func:`mp_grpo.train.report.reward_change`) and the entropy at the first and last step.

Writes ``main_job.json`` (every run, the machine, the versions), ``main_job.md`` (a table) and
``main_job.png`` (mean reward per step of every run, with the chance level). ``--append`` adds the runs to
those of an existing ``main_job.json`` (measurements at other times, under other loads).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from mp_grpo.train.report import reward_change  # noqa: E402

COMMAND = "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 scripts/grpo_step.py --config cpu"


def run_once(seed: int, scratch: Path) -> dict:
    run_dir = scratch / f"seed{seed}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO_ROOT / "scripts" / "grpo_step.py"), "--config", "cpu", f"train.seed={seed}",
           "output.progress_bar=false", f"output.dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    load_before = os.getloadavg()
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO_ROOT)
    wall = time.perf_counter() - start
    load_after = os.getloadavg()
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed}: the job failed (exit {proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    steps = json.loads((run_dir / "log.json").read_text())["steps"]
    change = reward_change(steps)
    summary = next(line for line in proc.stdout.splitlines() if "mean reward" in line)
    return dict(seed=seed, wall_s=round(wall, 1), inside_job_s=round(sum(s["seconds"] for s in steps), 1),
                load_before=[round(x, 2) for x in load_before], load_after=[round(x, 2) for x in load_after],
                reward_first=round(change.first, 4), reward_last=round(change.last, 4),
                noise=round(change.noise, 4), verdict=change.verdict, first_steps=change.first_steps,
                last_steps=change.last_steps, reward_step0=round(steps[0]["reward"], 4),
                entropy_first=round(steps[0]["metrics"]["entropy"], 3), entropy_last=round(steps[-1]["metrics"]["entropy"], 3),
                rewards=[round(s["reward"], 4) for s in steps], summary=summary)


def markdown(result: dict) -> str:
    runs = result["runs"]
    walls = [r["wall_s"] for r in runs]
    lines = [
        "# The main job on a CPU machine — wall time and what it learned",
        "",
        f"Command: `{result['command']}` (the README's) with `train.seed=SEED`, the runs one after the other on "
        f"{result['machine']}; wall time around the whole command, the 1-minute load average before / after each run "
        f"(the job itself adds about 2 on 2 cores; more means other jobs shared the machine). Written by "
        f"`{' ; '.join(result['bench_commands'])}`.",
        "",
        "| date | seed | wall s | inside the job s | load before / after | reward step 0 | mean reward first 5 → last 5 steps | verdict | entropy first → last step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(runs, key=lambda r: r["load_before"][0]):
        lines.append(f"| {r['date']} | {r['seed']} | {r['wall_s']:.0f} | {r['inside_job_s']:.0f} | {r['load_before'][0]:.2f} / {r['load_after'][0]:.2f} | "
                     f"{r['reward_step0']:.3f} | {r['reward_first']:.3f} → {r['reward_last']:.3f} (±{r['noise']:.3f}) | "
                     f"{r['verdict']} | {r['entropy_first']:.2f} → {r['entropy_last']:.2f} |")
    lines += ["", f"Wall time {min(walls):.0f}–{max(walls):.0f} s over these runs (sorted by the load before them). ±: the half-width of the 95 % interval "
              "of the difference, from the per-step spread (`mp_grpo/train/report.py`). A uniform policy scores 1/32 = 0.031."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    from matplotlib.ticker import MaxNLocator

    for seed in sorted({r["seed"] for r in result["runs"]}):  # one curve a seed: the same seed gives the same curve
        r = next(r for r in result["runs"] if r["seed"] == seed)
        ax.plot(range(len(r["rewards"])), r["rewards"], marker=".", label=f"seed {seed}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.axhline(1 / 32, color="gray", linestyle=":", label="chance: a uniform policy, 0.031")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward (fraction of tokens right)")
    ax.set_ylim(-0.02, 1.0)
    ax.set_title("The main job (--config cpu): mean reward per step", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "benchmarks")
    parser.add_argument("--append", action="store_true", help="add the runs to those of an existing main_job.json")
    args = parser.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as scratch:
        runs = []
        for seed in args.seeds:
            runs.append(dict(date=date.today().isoformat(), **run_once(seed, Path(scratch))))
            print(f"seed {seed}: {runs[-1]['wall_s']:.0f} s, load {runs[-1]['load_before'][0]:.2f} → "
                  f"{runs[-1]['load_after'][0]:.2f}; {runs[-1]['summary']}", flush=True)
    bench = "python scripts/bench_main_job.py --seeds " + " ".join(map(str, args.seeds)) + " --out docs/benchmarks"
    result = dict(command=COMMAND, bench_commands=[bench],
                  machine=f"{os.cpu_count()} CPU cores, {platform.system()} (Python {platform.python_version()}, torch {torch.__version__})",
                  runs=runs)
    earlier = args.out / "main_job.json"
    if args.append and earlier.exists():
        old = json.loads(earlier.read_text())
        result.update(runs=old["runs"] + runs, bench_commands=old["bench_commands"] + [bench + " --append"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "main_job.json").write_text(json.dumps(result, indent=1))
    (args.out / "main_job.md").write_text(markdown(result))
    plot(result, args.out / "main_job.png")
    print(f"wrote {args.out / 'main_job.json'}, main_job.md, main_job.png")


if __name__ == "__main__":
    main()
