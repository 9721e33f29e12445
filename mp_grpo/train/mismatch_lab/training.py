"""Experiment (d): GRPO runs of the learning job with the rollout engine's mismatch knob rising.

Needs the learning loop :func:`mp_grpo.train.loop.run` and its job config (:mod:`mp_grpo.config.job`,
:mod:`mp_grpo.train.rollout`); where they are absent :func:`run` prints why and returns None.

Schedule of :func:`run`
    1. The packaged CPU job config (``mp_grpo/train/configs/grpo_cpu.yaml``) at TP = 1 in this process
       (a world of one), its loss's rollout correction and skip cleared, then one variant's loss keys.
    2. For every variant: :func:`mp_grpo.train.loop.run`, with the engine's ``logit_noise_std`` raised
       linearly from 0 to ``max_noise_std`` over the steps (set after each step for the next rollout).
    3. Per step: the mean reward of the rollout batch, vllm-kl (``mismatch/k3``), whether the step was
       skipped, the grad norm, the trainer's mean entropy on the batch.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

NO_CORRECTION = ["loss.rollout_correction.weight_level=null", "loss.rollout_correction.weight_min=null",
                 "loss.rollout_correction.weight_max=null", "loss.rollout_correction.reject_level=null",
                 "loss.rollout_correction.reject_min=null", "loss.rollout_correction.reject_max=null",
                 "loss.rollout_correction.normalize_weights=false", "loss.opsm.delta=null",
                 "loss.mismatch.skip_threshold=null"]
"""Overrides that clear every rollout-correction, OPSM and skip key of the job's loss."""

VARIANTS: dict[str, list[str]] = {
    "no correction": [],
    "token TIS (cap 2)": ["loss.rollout_correction.weight_level=token", "loss.rollout_correction.weight_max=2.0"],
    "sequence MIS (reject > 2)": ["loss.rollout_correction.weight_level=sequence",
                                  "loss.rollout_correction.reject_level=sequence", "loss.rollout_correction.reject_max=2.0"],
    "geometric mask [0.5, 2]": ["loss.rollout_correction.reject_level=geometric",
                                "loss.rollout_correction.reject_min=0.5", "loss.rollout_correction.reject_max=2.0"],
    "OPSM (delta 0.5)": ["loss.opsm.delta=0.5"],
    "mismatch skip (vllm-kl > 0.1)": ["loss.mismatch.skip_threshold=0.1"],
}
"""Variant name → loss overrides on top of :data:`NO_CORRECTION`."""


@dataclass(frozen=True)
class TrainingSetup:
    """What experiment (d) runs."""

    steps: int = 12
    """Optimizer steps per run (the documented run; :data:`QUICK` is the lab's default)."""
    max_noise_std: float = 2.0
    """The engine's logit-noise std at the last step (0 at the first)."""
    variants: tuple[str, ...] = tuple(VARIANTS)
    """Names from :data:`VARIANTS`."""
    extra_overrides: tuple[str, ...] = ("parallel.tensor_model_parallel_size=1", "output.progress_bar=false")
    """Job-config overrides applied to every run (TP = 1: one process)."""


QUICK = TrainingSetup(steps=3)
"""The lab's default for (d): every variant, 3 steps (σ = 0, 1, 2) — a smoke run of a few minutes on 2 cores;
``--full`` runs :class:`TrainingSetup`'s 12 steps."""


def noise_at(setup: TrainingSetup, step: int) -> float:
    """The knob's value for the rollout of ``step``: linear from 0 to ``max_noise_std``."""
    return setup.max_noise_std * step / max(setup.steps - 1, 1)


def _learning_loop():
    """The loop module and the job-config loader, or None (with a message) when this checkout lacks them."""
    try:
        from mp_grpo.config.job import load_job_config
        from mp_grpo.train import loop
    except ImportError as err:
        print(f"(d) training: skipped — the learning loop mp_grpo.train.loop is not in this checkout ({err})", flush=True)
        return None
    return loop, load_job_config


