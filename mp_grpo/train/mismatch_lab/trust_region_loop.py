"""Experiment (i): PPO ratio clipping vs DPPO's binary TV vs its top-K TV trust region, in the learning loop, with the
rollout engine's mismatch knob at a few fixed levels.

Every arm anchors its trust region on the rollout engine's μ (``rollout_correction.bypass``: the policy ratio is
r = π_θ / μ) and differs only in which tokens lose their gradient:

- ``PPO ratio clip``: the loss's defaults (``ppo_clip``, ε = 0.2 each side) with bypass — a token's gradient is 0
  where r < 1 − ε and A < 0, or r > 1 + ε and A > 0 (the clip is active);
- ``DPPO binary TV``: the ``trl_dppo`` preset (TRL's DPPOTrainer: −A·stopgrad(min(r, 20))·log π_θ) — a token is
  dropped where |π_θ(y_t) − μ(y_t)| > δ = 0.15 in the advantage's direction (the paper's Eq. 12–13);
- ``DPPO top-K TV (K = 20)``: the same preset with ``trust_region.mode=topk_tv`` and ``engine.topk_logprobs=20``:
  the divergence is ½ (Σ_k |π_θ(k) − μ(k)| + |rest_π − rest_μ|) over the engine's 20 most probable ids of the token.

Schedule of :func:`run`
    1. The packaged CPU job config (``mp_grpo/train/configs/grpo_cpu.yaml``) at TP = 1 in this process (a world of
       one), padded micro-batches (one sequence a row), its ``loss`` section replaced by the arm's (a preset or the
       loss's defaults) and ``setup.extra_overrides`` (the batch size).
    2. For every mismatch level σ (``engine.logit_noise_std``, fixed over the run), seed (``train.seed``: prompts and
       sampling) and arm: :func:`mp_grpo.train.loop.run` with two hooks: ``on_trainer`` keeps the policy,
       ``on_rollout`` takes each rollout batch's micro-batches as the step trains on them and computes, in float64
       from the policy's own logits (π_θ = π_old at the one update per rollout), :func:`rollout_statistics`:
       vllm-kl, the token IS ratio π_θ/μ's spread and the fraction of tokens the arm's rule masks (what the loss's
       metric must equal).
    3. Per step: the reward, the grad norm (before clipping), the loss's masked fraction (``clip_frac/low +
       /high`` for the clip, ``rejected_frac/trust_region`` for DPPO), its ``ratio/*`` metrics, ``nonfinite_inputs``
       and a count of the non-finite numbers in the record; and step 2's statistics.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ARMS: dict[str, dict] = {
    "PPO ratio clip": {"preset": None, "overrides": ["loss.rollout_correction.bypass=true"]},
    "DPPO binary TV": {"preset": "trl_dppo", "overrides": []},
    "DPPO top-K TV (K = 20)": {"preset": "trl_dppo",
                               "overrides": ["loss.trust_region.mode=topk_tv", "engine.topk_logprobs=20"]},
}
"""Arm name → its loss preset (None: the loss's defaults) and overrides on top of it."""


@dataclass(frozen=True)
class TrustRegionLoopSetup:
    """What experiment (i) runs (the documented run; :data:`QUICK` is the lab's default)."""

    steps: int = 12
    """Optimizer steps per run (on-policy: one rollout batch a step)."""
    noise_levels: tuple[float, ...] = (0.0, 0.75, 1.5)
    """The engine's ``logit_noise_std`` of each level, fixed over a run."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """``train.seed`` of each run (prompts and sampling noise; the initial policy is the job's, the same for all)."""
    arms: tuple[str, ...] = tuple(ARMS)
    """Names from :data:`ARMS`."""
    extra_overrides: tuple[str, ...] = ("parallel.tensor_model_parallel_size=1", "parallel.sequence_format=padded",
                                        "output.progress_bar=false", "train.micro_batch_size=12")
    """Job-config overrides applied to every run (TP = 1: one process; padded: a row per sequence; 24 sequences a
    step: 3 prompts × 8 completions of 6 tokens)."""


QUICK = TrustRegionLoopSetup(steps=2, noise_levels=(0.0, 1.5), seeds=(0, 1))
"""The lab's default for (i): every arm at σ = 0 and 1.5, two seeds, 2 steps (``--full``: the documented run)."""


# ---------------------------------------------------------------------------------------------- the statistics
def policy_logprobs(policy: torch.nn.Module, mb, temperature: float) -> torch.Tensor:
    """``[B, S, V]`` float64 log-softmax of the policy's logits / temperature at a padded micro-batch's positions."""
    with torch.no_grad():
        logits = policy(mb.input_ids, mb.position_ids)
    return torch.log_softmax(logits.double() / temperature, dim=-1)


def topk_tv(full: torch.Tensor, top) -> torch.Tensor:
    """Float64 top-K TV per position of ``full`` (``[B, S, V]`` log-probs of the trainer) against the engine's top-K
    (a :class:`~mp_grpo.megatron.micro_batch.RolloutTopK`, CSR over the ``[B, S]`` positions): ½ (Σ_k |π(k) − μ(k)|
    + |rest_π − rest_μ|) with rest = max(1 − Σ_k p(k), 1e-12) — written out here, not taken from the loss."""
    flat = full.reshape(-1, full.shape[-1])
    counts = (top.ids.indptr[1:] - top.ids.indptr[:-1])
    position = torch.repeat_interleave(torch.arange(flat.shape[0]), counts, output_size=top.ids.nnz)
    pi = flat[position, top.ids.ids].exp()
    mu = top.logprobs.double().exp()
    per = torch.zeros(flat.shape[0], dtype=torch.float64)
    sum_pi = per.index_add(0, position, pi)
    sum_mu = per.index_add(0, position, mu)
    body = per.index_add(0, position, (pi - mu).abs())
    rest_pi, rest_mu = (1.0 - sum_pi).clamp(min=1e-12), (1.0 - sum_mu).clamp(min=1e-12)
    return (0.5 * (body + (rest_pi - rest_mu).abs())).view(full.shape[:-1])


def masked_by_rule(loss_cfg, lp: torch.Tensor, mu: torch.Tensor, adv: torch.Tensor, divergence: torch.Tensor | None
                   ) -> torch.Tensor:
    """Bool per token: whether the arm's rule takes the token's policy gradient away at π_θ = ``lp``, μ = ``mu``
    (float64 log-probs), advantages ``adv`` — the ratio clip's active side, or the trust region's drop (``divergence``
    given for top-K modes; the binary TV |π − μ| otherwise)."""
    from mp_grpo.config.loss import TrustRegion, TrustRegionDirection

    tr = loss_cfg.trust_region
    if tr.mode == TrustRegion.NONE:  # PPO's clip on r = π_θ/μ
        clamp = loss_cfg.policy.log_ratio_clamp
        r = (lp - mu).clamp(-clamp, clamp).exp() if clamp is not None else (lp - mu).exp()
        low, high = loss_cfg.policy.eps_low, loss_cfg.policy.eps_high
        return ((r < 1 - low) & (adv < 0) if low is not None else torch.zeros_like(adv, dtype=torch.bool)) | \
               ((r > 1 + high) & (adv > 0) if high is not None else torch.zeros_like(adv, dtype=torch.bool))
    if tr.mode == TrustRegion.BINARY_TV:
        divergence = (lp.exp() - mu.exp()).abs()
    elif tr.mode != TrustRegion.TOPK_TV:
        raise ValueError(f"masked_by_rule: trust_region.mode={tr.mode.value} is not one of this experiment's arms")
    up, down = lp > mu, lp < mu
    over_high = divergence > tr.delta_high if tr.delta_high is not None else torch.zeros_like(up)
    over_low = divergence > tr.delta_low if tr.delta_low is not None else torch.zeros_like(up)
    if tr.direction == TrustRegionDirection.DIRECTIONAL:
        return (up & over_high & (adv > 0)) | (down & over_low & (adv <= 0))
    return (up & over_high) | (down & over_low)


def rollout_statistics(policy: torch.nn.Module, micro: list, loss_cfg, temperature: float) -> dict:
    """Over the trained tokens of a rollout batch's padded micro-batches, in float64 from the policy's logits:
    vllm-kl (mean k3 of d = log π_θ − log μ), the token IS ratio e^d's mean, standard deviation, smallest and largest,
    the fraction of tokens with |π_θ − μ| > 0.15 and the fraction the arm's rule masks (:func:`masked_by_rule`; the
    top-K arm's divergence from :func:`topk_tv`)."""
    from mp_grpo.config.loss import TrustRegion

    parts: dict[str, list[torch.Tensor]] = {"d": [], "masked": [], "tv": []}
    for mb in micro:
        full = policy_logprobs(policy, mb, temperature)
        valid = mb.loss_mask
        lp = full.gather(-1, torch.where(valid, mb.targets, 0).unsqueeze(-1)).squeeze(-1)
        mu = mb.rollout_logprobs.double()
        adv = mb.advantages if mb.advantages.shape == valid.shape else mb.sequences.broadcast(mb.advantages, valid.shape)
        divergence = topk_tv(full, mb.rollout_top_k) if loss_cfg.trust_region.mode == TrustRegion.TOPK_TV else None
        masked = masked_by_rule(loss_cfg, lp, mu, adv.double(), divergence)
        parts["d"].append((lp - mu)[valid])
        parts["masked"].append(masked[valid])
        parts["tv"].append((lp.exp() - mu.exp()).abs()[valid])
    d, masked, tv = (torch.cat(parts[k]) for k in ("d", "masked", "tv"))
    ratio = d.exp()
    return {"tokens": int(d.numel()), "vllm_kl": float((d.exp() - d - 1).mean()),
            "is_ratio_mean": float(ratio.mean()), "is_ratio_std": float(ratio.std(unbiased=False)),
            "is_ratio_min": float(ratio.min()), "is_ratio_max": float(ratio.max()),
            "binary_tv_over_delta": float((tv > 0.15).double().mean()), "expected_masked": int(masked.sum())}


def masked_fraction(metrics: dict) -> float:
    """The loss's fraction of valid tokens without a policy gradient: the trust region's drop, or the clip's active
    sides (``clip_frac/low`` + ``/high``, disjoint) for ``ppo_clip`` without a trust region."""
    if "rejected_frac/trust_region" in metrics:
        return float(metrics["rejected_frac/trust_region"])
    return float(metrics["clip_frac/low"]) + float(metrics["clip_frac/high"])


def _nonfinite(record: dict) -> int:
    numbers = [record["reward"], record["grad_norm"], *record["metrics"].values()]
    return sum(1 for x in numbers if not math.isfinite(float(x)))


# ---------------------------------------------------------------------------------------------- the runs
def job_config(arm: str, overrides: list[str]):
    """The job config of ``arm``: ``grpo_cpu.yaml`` with its ``loss`` section replaced by the arm's, then ``overrides``
    and the arm's own."""
    from omegaconf import OmegaConf

    from mp_grpo.config.job import load_job_config
    from mp_grpo.train import loop

    path = Path(loop.__file__).resolve().parent / "configs" / "grpo_cpu.yaml"
    raw = OmegaConf.load(path)
    raw.loss = {}
    raw.loss_preset = ARMS[arm]["preset"]
    return load_job_config(raw, [*overrides, *ARMS[arm]["overrides"]]), path.name


def run(setup: TrustRegionLoopSetup = TrustRegionLoopSetup()) -> dict:
    """Every (level, seed, arm) run's per-step records; JSON-ready."""
    from mp_grpo.train import loop

    unknown = sorted(set(setup.arms) - set(ARMS))
    if unknown:
        raise ValueError(f"setup.arms: unknown {unknown}; allowed: {sorted(ARMS)}")
    runs = []
    config_name = None
    for sigma in setup.noise_levels:
        for seed in setup.seeds:
            for arm in setup.arms:
                # --- 1. the arm's config ---
                overrides = [f"train.steps={setup.steps}", f"train.seed={seed}", f"engine.logit_noise_std={sigma}",
                             *setup.extra_overrides]
                cfg, config_name = job_config(arm, overrides)
                # --- 2. the run, its rollout batches measured as the steps train on them ---
                held: dict = {}
                rollouts: list[dict] = []

                def keep(trainer, held=held) -> None:
                    held["policy"] = trainer.policy

                def measure(micro, cfg=cfg, held=held, rollouts=rollouts) -> None:
                    rollouts.append(rollout_statistics(held["policy"], micro, cfg.loss, cfg.rollout.temperature))

                start = time.perf_counter()
                records = loop.run(cfg, on_trainer=keep, on_rollout=measure)
                # --- 3. the curves ---
                steps = [{"step": r["step"], "reward": float(r["reward"]), "grad_norm": float(r["grad_norm"]),
                          "masked_frac": masked_fraction(r["metrics"]),
                          "ratio_min": float(r["metrics"]["ratio/min"]), "ratio_max": float(r["metrics"]["ratio/max"]),
                          "vllm_kl_loss": float(r["metrics"]["mismatch/k3"]),
                          "nonfinite_inputs": float(r["metrics"]["nonfinite_inputs"]), "nonfinite": _nonfinite(r),
                          "skipped": bool(r["skipped"]), **stats} for r, stats in zip(records, rollouts)]
                runs.append({"arm": arm, "noise_std": sigma, "seed": seed, "overrides": overrides,
                             "preset": ARMS[arm]["preset"], "arm_overrides": ARMS[arm]["overrides"],
                             "seconds": round(time.perf_counter() - start, 1), "steps": steps})
                print(f"(i) σ={sigma:g} seed {seed} {arm}: reward {steps[0]['reward']:.3f} → {steps[-1]['reward']:.3f}, "
                      f"masked {sum(s['masked_frac'] for s in steps) / len(steps):.3f}", flush=True)
    return {"experiment": "trust_region_loop", "config": config_name, "setup": dataclasses.asdict(setup), "runs": runs}


# ---------------------------------------------------------------------------------------------- the tables
def summary(result: dict) -> list[dict]:
    """One row per (level, arm), over its seeds: the final reward (mean, and its spread over seeds), the mean reward
    over every step, the grad norm's mean, standard deviation and largest value over every step, the masked
    fraction, vllm-kl, the token IS ratio's standard deviation and largest value (means over steps and seeds), the
    non-finite numbers and the steps whose loss metric differs from the float64 masked count."""
    rows = []
    keys = sorted({(r["noise_std"], r["arm"]) for r in result["runs"]},
                  key=lambda k: (k[0], list(ARMS).index(k[1]) if k[1] in ARMS else 99))
    for sigma, arm in keys:
        runs = [r for r in result["runs"] if r["noise_std"] == sigma and r["arm"] == arm]
        steps = [s for r in runs for s in r["steps"]]
        finals = [r["steps"][-1]["reward"] for r in runs]
        grads = [s["grad_norm"] for s in steps]

        def mean(key: str) -> float:
            return sum(s[key] for s in steps) / len(steps)

        rows.append({"noise_std": sigma, "arm": arm, "seeds": len(runs), "steps": len(runs[0]["steps"]),
                     "final_reward": statistics.fmean(finals),
                     "final_reward_std": statistics.pstdev(finals) if len(finals) > 1 else 0.0,
                     "mean_reward": mean("reward"), "grad_norm_mean": statistics.fmean(grads),
                     "grad_norm_std": statistics.pstdev(grads), "grad_norm_max": max(grads),
                     "masked_frac": mean("masked_frac"), "vllm_kl": mean("vllm_kl"),
                     "is_ratio_std": mean("is_ratio_std"), "is_ratio_max": max(s["is_ratio_max"] for s in steps),
                     "nonfinite": sum(s["nonfinite"] for s in steps) + round(sum(s["nonfinite_inputs"] for s in steps)),
                     "mask_mismatch_steps": sum(1 for s in steps if abs(s["masked_frac"] * s["tokens"]
                                                                         - s["expected_masked"]) > 0.5)})
    return rows


def table(result: dict) -> str:
    """The markdown summary table (see :func:`summary`)."""
    lines = ["| σ (engine logit noise) | arm | final reward (± over seeds) | mean reward, all steps | grad norm mean "
             "± std (max) | tokens masked | vllm-kl | IS ratio π_θ/μ: std (max) | NaN / Inf |", "|" + "---|" * 9]
    for r in summary(result):
        lines.append(f"| {r['noise_std']:g} | {r['arm']} | {r['final_reward']:.3f} ± {r['final_reward_std']:.3f} "
                     f"| {r['mean_reward']:.3f} | {r['grad_norm_mean']:.3g} ± {r['grad_norm_std']:.2g} "
                     f"({r['grad_norm_max']:.3g}) | {r['masked_frac']:.1%} | {r['vllm_kl']:.3g} "
                     f"| {r['is_ratio_std']:.3g} ({r['is_ratio_max']:.3g}) | {r['nonfinite']} |")
    return "\n".join(lines)


def steps_table(result: dict, key: str, fmt: str) -> str:
    """One row per (level, arm), one column per step: ``key``'s mean over the seeds."""
    rows = summary(result)
    n = rows[0]["steps"]
    lines = ["| σ | arm | " + " | ".join(str(i) for i in range(n)) + " |", "|" + "---|" * (n + 2)]
    for row in rows:
        runs = [r for r in result["runs"] if r["noise_std"] == row["noise_std"] and r["arm"] == row["arm"]]
        cells = [statistics.fmean(r["steps"][i][key] for r in runs) for i in range(n)]
        lines.append(f"| {row['noise_std']:g} | {row['arm']} | " + " | ".join(f"{c:{fmt}}" for c in cells) + " |")
    return "\n".join(lines)


def report(result: dict) -> str:
    """The markdown of ``trust_region_loop.md``: the summary, then the reward and the masked fraction per step."""
    setup = result["setup"]
    checked = sum(r["mask_mismatch_steps"] for r in summary(result))
    return "\n\n".join([
        f"{len(setup['seeds'])} seeds × {setup['steps']} steps per (σ, arm); means over seeds (reward, masked "
        "fraction, vllm-kl, IS ratio: over steps too); grad norm before clipping (clip at 1.0), over every step of "
        f"every seed. Steps whose masked count differs from the float64 recomputation: {checked}.",
        table(result), "Reward per step (mean over seeds):", steps_table(result, "reward", ".3f"),
        "Fraction of tokens masked per step (mean over seeds):", steps_table(result, "masked_frac", ".3f")])


def plot(result: dict, path: Path) -> None:
    """Reward per step (mean over seeds), one panel per mismatch level, one line per arm; and the masked fraction."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["setup"]["noise_levels"]
    fig, axes = plt.subplots(2, len(levels), figsize=(4.2 * len(levels), 6.4), squeeze=False, sharex=True)
    for j, sigma in enumerate(levels):
        for arm in result["setup"]["arms"]:
            runs = [r for r in result["runs"] if r["noise_std"] == sigma and r["arm"] == arm]
            n = len(runs[0]["steps"])
            for i, key in enumerate(("reward", "masked_frac")):
                axes[i][j].plot(range(n), [statistics.fmean(r["steps"][s][key] for r in runs) for s in range(n)],
                                "o-", ms=3, label=arm)
        axes[0][j].set_title(f"engine logit noise σ = {sigma:g}")
        axes[1][j].set_xlabel("optimizer step")
    axes[0][0].set_ylabel("mean reward (mean over seeds)")
    axes[1][0].set_ylabel("tokens without policy gradient")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("(i) ratio clip vs DPPO binary TV vs top-K TV trust region, anchored on the engine's μ")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
