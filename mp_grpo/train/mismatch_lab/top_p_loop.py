"""Experiment (f): the top-p row of (e) through the learning loop itself — GRPO runs with ``engine.top_p``, the
trainer replaying the filter or not.

(e) measures the filter's mismatch on the initial policy, outside the loop. Here :func:`mp_grpo.train.loop.run`
trains: its rollout engine (bf16) samples with top-p, and the loop's old-log-prob and training passes replay
``SamplingFilter(top_p)`` (``engine.replay_filter = true``, the default) or compute full-vocabulary log-probs
(``false``); the boundary rule drops and counts the sampled tokens outside the trainer's filter.

Schedule of :func:`run`
    1. The packaged CPU job config (``mp_grpo/train/configs/grpo_cpu.yaml``) at TP = 1 in this process (a world
       of one), padded micro-batches (one sequence a row), ``train.steps``, then the variant's engine keys.
    2. For every variant: :func:`mp_grpo.train.loop.run` with an ``on_rollout`` hook that takes, from this rank's
       micro-batches as the step trains on them, the old and rollout log-probs of the trained tokens.
    3. Per step: the reward of the rollout batch; with d = clamp(old − rollout, ±``policy.log_ratio_clamp``) on
       the trained tokens (:func:`~mp_grpo.train.mismatch_lab.top_p_replay.mismatch_statistics`, the formulas of
       (e)): vllm-kl = mean k3(d), token IS mean = mean e^d, sequence IS mean = mean over sequences of e^Σd;
       the loop's own ``mismatch/k3`` metric and the fraction of sampled tokens the boundary rule dropped.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

VARIANTS: dict[str, list[str]] = {
    "top_p 1 (control)": ["engine.top_p=1.0"],
    "top_p 0.8, no replay": ["engine.top_p=0.8", "engine.replay_filter=false"],
    "top_p 0.8, replay": ["engine.top_p=0.8", "engine.replay_filter=true"],
}
"""Variant name → engine overrides."""


@dataclass(frozen=True)
class TopPLoopSetup:
    """What experiment (f) runs (the documented run; :data:`QUICK` is the lab's default)."""

    steps: int = 20
    """Optimizer steps per run, as the job's config (on-policy: one rollout batch of 48 sequences × 6 completion
    tokens a step)."""
    variants: tuple[str, ...] = tuple(VARIANTS)
    """Names from :data:`VARIANTS`."""
    extra_overrides: tuple[str, ...] = ("parallel.tensor_model_parallel_size=1", "parallel.sequence_format=padded",
                                        "output.progress_bar=false")
    """Job-config overrides applied to every run (TP = 1: one process; padded: a row per sequence)."""


QUICK = TopPLoopSetup(steps=2)
"""The lab's default for (f): every variant, 2 steps (``--full``: the documented 20)."""


def run(setup: TopPLoopSetup = TopPLoopSetup()) -> dict:
    """Every variant's per-step curves; JSON-ready."""
    import torch

    from mp_grpo.config.job import load_job_config
    from mp_grpo.train import loop
    from mp_grpo.train.mismatch_lab.top_p_replay import mismatch_statistics

    config = Path(loop.__file__).resolve().parent / "configs" / "grpo_cpu.yaml"
    runs = {}
    for name in setup.variants:
        # --- 1. the variant's config ---
        overrides = [f"train.steps={setup.steps}", *setup.extra_overrides, *VARIANTS[name]]
        cfg = load_job_config(config, overrides)
        # --- 2. the run; the hook sees each rollout batch's micro-batches as the steps train on them ---
        rollouts: list[dict] = []

        def take(micro, cfg=cfg, rollouts=rollouts) -> None:
            width = max(mb.loss_mask.shape[1] for mb in micro)  # padded micro-batches: one sequence a row

            def rows(name: str) -> torch.Tensor:
                return torch.cat([torch.nn.functional.pad(getattr(mb, name), (0, width - mb.loss_mask.shape[1])) for mb in micro])

            old, rollout = rows("old_logprobs").double(), rows("rollout_logprobs").double()
            rollouts.append(mismatch_statistics(old, rollout, rows("loss_mask"), cfg.loss.policy.log_ratio_clamp))

        start = time.perf_counter()
        records = loop.run(cfg, on_rollout=take)
        # --- 3. the curves ---
        runs[name] = {"overrides": overrides, "seconds": round(time.perf_counter() - start, 1), "steps": [
            {"step": r["step"], "reward": float(r["reward"]), "vllm_kl_loop": float(r["metrics"].get("mismatch/k3", math.nan)),
             "outside_filter": float(r["outside_filter"]), "skipped": bool(r["skipped"]),
             "grad_norm": float(r["grad_norm"]), **stats} for r, stats in zip(records, rollouts)]}
        last = runs[name]["steps"][-1]
        print(f"(f) {name}: sequence IS mean {last['sequence_is_mean']:.3g}, reward {last['reward']:.3f} at the last step",
              flush=True)
    return {"experiment": "top_p_loop", "config": config.name, "setup": dataclasses.asdict(setup), "runs": runs}


TAIL_STEPS = 4
"""The table's "late" column averages the last this many steps."""


def table(result: dict) -> str:
    """Per variant: means over the steps of the IS and vllm-kl figures, the dropped tokens, the reward curve."""
    lines = ["| variant | token IS mean | sequence IS mean | min token IS | vllm-kl (k3) | tokens dropped by the "
             f"boundary rule | reward step 0 | reward last | mean reward, last {TAIL_STEPS} steps | skipped | s |",
             "|" + "---|" * 11]
    for name, r in result["runs"].items():
        s = r["steps"]

        def mean(key: str) -> float:
            return sum(x[key] for x in s) / len(s)

        tail = s[-TAIL_STEPS:]
        # outside_filter = dropped / sampled and the statistics count the tokens left: sampled = tokens + dropped.
        dropped = sum(round(x["outside_filter"] * x["tokens"] / (1 - x["outside_filter"])) for x in s)
        lines.append(f"| {name} | {mean('token_is_mean'):.4g} | {mean('sequence_is_mean'):.4g} "
                     f"| {min(x['token_is_min'] for x in s):.3g} | {mean('vllm_kl_k3'):.3g} "
                     f"| {dropped} of {sum(x['tokens'] for x in s) + dropped} | {s[0]['reward']:.3f} | {s[-1]['reward']:.3f} "
                     f"| {sum(x['reward'] for x in tail) / len(tail):.3f} | {sum(x['skipped'] for x in s)} of {len(s)} "
                     f"| {r['seconds']:.0f} |")
    return "\n".join(lines)


def steps_table(result: dict, key: str, fmt: str) -> str:
    """One row per variant, one column per step: ``key`` of each step."""
    first = next(iter(result["runs"].values()))["steps"]
    lines = ["| variant | " + " | ".join(str(x["step"]) for x in first) + " |", "|" + "---|" * (len(first) + 1)]
    for name, r in result["runs"].items():
        lines.append(f"| {name} | " + " | ".join(f"{x[key]:{fmt}}" for x in r["steps"]) + " |")
    return "\n".join(lines)


def report(result: dict) -> str:
    """The markdown of ``top_p_loop.md``: the summary table, then the sequence IS mean and the reward per step."""
    return "\n\n".join([table(result), "Sequence IS mean per step:", steps_table(result, "sequence_is_mean", ".3f"),
                        "Reward per step:", steps_table(result, "reward", ".3f")])


def plot(result: dict, path: Path) -> None:
    """Reward and sequence IS mean per step, one line per variant, side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in result["runs"].items():
        steps = [x["step"] for x in r["steps"]]
        ax1.plot(steps, [x["reward"] for x in r["steps"]], "o-", ms=3, label=name)
        ax2.plot(steps, [x["sequence_is_mean"] for x in r["steps"]], "o-", ms=3, label=name)
    for ax in (ax1, ax2):
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("mean reward of the rollout batch")
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("sequence IS mean: mean of exp Σ(old − rollout)")
    ax2.set_ylim(0.0, 1.1)
    ax1.legend(fontsize=8)
    fig.suptitle("(f) the learning loop sampling with top-p (bf16 engine): the trainer replays the filter or not")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
