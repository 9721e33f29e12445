"""Experiment (g): the pairing rule — the trainer's logit precision × the rollout engine's head precision, at several
levels of upstream difference between the two sides.

Both sides hold the same bf16 weights (a bf16 trainer under Megatron's bf16 contract, ``model.params_dtype = bf16``;
a bf16 engine, ``engine.dtype = bf16``, synced from it) and compute their logits as ``hidden @ weightᵀ`` with fp32
sums. Each side then rounds those sums to bf16 or keeps them in fp32: ``model.logit_dtype`` (the trainer's training
and forward-only passes) and ``engine.logit_dtype`` (vLLM's ``head_dtype`` / sglang's ``--enable-fp32-lm-head``).
The upstream difference is the engine's ``logit_noise_std``: N(0, σ²) noise on its fp32 sums, before its head
rounds them — what other kernels, batch composition or quantization do to an engine's logits. At σ = 0 the two
sides' sums are the same numbers (same weights, same arithmetic on CPU). ``model.cpu_logit_offset`` puts the
stand-in's logits at a trained LLM's scale (a few units without it; the measured scale is in the results,
``logit_max_first`` / ``logit_max_last``), where bf16 rounds them in steps of 1/16–1/8.

Schedule of :func:`run`
    1. The packaged CPU job config (``mp_grpo/train/configs/grpo_cpu.yaml``) at TP = 1 in this process (a world of
       one), padded micro-batches (one sequence a row), a bf16 trainer and engine, the logit offset, ``steps``;
       then per run the pairing's ``model.logit_dtype`` / ``engine.logit_dtype`` and the level's
       ``engine.logit_noise_std``.
    2. For every level and pairing: :func:`mp_grpo.train.loop.run`, with an ``on_rollout`` hook that takes, from
       this rank's micro-batches as the step trains on them, the old (trainer) and rollout (engine) log-probs of
       the trained tokens, and the trainer's own logits of the batch (for the logit scale and the entropy).
    3. Per step, sums over the trained tokens of d = clamp(old − rollout, ±``policy.log_ratio_clamp``) — all
       tokens, and per bin of the engine's probability of the sampled token (the low-probability-token effect):
       d, d², k3(d) (vllm-kl), the token IS ratio eᵈ and its square; per sequence e^{clamp(Σd)} and its square;
       the rollout batch's reward; the trainer's mean row maximum of the logits and mean entropy.
    4. Per run, the pooled statistics over all steps (:func:`summarize`): vllm-kl, RMS and mean of d, the
       standard deviations of the token and sequence IS ratios, the same per probability bin, the reward.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

PAIRINGS: tuple[tuple[str, str], ...] = (("bf16", "bf16"), ("fp32", "bf16"), ("bf16", "fp32"), ("fp32", "fp32"))
"""(trainer ``model.logit_dtype``, engine ``engine.logit_dtype``), in Fast-LLM's order."""

PROBABILITY_EDGES = (0.1, 0.5)
"""Bins of the engine's probability of the sampled token: p < 0.1 (the low-probability tokens), 0.1 ≤ p < 0.5, p ≥ 0.5."""

BINS = ("all", "p<0.1", "0.1<=p<0.5", "p>=0.5")
"""The token groups whose sums :func:`pairing_sums` returns."""

REFERENCE_LEVEL = 0.03
"""The level whose reward curves the plot shows: σ ≈ the bf16 rounding of a logit between 16 and 32 (a step of 1/8,
standard deviation 0.036) — an upstream difference of the head's own size."""

TAIL_STEPS = 4
"""The table's "late" reward averages the last this many steps."""


@dataclass(frozen=True)
class PairingSetup:
    """What experiment (g) runs (the documented run; :data:`QUICK` is the lab's default)."""

    steps: int = 10
    """Optimizer steps per run (on-policy: one rollout batch of 48 sequences × 6 completion tokens a step)."""
    noise_levels: tuple[float, ...] = (0.0, 0.01, 0.03, 0.1)
    """The engine's ``logit_noise_std``, the upstream difference: none (the same sums on both sides), below, at and
    above the bf16 rounding of the logits (std ~0.02–0.04 at this scale)."""
    pairings: tuple[tuple[str, str], ...] = PAIRINGS
    """(trainer head, engine head) pairs from :data:`PAIRINGS`."""
    logit_offset: float = 16.0
    """``model.cpu_logit_offset``: every initial logit shifted by it (the measured row maximum: each run's
    ``logit_max_first``)."""
    extra_overrides: tuple[str, ...] = ("parallel.tensor_model_parallel_size=1", "parallel.sequence_format=padded",
                                        "output.progress_bar=false")
    """Job-config overrides applied to every run (TP = 1: one process; padded: a row per sequence)."""


