"""Experiment (e): the top-p sampling-filter mismatch, and what replaying the filter in the trainer removes.

An inference engine that samples with top-p reports log-probs of the truncated, renormalized
distribution; a trainer that computes full-vocabulary log-probs sees every token ratio
π_trainer / π_engine = (kept mass) < 1 — a systematic mismatch that rollout correction then has to
absorb (TRL #6789 measured a mean IS ratio of 0.896 at top_p = 0.8). mp_grpo's
``vocab_parallel_logprobs(..., sampling_filter=SamplingFilter(top_p=p))`` replays the filter
vocab-parallel. This experiment measures both on the learning job's own policy and rollout engine.

Schedule of :func:`run`

    1. The learning job's CPU config (``mp_grpo/train/configs/grpo_cpu.yaml``) at TP = 1: the policy
       (the CPU stand-in with the job's initial weights, fp32) in a world of one.
    2. For every engine dtype and top_p: a :class:`~mp_grpo.train.rollout.RolloutEngine` with
       ``engine.top_p = p`` and the weights synced from the policy samples ``batches`` rollout batches
       of the job (prompts keyed by (seed, batch index), G completions each) and reports their log-probs.
    3. The trainer's log-probs of the same tokens twice, with ``mp_grpo.vocab_parallel_logprobs``:
       over the full vocabulary (what the learning loop does: no replay) and with
       ``sampling_filter=SamplingFilter(top_p=p)`` (replay; ``check_inputs=False``, so a sampled token
       outside the trainer's own nucleus gets −inf and is counted instead of raising).
    4. Per (dtype, top_p, trainer): with d = clamp(trainer − engine, ±``policy.log_ratio_clamp``) on
       the completion tokens (mp_grpo's formulas): vllm-kl = mean k3(d) (``mismatch/k3``), the token
       IS-ratio mean = mean e^d, the sequence IS-ratio mean = mean over sequences of e^{clamp(Σd)}, the
       smallest token ratio, the count of tokens outside the trainer's nucleus (trainer log-prob −inf,
       d clamped to −20) and vllm-kl over the tokens inside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

TRAINER_MODES = ("full vocabulary (no replay)", "replayed SamplingFilter(top_p)")
"""How the trainer computes its log-probs in step 3."""


@dataclass(frozen=True)
class TopPReplaySetup:
    """What experiment (e) runs (the documented run; :data:`QUICK` is the lab's default)."""

    top_ps: tuple[float, ...] = (1.0, 0.95, 0.8)
    """The engine's top_p values; 1.0 is the control (no filter: only the engine's dtype differs)."""
    engine_dtypes: tuple[str, ...] = ("bf16", "fp32")
    """The engine's weight dtypes (``engine.dtype``): bf16 as the job; fp32 isolates the filter."""
    batches: int = 4
    """Rollout batches per (dtype, top_p) (the job's 48 sequences × 6 completion tokens each)."""
    extra_overrides: tuple[str, ...] = ()
    """Job-config overrides applied on top of ``grpo_cpu.yaml`` (e.g. a smaller batch in tests)."""


QUICK = TopPReplaySetup(top_ps=(0.95, 0.8), engine_dtypes=("bf16",), batches=1)
"""The lab's default for (e): bf16 engine, top_p 0.95 and 0.8, one rollout batch (``--full``: the documented run)."""


def _trainer_logprobs(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor, temperature: float,
                      top_p: float | None) -> torch.Tensor:
    """``[N, S]`` float32 trainer log-probs of the completion tokens (0 elsewhere); with ``top_p`` the filter replayed."""
    from mp_grpo import vocab_parallel_logprobs
    from mp_grpo.ops import SamplingFilter

    with torch.no_grad():
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        logits = model(tokens, positions)[:, :-1].contiguous()  # the logit at s - 1 scores the token at s
    target = torch.where(mask[:, 1:], tokens[:, 1:], torch.full_like(tokens[:, 1:], -100))
    filt = None if top_p is None else SamplingFilter(top_p=top_p)
    lp = vocab_parallel_logprobs(logits, target, temperature=temperature, check_inputs=False, sampling_filter=filt)
    return torch.cat([torch.zeros(lp.shape[0], 1, dtype=lp.dtype), lp], dim=1)


def mismatch_statistics(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, clamp: float | None) -> dict:
    """vllm-kl, token and sequence IS-ratio means, the smallest token ratio and the tokens with trainer
    log-prob −inf, over the valid tokens of ``[N, S]`` log-probs (mp_grpo's clamped d = trainer − engine);
    ``vllm_kl_k3_inside``: vllm-kl over the valid tokens whose trainer log-prob is finite."""
    from mp_grpo.loss.clamps import symmetric_clamp
    from mp_grpo.loss.mismatch import k3
    from mp_grpo.loss.rollout_correction import token_log_ratio

    d = token_log_ratio(trainer.double(), engine.double(), mask, clamp)
    outside = torch.isneginf(trainer) & mask  # sampled by the engine, outside the trainer's own nucleus
    inside = mask & ~outside
    n = int(mask.sum())
    token_ratio = torch.where(mask, d.exp(), torch.zeros_like(d))
    seq_ratio = symmetric_clamp(d.sum(1), clamp).exp()
    return {"tokens": n, "sequences": int(mask.shape[0]),
            "vllm_kl_k3": float(torch.where(mask, k3(d), torch.zeros_like(d)).sum() / n),
            "token_is_mean": float(token_ratio.sum() / n),
            "token_is_min": float(torch.where(mask, token_ratio, torch.full_like(d, float("inf"))).min()),
            "sequence_is_mean": float(seq_ratio.mean()),
            "outside_trainer_filter": int(outside.sum()),
            "vllm_kl_k3_inside": float(torch.where(inside, k3(d), torch.zeros_like(d)).sum() / max(int(inside.sum()), 1))}


class JobPolicy(NamedTuple):
    """The learning job's config, its path and a factory of its initial policy (the CPU stand-in, fp32, TP = 1)."""

    cfg: object
    config_path: Path
    stand_in: Callable[[], torch.nn.Module]


def job_policy(overrides: tuple[str, ...] | list[str]) -> JobPolicy:
    """The job's CPU config (``grpo_cpu.yaml``) at TP = 1 with ``overrides``, in a world of one, and its initial
    policy's factory (the experiments' step 1)."""
    from mp_grpo.config.job import load_job_config
    from mp_grpo.train import loop
    from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config, random_full_weights

    config_path = Path(loop.__file__).resolve().parent / "configs" / "grpo_cpu.yaml"
    cfg = load_job_config(config_path, ["parallel.tensor_model_parallel_size=1", *overrides])
    loop.setup_distributed()  # a world of one (megatron-core's layers want a process group)
    import torch.distributed as dist

    model_config = cpu_model_config(hidden_size=cfg.model.hidden_size)
    weights = random_full_weights(model_config, vocab_size=cfg.model.vocab_size,
                                  max_sequence_length=cfg.model.max_sequence_length, seed=cfg.model.init_seed)

    def stand_in() -> CpuGPTStandIn:
        m = CpuGPTStandIn(model_config, vocab_size=cfg.model.vocab_size,
                          max_sequence_length=cfg.model.max_sequence_length, tp_group=dist.group.WORLD)
        m.load_full_weights(weights)
        return m

    return JobPolicy(cfg, config_path, stand_in)


def run(setup: TopPReplaySetup = TopPReplaySetup()) -> dict:
    """One row per (engine dtype, top_p, trainer mode); JSON-ready."""
    from mp_grpo.config.job import EngineConfig, EngineDtype
    from mp_grpo.train.rollout import RolloutEngine
    from mp_grpo.train.task import make_prompts

    # --- 1. the job's config and initial policy, TP = 1 ---
    cfg, config_path, stand_in = job_policy(setup.extra_overrides)
    policy = stand_in().eval()
    n = cfg.train.num_microbatches * cfg.train.micro_batch_size
    g, temperature = cfg.rollout.group_size, cfg.rollout.temperature
    modulus = cfg.task.modulus or cfg.model.vocab_size
    rows = []
    for dtype in setup.engine_dtypes:
        for top_p in setup.top_ps:
            # --- 2. the engine's rollouts at this top_p ---
            engine = RolloutEngine(stand_in(), EngineConfig(dtype=EngineDtype(dtype), top_p=top_p),
                                   temperature=temperature, seed=cfg.train.seed, tp_group=None)
            engine.sync_weights(policy)
            per_mode: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {m: [] for m in TRAINER_MODES}
            for b in range(setup.batches):
                prompts, lengths = make_prompts(num_prompts=n // g, min_length=cfg.rollout.prompt_min_length,
                                                max_length=cfg.rollout.prompt_max_length, modulus=modulus,
                                                seed=cfg.train.seed, step=b)
                gen = engine.generate(prompts.repeat_interleave(g, 0), lengths.repeat_interleave(g),
                                      completion_length=cfg.task.completion_length, step=b, sequence_ids=torch.arange(n))
                # --- 3. the trainer's log-probs without and with the replay ---
                for mode, replay in zip(TRAINER_MODES, (None, top_p)):
                    trainer = _trainer_logprobs(policy, gen.tokens, gen.completion_mask, temperature, replay)
                    per_mode[mode].append((trainer, gen.rollout_logprobs, gen.completion_mask))
            # --- 4. the statistics over all batches ---
            for mode, parts in per_mode.items():
                trainer, rollout, mask = (torch.cat([p[i] for p in parts]) for i in range(3))
                stats = mismatch_statistics(trainer, rollout, mask, cfg.loss.policy.log_ratio_clamp)
                rows.append({"engine_dtype": dtype, "top_p": top_p, "trainer": mode, **stats})
            print(f"(e) engine {dtype}, top_p {top_p}: vllm-kl {rows[-2]['vllm_kl_k3']:.3g} without replay, "
                  f"{rows[-1]['vllm_kl_k3']:.3g} with", flush=True)
    return {"experiment": "top_p_replay", "config": config_path.name, "setup": dataclasses.asdict(setup),
            "temperature": temperature, "rows": rows}


def table(result: dict) -> str:
    """One row per (engine dtype, top_p, trainer mode)."""
    lines = ["| engine | top_p | trainer log-probs | tokens | vllm-kl (k3) | token IS mean | min token IS "
             "| sequence IS mean | tokens outside the trainer's nucleus | vllm-kl, tokens inside |", "|" + "---|" * 10]
    for r in result["rows"]:
        lines.append(f"| {r['engine_dtype']} | {r['top_p']:g} | {r['trainer']} | {r['tokens']} | {r['vllm_kl_k3']:.3g} "
                     f"| {r['token_is_mean']:.4g} | {r['token_is_min']:.3g} | {r['sequence_is_mean']:.4g} "
                     f"| {r['outside_trainer_filter']} | {r['vllm_kl_k3_inside']:.3g} |")
    return "\n".join(lines)
