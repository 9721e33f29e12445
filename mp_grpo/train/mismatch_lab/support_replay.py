"""Experiment (h): no replay vs a recomputed filter vs the engine's captured support, at top-p 0.95 and top-k 50.

An engine that samples with a filter reports log-probs of the truncated, renormalized distribution. The trainer can
(1) take its log-probs over the whole vocabulary (no replay): every token ratio π_trainer / π_engine is then the
kept mass S of its position — TRL #6789's closed form, log ratio = log S — (2) recompute the filter from its own
logits (``SamplingFilter``, (e) / (f)): its kept set is the engine's only where both numerics put the boundary at
the same token, or (3) replay the set the engine sampled from (``CapturedSupport``, vLLM #49577's ``SamplingMask``).
This experiment measures the three on the learning job's policy and engine, and the boundary disagreements between
the recomputed filter and the captured set.

Schedule of :func:`run`

    1. The learning job's CPU config at TP = 1 with a vocabulary of ``vocab_size`` ids (top-k 50 must cut: the job's
       own 32 would keep everything) and its initial policy (fp32).
    2. For every engine dtype and filter: the :class:`~mp_grpo.train.rollout.RolloutEngine` with the filter samples
       ``batches`` rollout batches of the job and captures each sampled token's kept set (``capture_support``).
    3. The trainer's log-probs of the sampled tokens three ways (``vocab_parallel_logprobs``, ``check_inputs=False``):
       the whole vocabulary; the filter recomputed (``sampling_filter=``); the captured support
       (``captured_support=``); and, on the whole vocabulary, log S = the trainer's mass of the captured set.
    4. Per (dtype, filter, trainer): (e)'s statistics of d = clamp(trainer − engine, ±20) on the completion tokens
       (vllm-kl, token / sequence IS means, the smallest token ratio, tokens at −inf); for no replay the mean d
       against the mean log S and the largest |d − log S| (what the engine's numerics add); for the recomputed filter
       the tokens whose kept set differs from the captured one, the ids that differ (mean per such token), and the
       sampled tokens outside the recomputed set.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

TRAINER_MODES = ("full vocabulary (no replay)", "recomputed filter (SamplingFilter)",
                 "captured support (CapturedSupport)")
"""How the trainer computes its log-probs in step 3."""
FILTERS = {"top_p 0.95": dict(top_p=0.95), "top_k 50": dict(top_k=50)}
"""The engine's filters (``engine.top_p`` / ``engine.top_k``), as named in the tables."""


@dataclass(frozen=True)
class SupportReplaySetup:
    """What experiment (h) runs (the documented run; :data:`QUICK` is the lab's default)."""

    filters: tuple[str, ...] = ("top_p 0.95", "top_k 50")
    """Keys of :data:`FILTERS`."""
    engine_dtypes: tuple[str, ...] = ("bf16", "fp32")
    """The engine's weight dtypes: bf16 as the job; fp32 isolates the filter from the numerics."""
    batches: int = 4
    """Rollout batches per (dtype, filter) (the job's 48 sequences × 6 completion tokens each)."""
    vocab_size: int = 256
    """The policy's vocabulary (and the task's modulus): top-k 50 keeps a fifth of it."""
    extra_overrides: tuple[str, ...] = ()
    """Job-config overrides applied on top of ``grpo_cpu.yaml`` (e.g. a smaller batch in tests)."""


QUICK = SupportReplaySetup(engine_dtypes=("bf16",), batches=1)
"""The lab's default for (h): bf16 engine, both filters, one rollout batch (``--full``: the documented run)."""


def _shifted(support, tokens: torch.Tensor):
    """The captured support of the tokens at positions 1 .. S - 1 (the logit at s - 1 scores the token at s): the CSR
    rows of ``[N, S]`` without each row's first position."""
    from mp_grpo.ops.token_ids import CapturedSupport

    n, width = tokens.shape
    keep = torch.ones(n, width, dtype=torch.bool)
    keep[:, 0] = False
    counts = (support.indptr[1:] - support.indptr[:-1]).view(n, width)
    entry_position = torch.repeat_interleave(torch.arange(n * width), counts.reshape(-1), output_size=support.nnz)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts[:, 1:].reshape(-1).cumsum(0)])
    return CapturedSupport(indptr, support.ids[keep.reshape(-1)[entry_position]])


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        return model(tokens, positions)[:, :-1].contiguous()  # the logit at s - 1 scores the token at s


def _trainer(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, temperature: float, **replay):
    """``[N, S]`` fp32 trainer log-probs of the completion tokens (0 elsewhere), restricted as ``replay`` says."""
    from mp_grpo import vocab_parallel_logprobs

    target = torch.where(mask[:, 1:], tokens[:, 1:], torch.full_like(tokens[:, 1:], -100))
    lp = vocab_parallel_logprobs(logits, target, temperature=temperature, check_inputs=False, **replay)
    return torch.cat([torch.zeros(lp.shape[0], 1, dtype=lp.dtype), lp], dim=1)