QUICK = PairingSetup(steps=2, noise_levels=(0.0, REFERENCE_LEVEL))
"""The lab's default for (g): every pairing at two levels, 2 steps (``--full``: the documented run)."""


def run_overrides(setup: PairingSetup, trainer: str, engine: str, noise: float) -> list[str]:
    """The job-config overrides of one run."""
    return [f"train.steps={setup.steps}", "model.params_dtype=bf16", f"model.cpu_logit_offset={setup.logit_offset}",
            "engine.dtype=bf16", f"model.logit_dtype={trainer}", f"engine.logit_dtype={engine}",
            f"engine.logit_noise_std={noise}", *setup.extra_overrides]


def pairing_sums(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, clamp: float | None) -> dict:
    """Sums over the valid tokens of ``[N, S]`` log-probs (see the module docstring, step 3), in float64: per token
    group of :data:`BINS` ``n``, ``d``, ``d2``, ``k3``, ``r``, ``r2`` (r = eᵈ); per sequence ``seq_n``, ``seq_r``,
    ``seq_r2`` (e^{clamp(Σd)})."""
    from mp_grpo.loss.clamps import symmetric_clamp
    from mp_grpo.loss.mismatch import k3
    from mp_grpo.loss.rollout_correction import token_log_ratio

    d = token_log_ratio(old.double(), rollout.double(), mask, clamp)
    p = torch.where(mask, rollout.double(), torch.zeros_like(d)).exp()
    low, high = PROBABILITY_EDGES
    groups = {"all": mask, "p<0.1": mask & (p < low), "0.1<=p<0.5": mask & (p >= low) & (p < high),
              "p>=0.5": mask & (p >= high)}
    zero = torch.zeros_like(d)
    out: dict = {}
    for name, g in groups.items():
        r = torch.where(g, d.exp(), zero)
        out[name] = {"n": int(g.sum()), "d": float(torch.where(g, d, zero).sum()), "d2": float(torch.where(g, d * d, zero).sum()),
                     "k3": float(torch.where(g, k3(d), zero).sum()), "r": float(r.sum()), "r2": float((r * r).sum())}
    rows = mask.any(1)
    seq = symmetric_clamp(d.sum(1), clamp).exp()[rows]
    out["seq_n"], out["seq_r"], out["seq_r2"] = int(rows.sum()), float(seq.sum()), float((seq * seq).sum())
    return out


def _std(total: float, squares: float, n: int) -> float:
    return math.sqrt(max(squares / n - (total / n) ** 2, 0.0)) if n else math.nan


def summarize(steps: list[dict]) -> dict:
    """The pooled statistics of one run over its steps (module docstring, step 4)."""
    out: dict = {}
    for name in BINS:
        n = sum(s["sums"][name]["n"] for s in steps)

        def total(key: str, name=name) -> float:
            return sum(s["sums"][name][key] for s in steps)

        out[name] = {"tokens": n, "vllm_kl_k3": total("k3") / n if n else math.nan,
                     "rms_d": math.sqrt(total("d2") / n) if n else math.nan, "mean_d": total("d") / n if n else math.nan,
                     "token_is_std": _std(total("r"), total("r2"), n)}
    seq_n = sum(s["sums"]["seq_n"] for s in steps)
    out["sequence_is_std"] = _std(sum(s["sums"]["seq_r"] for s in steps), sum(s["sums"]["seq_r2"] for s in steps), seq_n)
    rewards = [s["reward"] for s in steps]
    out["reward_mean"] = sum(rewards) / len(rewards)
    tail = rewards[-TAIL_STEPS:]
    out["reward_tail"] = sum(tail) / len(tail)
    out["skipped"] = sum(s["skipped"] for s in steps)
    out["logit_max_first"], out["logit_max_last"] = steps[0]["logit_max"], steps[-1]["logit_max"]
    return out


