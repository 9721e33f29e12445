#!/usr/bin/env python
"""The main job at TP = 1 and TP = 2, in fp32 and in bf16: does the same seed give the same run on both layouts?

    python scripts/learning_layouts.py --out docs/train          # a machine with ≥ 2 GPUs (3 or 4: runs overlap)

Four runs of :func:`mp_grpo.train.loop.run` under ``torchrun``, ``--config gpu`` as shipped (megatron-core GPTModel,
Megatron DDP and Adam, a rollout engine with its own copy of the weights), the same seed:

- ``fp32_tp1`` / ``fp32_tp2``: trainer and engine in fp32 (``model.params_dtype=fp32 engine.dtype=fp32``);
- ``bf16_tp1`` / ``bf16_tp2``: the config's own bf16 trainer and engine.

As many runs at once as the GPUs allow, each on its own GPUs (``CUDA_VISIBLE_DEVICES``; one after the other on a
machine without GPUs). Per step: the mean reward, the loss, the gradient norm and a digest of the rollout batch's
completions (their token ids). Per dtype, TP = 2 against TP = 1 (:func:`compare`): how many steps from the first
sampled the same completions, the largest |Δloss| and relative gradient-norm difference over those steps, the
first step whose completions differ, and each run's mean reward over its first and last 5 steps
(:func:`mp_grpo.train.report.reward_change`).

Writes ``learning_layouts.json`` (every step of every run, the comparison, the command, the machine) and
``learning_layouts.md``. ``tests/gpu/test_learning_layouts.py`` runs the fp32 pair through :func:`launch` and
asserts the same trajectory for 8 steps. ``--worker`` is the per-run entry point that :func:`launch` starts under
torchrun.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

RUNS = {
    # name: (dtype, tensor-parallel size)
    "fp32_tp1": ("fp32", 1),
    "fp32_tp2": ("fp32", 2),
    "bf16_tp1": ("bf16", 1),
    "bf16_tp2": ("bf16", 2),
}
DTYPE_OVERRIDES = {
    "fp32": ["model.params_dtype=fp32", "engine.dtype=fp32"],
    "bf16": [],  # the config's own: bf16 trainer (Float16Module) and bf16 engine
}
DEFAULT_STEPS = 60
"""The shipped GPU config's length."""
POLL_S = 0.5
"""How often the launcher looks for a finished run when every GPU is taken."""
DIGEST_CHARS = 16
"""Hex digits kept of a step's completions' SHA-256 (equal digests: the same token ids)."""


def overrides(dtype: str, tp: int, steps: int) -> list[str]:
    """The job's dotlist overrides of one run."""
    return [*DTYPE_OVERRIDES[dtype], f"parallel.tensor_model_parallel_size={tp}", f"train.steps={steps}",
            "output.progress_bar=false"]


# ------------------------------------------------------------------------------------------------ one run
def completions_digest(completions) -> str:
    """SHA-256 of a step's ``[N, S]`` completion token ids (int64, row-major), shortened."""
    import torch

    data = completions.to(torch.int64).contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:DIGEST_CHARS]


def worker(config: str, job_overrides: list[str], record: Path, keep_completions: bool) -> None:
    """Entry point of one run under torchrun: the job, then rank 0 writes its per-step record to ``record``."""
    import torch.distributed as dist

    from mp_grpo.config.job import load_job_config
    from mp_grpo.train.__main__ import config_path
    from mp_grpo.train.loop import run

    cfg = load_job_config(config_path(config), job_overrides)
    info: dict = {}
    records = run(cfg, on_start=info.update)
    if dist.get_rank() == 0:
        steps = []
        for r in records:
            step = dict(step=r["step"], reward=r["reward"], loss=r["metrics"]["loss"],
                        grad_norm=None if math.isnan(r["grad_norm"]) else r["grad_norm"], skipped=r["skipped"],
                        seconds=round(r["seconds"], 4), completions_digest=completions_digest(r["completions"]))
            if keep_completions:
                step["completions"] = r["completions"].tolist()
            steps.append(step)
        record.write_text(json.dumps(dict(overrides=job_overrides, description=info.get("description"),
                                          layout=info.get("layout"), steps=steps)))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ the runs