def run(setup: TrainingSetup = TrainingSetup()) -> dict | None:
    """Every variant's per-step curves; JSON-ready; None when the learning loop is absent."""
    found = _learning_loop()
    if found is None:
        return None
    loop, load_job_config = found
    config = Path(loop.__file__).resolve().parent / "configs" / "grpo_cpu.yaml"
    runs = {}
    for name in setup.variants:
        # --- 1. the variant's config ---
        overrides = [f"train.steps={setup.steps}", "engine.logit_noise_std=0.0", *setup.extra_overrides,
                     *NO_CORRECTION, *VARIANTS[name]]
        cfg = load_job_config(config, overrides)
        # --- 2. the run; the knob rises after every step (the engine reads cfg.engine at each rollout) ---
        def rise(record: dict, cfg=cfg) -> None:
            cfg.engine.logit_noise_std = noise_at(setup, record["step"] + 1)
        start = time.perf_counter()
        records = loop.run(cfg, on_step=rise)
        # --- 3. the curves ---
        runs[name] = {"overrides": overrides, "steps": [
            {"step": r["step"], "noise_std": noise_at(setup, r["step"]), "reward": float(r["reward"]),
             "vllm_kl": float(r["metrics"].get("mismatch/k3", math.nan)), "skipped": bool(r["skipped"]),
             "entropy": float(r["metrics"].get("entropy", math.nan)),
             "grad_norm": float(r["grad_norm"]), "loss": float(r["metrics"]["loss"])} for r in records],
            "seconds": round(time.perf_counter() - start, 1)}
        print(f"(d) {name}: final reward {runs[name]['steps'][-1]['reward']:.3f}", flush=True)
    return {"experiment": "training", "config": str(config.name), "setup": dataclasses.asdict(setup), "runs": runs}


TAIL_STEPS = 4
"""The table's "late" columns average the last this many steps (the highest knob settings)."""


def table(result: dict) -> str:
    """Per variant: reward at the start, the knob's midpoint and the end, and over the last :data:`TAIL_STEPS`
    steps; vllm-kl at the midpoint and the end; the last entropy and grad norm (NaN: skipped); skips; seconds."""
    lines = [f"| variant | reward step 0 | reward mid | reward last | mean reward, last {TAIL_STEPS} steps "
             "| vllm-kl mid | vllm-kl last | entropy last | grad norm last | skipped steps | s |", "|" + "---|" * 11]
    for name, r in result["runs"].items():
        s = r["steps"]
        mid, tail = s[len(s) // 2], s[-TAIL_STEPS:]
        lines.append(f"| {name} | {s[0]['reward']:.3f} | {mid['reward']:.3f} (σ={mid['noise_std']:.2g}) "
                     f"| {s[-1]['reward']:.3f} (σ={s[-1]['noise_std']:.2g}) "
                     f"| {sum(x['reward'] for x in tail) / len(tail):.3f} | {mid['vllm_kl']:.3g} | {s[-1]['vllm_kl']:.3g} "
                     f"| {s[-1].get('entropy', math.nan):.3g} | {s[-1]['grad_norm']:.3g} | {sum(x['skipped'] for x in s)} of {len(s)} | {r.get('seconds', math.nan):.0f} |")
    return "\n".join(lines)


def steps_table(result: dict, key: str = "reward", fmt: str = ".3f") -> str:
    """One row per variant, one column per step: ``key`` of each step's record ("S": the step was skipped)."""
    first = next(iter(result["runs"].values()))["steps"]
    lines = ["| variant | " + " | ".join(f"{x['step']} (σ={x['noise_std']:.2g})" for x in first) + " |",
             "|" + "---|" * (len(first) + 1)]
    for name, r in result["runs"].items():
        cells = [f"{x[key]:{fmt}}" + (" S" if x["skipped"] else "") for x in r["steps"]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(result: dict) -> str:
    """The markdown of ``training.md``: the summary table, then reward, vllm-kl and entropy per step."""
    return "\n\n".join([table(result), "Reward per step (S: skipped):", steps_table(result),
                         "vllm-kl per step:", steps_table(result, "vllm_kl", ".2g"),
                         "Trainer entropy per step (nats):", steps_table(result, "entropy", ".2f")])


def plot(result: dict, path: Path) -> None:
    """Reward and vllm-kl per step, one line per variant, side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in result["runs"].items():
        steps = [x["step"] for x in r["steps"]]
        ax1.plot(steps, [x["reward"] for x in r["steps"]], "o-", ms=3, label=name)
        ax2.semilogy(steps, [x["vllm_kl"] for x in r["steps"]], "o-", ms=3, label=name)
    ax1.set_xlabel(f"step (engine logit noise 0 → {result['setup']['max_noise_std']})")
    ax1.set_ylabel("mean reward")
    ax2.set_xlabel("step")
    ax2.set_ylabel("vllm-kl (mean k3(old ‖ rollout))")
    ax1.legend(fontsize=7)
    fig.suptitle("(d) mismatch knob rising: rollout correction variants")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