def run(setup: PairingSetup = PairingSetup()) -> dict:
    """Every (level, pairing)'s per-step sums and pooled statistics; JSON-ready."""
    from mp_grpo.config.job import load_job_config
    from mp_grpo.train import loop

    config = Path(loop.__file__).resolve().parent / "configs" / "grpo_cpu.yaml"
    runs = []
    for noise in setup.noise_levels:
        for trainer_head, engine_head in setup.pairings:
            # --- 1. the run's config ---
            overrides = run_overrides(setup, trainer_head, engine_head, noise)
            cfg = load_job_config(config, overrides)
            # --- 2. the run; the hooks see the trainer and each rollout batch's micro-batches ---
            held: dict = {}
            rollouts: list[dict] = []

            def take(micro, cfg=cfg, held=held, rollouts=rollouts) -> None:
                width = max(mb.loss_mask.shape[1] for mb in micro)  # padded micro-batches: one sequence a row

                def rows(name: str) -> torch.Tensor:
                    return torch.cat([torch.nn.functional.pad(getattr(mb, name), (0, width - mb.loss_mask.shape[1]))
                                      for mb in micro])

                mask = rows("loss_mask")
                sums = pairing_sums(rows("old_logprobs"), rows("rollout_logprobs"), mask, cfg.loss.policy.log_ratio_clamp)
                # the trainer's own logits of the batch, for their scale and entropy (statistics only)
                maxima, entropies = [], []
                with torch.no_grad():
                    for mb in micro:
                        z = held["trainer"].policy(mb.input_ids, mb.position_ids).float()[mb.loss_mask]
                        maxima.append(z.max(-1).values)
                        logp = torch.log_softmax(z / cfg.rollout.temperature, -1)
                        entropies.append(-(logp.exp() * logp).sum(-1))
                rollouts.append({"sums": sums, "logit_max": float(torch.cat(maxima).mean()),
                                 "entropy": float(torch.cat(entropies).mean())})

            start = time.perf_counter()
            records = loop.run(cfg, on_rollout=take, on_trainer=lambda t, held=held: held.update(trainer=t))
            # --- 3. per step ---
            steps = [{"step": r["step"], "reward": float(r["reward"]), "vllm_kl_loop": float(r["metrics"].get("mismatch/k3", math.nan)),
                      "skipped": bool(r["skipped"]), "grad_norm": float(r["grad_norm"]), **x} for r, x in zip(records, rollouts)]
            # --- 4. pooled ---
            summary = summarize(steps)
            runs.append({"noise_std": noise, "trainer": trainer_head, "engine": engine_head, "overrides": overrides,
                         "seconds": round(time.perf_counter() - start, 1), "summary": summary, "steps": steps})
            print(f"(g) σ={noise:g} trainer {trainer_head} / engine {engine_head}: RMS d {summary['all']['rms_d']:.3g}, "
                  f"vllm-kl {summary['all']['vllm_kl_k3']:.3g}, reward {summary['reward_mean']:.3f}", flush=True)
    return {"experiment": "pairing", "config": config.name, "setup": dataclasses.asdict(setup),
            "probability_edges": list(PROBABILITY_EDGES), "runs": runs}


def _pair(r: dict) -> str:
    return f"{r['trainer']} / {r['engine']}"