@dataclass
class Run:
    """One planned run: its name, processes, overrides; filled in by :func:`launch`."""

    name: str
    nproc: int
    overrides: list[str]
    gpus: list[int] | None = None
    wall_s: float | None = None


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launch(runs: list[Run], scratch: Path, *, config: str = "gpu", keep_completions: bool = False,
           log=print) -> dict[str, dict]:
    """Run every run of ``runs`` (each a torchrun of :func:`worker`), at once as far as the GPUs allow, each on GPUs
    of its own; returns each run's record (see :func:`worker`) with its GPUs and wall time. Raises naming the run and
    showing its output's tail when one fails."""
    gpus = _gpu_count()
    if gpus and max(r.nproc for r in runs) > gpus:
        raise SystemExit(f"a run needs {max(r.nproc for r in runs)} GPUs, this machine has {gpus}")
    free = list(range(gpus))
    pending, active, results = list(runs), {}, {}
    while pending or active:
        started = False
        for run in list(pending):
            if active and (not gpus or run.nproc > len(free)):
                continue  # without GPUs one run at a time; with GPUs, only where enough are free
            run.gpus, free = (free[:run.nproc], free[run.nproc:]) if gpus else (None, free)
            env = dict(os.environ)
            if gpus:
                env.pop("TRITON_INTERPRET", None)  # real GPU kernels
            else:
                env.setdefault("TRITON_INTERPRET", "1")
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, run.gpus))
            record, output = scratch / f"{run.name}.json", scratch / f"{run.name}.log"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={run.nproc}",
                   str(Path(__file__).resolve()), "--worker", "--config", config, "--record", str(record),
                   *(["--keep-completions"] if keep_completions else []), "--", *run.overrides]
            handle = output.open("w")
            proc = subprocess.Popen(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
            active[run.name] = (run, proc, handle, time.perf_counter())
            pending.remove(run)
            started = True
            log(f"started {run.name} ({run.nproc} process{'es' if run.nproc > 1 else ''}"
                f"{f', GPUs {run.gpus}' if gpus else ''}): {' '.join(run.overrides)}")
        if started:
            continue
        time.sleep(POLL_S)
        for name, (run, proc, handle, start) in list(active.items()):
            if proc.poll() is None:
                continue
            handle.close()
            run.wall_s = round(time.perf_counter() - start, 1)
            del active[name]
            free = sorted(free + (run.gpus or []))
            if proc.returncode != 0:
                for other in active.values():
                    other[1].terminate()
                tail = (scratch / f"{name}.log").read_text()[-6000:]
                raise RuntimeError(f"run {name} failed (exit {proc.returncode}); its output's tail:\n{tail}")
            results[name] = dict(json.loads((scratch / f"{name}.json").read_text()), gpus=run.gpus, wall_s=run.wall_s)
            log(f"finished {name} in {run.wall_s} s")
    return results


# ------------------------------------------------------------------------------------------------ comparison
def compare(base: list[dict], other: list[dict]) -> dict:
    """``other`` against ``base``, step by step: the leading steps with the same completions, the largest |Δloss|,
    relative gradient-norm difference and |Δreward| over them (None when there is no such step), the first step
    whose completions differ (None: none, over the shorter run) with its number of differing tokens when both runs
    kept their completions, and the largest per-step |Δ mean reward| over every step of the shorter run."""
    same, worst_loss, worst_norm, worst_reward, first_diff, tokens_diff = 0, 0.0, 0.0, 0.0, None, None
    for a, b in zip(base, other):
        if a["completions_digest"] != b["completions_digest"]:
            first_diff = a["step"]
            if "completions" in a and "completions" in b:
                tokens_diff = sum(x != y for ra, rb in zip(a["completions"], b["completions"]) for x, y in zip(ra, rb))
            break
        same += 1
        worst_loss = max(worst_loss, abs(b["loss"] - a["loss"]))
        worst_reward = max(worst_reward, abs(b["reward"] - a["reward"]))
        if a["grad_norm"] is not None and b["grad_norm"] is not None:
            worst_norm = max(worst_norm, abs(b["grad_norm"] - a["grad_norm"]) / a["grad_norm"])
        elif (a["grad_norm"] is None) != (b["grad_norm"] is None):
            worst_norm = math.inf  # one run skipped the step, the other did not
    if same == 0:  # maxima over no step: none (not 0, which would read as "equal")
        worst_loss = worst_norm = worst_reward = None
    per_step = [abs(b["reward"] - a["reward"]) for a, b in zip(base, other)]
    return dict(same_completions_steps=same, first_different_step=first_diff, tokens_different=tokens_diff,
                max_abs_loss_difference=worst_loss, max_rel_grad_norm_difference=worst_norm,
                max_abs_reward_difference=worst_reward,
                max_abs_reward_difference_any_step=max(per_step) if per_step else None)


def summarize(results: dict[str, dict]) -> dict:
    """Per dtype present: TP = 2 against TP = 1 (:func:`compare`) and each run's first / last mean reward."""
    from mp_grpo.train.report import reward_change

    out = {}
    for dtype in sorted({RUNS[n][0] for n in results}):
        tp1, tp2 = results.get(f"{dtype}_tp1"), results.get(f"{dtype}_tp2")
        entry: dict = {}
        for name, res in ((f"{dtype}_tp1", tp1), (f"{dtype}_tp2", tp2)):
            if res is not None:
                change = reward_change(res["steps"])
                entry[name] = dict(steps=len(res["steps"]), reward_first=change.first, reward_last=change.last,
                                   first_steps=list(change.first_steps), last_steps=list(change.last_steps),
                                   noise=change.noise)
        if tp1 is not None and tp2 is not None:
            entry["tp2_vs_tp1"] = compare(tp1["steps"], tp2["steps"])
        out[dtype] = entry
    return out


def _over_same_steps(cmp_: dict, key: str, fmt: str) -> str:
    """A maximum over the steps with the same completions: "—" when there is none (a JSON written before such
    maxima were None holds 0 there)."""
    value = cmp_.get(key)
    return "—" if cmp_["same_completions_steps"] == 0 or value is None else format(value, fmt)


def _any_step_reward_difference(report: dict, dtype: str) -> float | None:
    """The largest per-step |Δ mean reward| of the dtype's pair over every step (from the runs when the summary lacks
    it)."""
    cmp_ = report["summary"][dtype]["tp2_vs_tp1"]
    if cmp_.get("max_abs_reward_difference_any_step") is not None:
        return cmp_["max_abs_reward_difference_any_step"]
    runs = report.get("runs", {})
    a, b = runs.get(f"{dtype}_tp1"), runs.get(f"{dtype}_tp2")
    if not a or not b:
        return None
    return max((abs(y["reward"] - x["reward"]) for x, y in zip(a["steps"], b["steps"])), default=None)


def markdown(report: dict) -> str:
    lines = ["# The main job at TP = 1 and TP = 2, fp32 and bf16", "",
             f"Command: `{report['command']}` ({report['machine']['gpu']}, {report['date']}). The same seed, "
             f"`--config {report['config']}` with the dtype overrides below; TP = 2 against TP = 1. The mean rewards "
             "are over each run's first and last k steps, k = min(5, steps / 4). Generated by "
             "`scripts/learning_layouts.py` with `learning_layouts.json` (`--report` rewrites this file from it).", "",
             "| dtype | overrides | steps with the same completions (from step 0) | first step that differs | "
             "max \\|Δloss\\| over them | max rel. Δ grad norm over them | max \\|Δ mean reward\\| of a step, every step | "
             "mean reward, first / last k steps, TP = 1 | TP = 2 |",
             "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for dtype, entry in report["summary"].items():
        cmp_ = entry.get("tp2_vs_tp1")
        if cmp_ is None:
            continue
        r1, r2 = entry[f"{dtype}_tp1"], entry[f"{dtype}_tp2"]
        steps = min(r1["steps"], r2["steps"])
        first = "none" if cmp_["first_different_step"] is None else str(cmp_["first_different_step"])
        any_step = _any_step_reward_difference(report, dtype)
        lines.append(f"| {dtype} | `{' '.join(DTYPE_OVERRIDES[dtype]) or 'as shipped'}` | "
                     f"{cmp_['same_completions_steps']} of {steps} | {first} | "
                     f"{_over_same_steps(cmp_, 'max_abs_loss_difference', '.1e')} | "
                     f"{_over_same_steps(cmp_, 'max_rel_grad_norm_difference', '.1e')} | "
                     f"{'—' if any_step is None else f'{any_step:.3f}'} | "
                     f"{r1['reward_first']:.3f} / {r1['reward_last']:.3f} | {r2['reward_first']:.3f} / {r2['reward_last']:.3f} |")
        if cmp_["same_completions_steps"] == 0:
            notes.append(f"{dtype}: the completions differ from the first step, so TP = 1 and TP = 2 are two different "
                         "runs of the same job from there on (no step to compare them on); their mean rewards compare "
                         "two runs, not one trajectory.")
        elif cmp_["first_different_step"] is not None:
            notes.append(f"{dtype}: the same completions for {cmp_['same_completions_steps']} steps (the losses and "
                         "gradient norms drifting apart from the sums' order alone, up to the figures above), then a "
                         "different sample, and two runs from there on.")
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def machine() -> dict:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    try:
        from megatron.core import package_info

        megatron_core = package_info.__version__
    except ImportError:
        megatron_core = None
    return dict(gpu=gpu, gpus=_gpu_count(), python=platform.python_version(), torch=torch.__version__,
                megatron_core=megatron_core)


# ------------------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where learning_layouts.json / .md go")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps of the bf16 runs (and fp32's by default)")
    parser.add_argument("--fp32-steps", type=int, default=None, help="steps of the fp32 runs (default: --steps)")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPE_OVERRIDES), default=["fp32", "bf16"])
    parser.add_argument("--config", default="gpu", help="the job's config (cpu / gpu / a YAML path)")
    parser.add_argument("--worker", action="store_true", help="one run (what the launcher starts under torchrun)")
    parser.add_argument("--record", type=Path, help="--worker: where rank 0 writes the run's record")
    parser.add_argument("--keep-completions", action="store_true", help="--worker: keep the token ids in the record")
    parser.add_argument("--report", type=Path, metavar="LEARNING_LAYOUTS_JSON",
                        help="no runs: rewrite learning_layouts.md from this JSON into --out")
    parser.add_argument("extra", nargs="*", help="dotlist overrides added to every run (after --)")
    args = parser.parse_args(argv)
    if args.report:
        if args.out is None:
            parser.error("--report needs --out")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "learning_layouts.md").write_text(markdown(json.loads(args.report.read_text())))
        return
    if args.worker:
        if args.record is None:
            parser.error("--worker needs --record")
        worker(args.config, args.extra, args.record, args.keep_completions)
        return
    if args.out is None:
        parser.error("--out is required")
    if args.steps < 1 or (args.fp32_steps is not None and args.fp32_steps < 1):
        parser.error("--steps / --fp32-steps must be ≥ 1")
    steps = {"fp32": args.fp32_steps or args.steps, "bf16": args.steps}
    runs = [Run(name, tp, overrides(dtype, tp, steps[dtype]) + list(args.extra))
            for name, (dtype, tp) in RUNS.items() if dtype in args.dtypes]
    runs.sort(key=lambda r: -r.nproc)  # the two-GPU runs first: the one-GPU runs fill the GPUs left over
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="learning_layouts_") as scratch:
        results = launch(runs, Path(scratch), config=args.config)
    command = "python scripts/learning_layouts.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = dict(command=command.replace(str(args.out), "OUT"), date=date.today().isoformat(), machine=machine(),
                  config=args.config, dtype_overrides=DTYPE_OVERRIDES, wall_s=round(time.perf_counter() - start, 1),
                  summary=summarize(results), runs=results)
    (args.out / "learning_layouts.json").write_text(json.dumps(report, indent=1))
    (args.out / "learning_layouts.md").write_text(markdown(report))
    for dtype, entry in report["summary"].items():
        c = entry.get("tp2_vs_tp1")
        if c:
            print(f"{dtype}: TP = 2 vs TP = 1 — same completions for {c['same_completions_steps']} steps (first "
                  f"different: {c['first_different_step']}), max |Δloss| {_over_same_steps(c, 'max_abs_loss_difference', '.1e')}, "
                  f"max rel. Δ grad norm {_over_same_steps(c, 'max_rel_grad_norm_difference', '.1e')}; mean reward over the last 5 steps "
                  f"{entry[f'{dtype}_tp1']['reward_last']:.3f} (TP = 1) vs {entry[f'{dtype}_tp2']['reward_last']:.3f} (TP = 2)")
    print(f"wrote {args.out / 'learning_layouts.json'} and learning_layouts.md ({report['wall_s']} s)")


if __name__ == "__main__":
    main()