def _dense(support, shape: torch.Size) -> torch.Tensor:
    """A CSR as a ``shape`` (``[..., V]``) bool mask (rows without ids: all False)."""
    rows = torch.repeat_interleave(torch.arange(support.num_tokens), support.indptr.diff(), output_size=support.nnz)
    keep = torch.zeros(support.num_tokens, shape[-1], dtype=torch.bool)
    keep[rows, support.ids] = True
    return keep.view(shape)


def boundary_statistics(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, support, filt,
                        temperature: float) -> dict:
    """The recomputed filter's kept set (mp_grpo's threshold search on the trainer's logits) against the engine's
    captured one, over the completion tokens: the tokens whose sets differ, the ids that differ (summed), the sampled
    tokens outside the recomputed set (log-prob -inf for the trainer), the captured ids (summed) and the tokens."""
    from mp_grpo.ops.sampling_filter import filter_threshold

    x = logits.reshape(-1, logits.shape[-1])
    tau = filter_threshold(x, filt, torch.Size([x.shape[0]]), tp_group=None, inv_temperature=1.0 / temperature)
    recomputed = (x >= tau[:, None]).view(logits.shape)
    captured = _dense(support, logits.shape)
    trained = mask[:, 1:]
    differ = (recomputed != captured).sum(-1)[trained]
    sampled = tokens[:, 1:].clamp(min=0).unsqueeze(-1)
    outside = ~recomputed.gather(-1, sampled).squeeze(-1)[trained]
    return {"tokens_where_sets_differ": int((differ > 0).sum()), "differing_ids": int(differ.sum()),
            "sampled_outside_recomputed_filter": int(outside.sum()),
            "captured_ids": int(captured.sum(-1)[trained].sum()),
            "tokens": int(trained.sum())}


def kept_mass_statistics(logits: torch.Tensor, full: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor,
                         support, temperature: float) -> dict:
    """TRL #6789's closed form on the completion tokens: the trainer's full-vocabulary log ratio d = full − engine
    against log S, S the trainer's mass of the engine's captured set (mean of each; the largest |d − log S|)."""
    z = logits.double() / temperature
    captured = _dense(support, logits.shape)
    log_s = torch.logsumexp(torch.where(captured, z, float("-inf")), -1) - torch.logsumexp(z, -1)
    trained = mask[:, 1:]
    d = (full.double() - engine.double())[:, 1:][trained]
    log_s = log_s[trained]
    return {"mean_log_ratio": float(d.mean()), "mean_log_kept_mass": float(log_s.mean()),
            "mean_kept_mass": float(log_s.exp().mean()), "max_abs_log_ratio_minus_log_kept_mass":
            float((d - log_s).abs().max())}


def run(setup: SupportReplaySetup = SupportReplaySetup()) -> dict:
    """One row per (engine dtype, filter, trainer mode); JSON-ready."""
    from mp_grpo.config.job import EngineConfig, EngineDtype
    from mp_grpo.ops import SamplingFilter
    from mp_grpo.train.mismatch_lab.top_p_replay import job_policy, mismatch_statistics
    from mp_grpo.train.rollout import RolloutEngine
    from mp_grpo.train.task import make_prompts

    # --- 1. the job's config with a wider vocabulary, its initial policy, TP = 1 ---
    cfg, config_path, stand_in = job_policy([f"model.vocab_size={setup.vocab_size}", *setup.extra_overrides])
    policy = stand_in().eval()
    n = cfg.train.num_microbatches * cfg.train.micro_batch_size
    g, temperature = cfg.rollout.group_size, cfg.rollout.temperature
    modulus = cfg.task.modulus or cfg.model.vocab_size
    rows = []
    for dtype in setup.engine_dtypes:
        for name in setup.filters:
            knobs = FILTERS[name]
            filt = SamplingFilter(**knobs)
            # --- 2. the engine's rollouts with this filter, each token's kept set captured ---
            engine = RolloutEngine(stand_in(), EngineConfig(dtype=EngineDtype(dtype), **knobs),
                                   temperature=temperature, seed=cfg.train.seed, tp_group=None)
            engine.sync_weights(policy)
            parts: dict[str, list] = {m: [] for m in TRAINER_MODES}
            mass, boundary = [], []
            for b in range(setup.batches):
                prompts, lengths = make_prompts(num_prompts=n // g, min_length=cfg.rollout.prompt_min_length,
                                                max_length=cfg.rollout.prompt_max_length, modulus=modulus,
                                                seed=cfg.train.seed, step=b)
                gen = engine.generate(prompts.repeat_interleave(g, 0), lengths.repeat_interleave(g),
                                      completion_length=cfg.task.completion_length, step=b,
                                      sequence_ids=torch.arange(n), capture_support=True)
                support = _shifted(gen.support, gen.tokens)
                logits = _logits(policy, gen.tokens)
                # --- 3. the trainer's log-probs three ways ---
                replays = ({}, {"sampling_filter": filt}, {"captured_support": support})
                for mode, replay in zip(TRAINER_MODES, replays):
                    trainer = _trainer(logits, gen.tokens, gen.completion_mask, temperature, **replay)
                    parts[mode].append((trainer, gen.rollout_logprobs, gen.completion_mask))
                full = parts[TRAINER_MODES[0]][-1][0]
                mass.append(kept_mass_statistics(logits, full, gen.rollout_logprobs, gen.completion_mask, support,
                                                 temperature))
                boundary.append(boundary_statistics(logits, gen.tokens, gen.completion_mask, support, filt,
                                                    temperature))
            # --- 4. the statistics over all batches ---
            for mode, batch_parts in parts.items():
                trainer, rollout, mask = (torch.cat([p[i] for p in batch_parts]) for i in range(3))
                row = {"engine_dtype": dtype, "filter": name, "trainer": mode,
                       **mismatch_statistics(trainer, rollout, mask, cfg.loss.policy.log_ratio_clamp)}
                if mode == TRAINER_MODES[0]:
                    row |= {k: sum(m[k] for m in mass) / len(mass) for k in mass[0] if not k.startswith("max")}
                    row["max_abs_log_ratio_minus_log_kept_mass"] = max(m["max_abs_log_ratio_minus_log_kept_mass"]
                                                                       for m in mass)
                elif mode == TRAINER_MODES[1]:
                    total = {k: sum(m[k] for m in boundary) for k in boundary[0]}
                    differ = total["tokens_where_sets_differ"]
                    row |= {"tokens_where_sets_differ": differ,
                            "differing_ids_per_such_token": total["differing_ids"] / max(differ, 1),
                            "sampled_outside_recomputed_filter": total["sampled_outside_recomputed_filter"],
                            "captured_ids_mean": total["captured_ids"] / total["tokens"]}
                rows.append(row)
            print(f"(h) engine {dtype}, {name}: token IS mean {rows[-3]['token_is_mean']:.4g} (no replay), "
                  f"{rows[-2]['token_is_mean']:.4g} (recomputed filter), {rows[-1]['token_is_mean']:.4g} (captured "
                  f"support)", flush=True)
    return {"experiment": "support_replay", "config": config_path.name, "setup": dataclasses.asdict(setup),
            "temperature": temperature, "rows": rows}