def table(result: dict) -> str:
    """One row per (level, pairing): the pooled mismatch statistics, the low-probability-token effect, the reward."""
    lines = ["| upstream σ | trainer / engine head | vllm-kl (k3) | RMS d (nats) | token IS std | sequence IS std "
             "| RMS d, p < 0.1 | RMS d, p ≥ 0.5 | mean d, p < 0.1 | p < 0.1: tokens / vllm-kl share | mean reward "
             f"| reward, last {TAIL_STEPS} steps | s |", "|" + "---|" * 13]
    for r in result["runs"]:
        s = r["summary"]
        everything, low, high = s["all"], s["p<0.1"], s["p>=0.5"]
        kl_share = low["vllm_kl_k3"] * low["tokens"] / (everything["vllm_kl_k3"] * everything["tokens"])
        lines.append(f"| {r['noise_std']:g} | {_pair(r)} | {everything['vllm_kl_k3']:.3g} | {everything['rms_d']:.3g} "
                     f"| {everything['token_is_std']:.3g} | {s['sequence_is_std']:.3g} | {low['rms_d']:.3g} "
                     f"| {high['rms_d']:.3g} | {low['mean_d']:.2g} | {low['tokens'] / everything['tokens']:.0%} / "
                     f"{kl_share:.0%} | {s['reward_mean']:.3f} | {s['reward_tail']:.3f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def pivot(result: dict, key: str = "rms_d", group: str = "all", fmt: str = ".3g") -> str:
    """One row per level, one column per pairing (Fast-LLM's layout): ``summary[group][key]``."""
    pairs = list(dict.fromkeys(_pair(r) for r in result["runs"]))
    levels = list(dict.fromkeys(r["noise_std"] for r in result["runs"]))
    cell = {(r["noise_std"], _pair(r)): r["summary"][group][key] for r in result["runs"]}
    lines = ["| upstream σ | " + " | ".join(pairs) + " |", "|" + "---|" * (len(pairs) + 1)]
    for level in levels:
        lines.append(f"| {level:g} | " + " | ".join(f"{cell[level, p]:{fmt}}" for p in pairs) + " |")
    return "\n".join(lines)


def report(result: dict) -> str:
    """The markdown of ``pairing.md``: the table, then RMS d and its low-probability part per level and pairing."""
    first = [r["summary"]["logit_max_first"] for r in result["runs"]]
    last = [r["summary"]["logit_max_last"] for r in result["runs"]]
    scale = (f"The scale bf16 rounds at: the trainer's largest logit, averaged over the trained positions, is "
             f"{min(first):.1f}–{max(first):.1f} at the first step and {min(last):.1f}–{max(last):.1f} at the last "
             "(over the runs).")
    return "\n\n".join([table(result), scale,
                        "RMS of d = old − rollout (nats), trainer / engine head:", pivot(result),
                        "RMS of d over the sampled tokens of engine probability p < 0.1:", pivot(result, group="p<0.1"),
                        "vllm-kl (k3):", pivot(result, "vllm_kl_k3")])


def plot(result: dict, path: Path) -> None:
    """RMS d per level and pairing (all tokens; p < 0.1 and p ≥ 0.5), and the reward per step at :data:`REFERENCE_LEVEL`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = list(dict.fromkeys(_pair(r) for r in result["runs"]))
    levels = list(dict.fromkeys(r["noise_std"] for r in result["runs"]))
    by = {(r["noise_std"], _pair(r)): r for r in result["runs"]}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    x = range(len(levels))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, p in zip(colors, pairs):
        axes[0].plot(x, [by[lv, p]["summary"]["all"]["rms_d"] for lv in levels], "o-", color=color, label=p)
        axes[1].plot(x, [by[lv, p]["summary"]["p<0.1"]["rms_d"] for lv in levels], "o-", color=color, label=f"{p}, p < 0.1")
        axes[1].plot(x, [by[lv, p]["summary"]["p>=0.5"]["rms_d"] for lv in levels], "s:", color=color, label=f"{p}, p ≥ 0.5")
    for ax, title in zip(axes[:2], ("RMS of old − rollout log-prob, all sampled tokens",
                                    "the same by the engine's probability of the token")):
        ax.set_xticks(list(x), [f"{lv:g}" for lv in levels])
        ax.set_xlabel("upstream difference: engine logit noise σ (nats)")
        ax.set_ylabel("RMS d (nats)")
        ax.set_ylim(bottom=0.0)
        ax.set_title(title, fontsize=9)
    axes[0].legend(title="trainer / engine head", fontsize=8)
    axes[1].legend(fontsize=6, ncol=2)
    reference = min(levels, key=lambda lv: abs(lv - REFERENCE_LEVEL))
    for color, p in zip(colors, pairs):
        steps = by[reference, p]["steps"]
        axes[2].plot([s["step"] for s in steps], [s["reward"] for s in steps], "o-", ms=3, color=color, label=p)
    axes[2].set_xlabel("optimizer step")
    axes[2].set_ylabel("mean reward of the rollout batch")
    axes[2].set_title(f"reward at σ = {reference:g}", fontsize=9)
    axes[2].xaxis.get_major_locator().set_params(integer=True)
    axes[2].legend(title="trainer / engine head", fontsize=8)
    first = result["runs"][0]["summary"]["logit_max_first"]
    fig.suptitle("(g) trainer logit precision × engine head precision (bf16 weights on both sides; the trainer's "
                 f"largest logit {first:.1f} on average at the first step)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