def report(result: dict) -> str:
    """The markdown tables of (h): the three trainers per (engine, filter), then the no-replay bias against log S and
    the recomputed filter's boundary disagreements."""
    lines = ["| engine | filter | trainer log-probs | tokens | vllm-kl (k3) | token IS mean | min token IS "
             "| sequence IS mean | tokens at −inf |", "|" + "---|" * 9]
    for r in result["rows"]:
        lines.append(f"| {r['engine_dtype']} | {r['filter']} | {r['trainer']} | {r['tokens']} | {r['vllm_kl_k3']:.3g} "
                     f"| {r['token_is_mean']:.4g} | {r['token_is_min']:.3g} | {r['sequence_is_mean']:.4g} "
                     f"| {r['outside_trainer_filter']} |")
    lines += ["", "No replay: the mean log ratio against the mean log S (S: the trainer's mass of the captured set)",
              "", "| engine | filter | mean kept mass S | mean log S | mean log ratio "
              "| largest \\|log ratio − log S\\| |",
              "|" + "---|" * 6]
    for r in result["rows"]:
        if r["trainer"] == TRAINER_MODES[0]:
            lines.append(f"| {r['engine_dtype']} | {r['filter']} | {r['mean_kept_mass']:.4f} "
                         f"| {r['mean_log_kept_mass']:.4f} | {r['mean_log_ratio']:.4f} "
                         f"| {r['max_abs_log_ratio_minus_log_kept_mass']:.2e} |")
    lines += ["", "Recomputed filter against the captured set (completion tokens)", "",
              "| engine | filter | mean ids captured | tokens whose sets differ | ids that differ, per such token "
              "| sampled tokens outside the recomputed set |", "|" + "---|" * 6]
    for r in result["rows"]:
        if r["trainer"] == TRAINER_MODES[1]:
            lines.append(f"| {r['engine_dtype']} | {r['filter']} | {r['captured_ids_mean']:.1f} "
                         f"| {r['tokens_where_sets_differ']} of {r['tokens']} "
                         f"| {r['differing_ids_per_such_token']:.2f} "
                         f"| {r['sampled_outside_recomputed_filter']} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Token IS mean per (engine, filter) for the three trainers, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["engine_dtype"], r["filter"]) for r in result["rows"]}, key=lambda k: (k[0], k[1]))
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    width = 0.26
    for i, mode in enumerate(TRAINER_MODES):
        values = [next(r["token_is_mean"] for r in result["rows"] if (r["engine_dtype"], r["filter"]) == key
                       and r["trainer"] == mode) for key in groups]
        ax.bar([j + (i - 1) * width for j in range(len(groups))], values, width, label=mode)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), [f"{d} engine\n{f}" for d, f in groups])
    ax.set_ylabel("token IS ratio mean")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("(h) trainer / engine token ratio: no replay, recomputed filter, captured support")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
