"""The learning job: on-policy GRPO on a verifiable task through Megatron's schedule and MegatronGRPO.

:func:`run` is the API (``python -m mp_grpo.train`` adds the table, progress bar, JSON log and plot):
``records = run(load_job_config(path, overrides))`` returns one dict per optimizer step.

Schedule of :func:`run`

1. Distributed setup (gloo on CPU, NCCL on GPUs; a world of one when not launched by torchrun) and
   megatron-core's ``parallel_state`` with the config's TP and CP; DP = world / (TP·CP).
2. :class:`Trainer`: GPTModel + Megatron DDP + Megatron's Adam through ``forward_backward_func`` on
   GPUs; on CPU, where megatron-core 0.16's GPTModel and schedule need CUDA, the CPU stand-in
   (megatron-core tensor-parallel layers, no attention; in bf16 under Megatron's bf16 contract: fp32
   ``main_grad`` buffers and fp32 main parameters, :mod:`~mp_grpo.train.cpu_optimizer`), a Megatron-DDP
   emulation and megatron-core's own ``forward_step`` / ``backward_step`` / ``finalize_model_grads`` — the
   same loss contract. ``MegatronGRPO`` gets ``model.logit_dtype`` and ``model.output_rows`` (the training step and
   the forward-only passes: by default the output layer computes the completion tokens' rows alone, the prompts'
   skipped). The :class:`~mp_grpo.train.rollout.RolloutEngine` gets its own copy of the model in its dtype,
   and its head precision ``engine.logit_dtype``.
3. Every ``train.updates_per_rollout`` steps, a rollout batch of N = DP · M · micro_batch_size sequences
   (N / G prompts, G completions each): prompts keyed by (seed, rollout index); the engine (weights
   synced from the trainer, possibly lagging) samples the completions — every DP replica samples the
   whole batch (keyed noise: the same tokens on every layout) and keeps its rows; exact rewards;
   group-normalized advantages; this rank's micro-batches, carrying the engine's sampling filter
   (``engine.top_k`` / ``engine.top_p``, :meth:`~mp_grpo.megatron.MicroBatch.with_sampling_filter`) unless
   ``engine.replay_filter`` is false; old log-probs (and entropies) from the trainer's forward-only pass
   (:func:`mp_grpo.megatron.forward_only.forward_logprobs`), of the filtered distribution when replayed;
   the boundary rule (:func:`drop_outside_filter`): sampled tokens outside the trainer's replayed filter
   leave the loss mask, counted over DP×CP (one all-reduce of two numbers); with the loss's
   ``rollout_correction.bypass`` the old log-probs are then left out (the rollout's are the old ones: the pass
   above still runs for the boundary rule and the entropies); with ``engine.topk_logprobs`` the engine's top-K
   ids and log-probs of each micro-batch's sequences (:meth:`~mp_grpo.megatron.MicroBatch.with_rollout_top_k`,
   the loss's top-K trust region); reference log-probs of the full vocabulary from the initial weights when the
   loss has a KL term.
4. The optimizer step: the GlobalBatch, ``forward_backward_func`` with MegatronGRPO's
   ``forward_step_func``, metrics reduced over DP×CP, gradient clipping and the step (skipped when the
   mismatch monitor says so).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from mp_grpo.collectives import all_reduce_sum
from mp_grpo.config.job import JobConfig, ParamsDtype
from mp_grpo.config import ConfigError
from mp_grpo.megatron import MegatronGRPO, ParallelGroups, Rollouts, prepare_micro_batch
from mp_grpo.megatron.forward_only import forward_logprobs
from mp_grpo.megatron.micro_batch import IGNORE_INDEX, MicroBatch
from mp_grpo.ops import SamplingFilter
from mp_grpo.ops.checks import CheckInputs
from mp_grpo.train.rollout import RolloutEngine
from mp_grpo.train.task import group_advantages, make_prompts, successor_reward

ADVANTAGE_STD_EPS = 1e-6
"""Added to a group's reward standard deviation: a group whose rewards are all equal gets advantage 0
instead of 0/0 (TRL's and verl's GRPO use the same kind of epsilon)."""

CPU_DESCRIPTION = (
    "CPU: megatron-core 0.16's GPTModel and forward_backward_func need CUDA, so this run uses the CPU "
    "stand-in (megatron-core VocabParallelEmbedding + ColumnParallelLinear, {dtype}, no attention) and "
    "mp_grpo.train.cpu_schedule (megatron-core's forward_step / backward_step / finalize_model_grads "
    "in a CPU loop, Megatron DDP's reduction emulated) — the same loss contract as on GPUs"
)


# --------------------------------------------------------------------------------------------- 1. setup
def setup_distributed() -> torch.device:
    """Initialize torch.distributed if needed (NCCL on GPUs, gloo on CPU); returns this rank's device."""
    on_gpu = torch.cuda.is_available()
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python -m mp_grpo.train`: a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29533")
        if on_gpu:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if on_gpu else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")


def world_size() -> int:
    """Processes in this job: the process group's size, or torchrun's ``WORLD_SIZE`` before it exists (1 without torchrun)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def check_layout(cfg: JobConfig, world: int, on_gpu: bool) -> int:
    """DP size of the config's layout on ``world`` processes; a :class:`ConfigError` naming the key when it does not fit."""
    tp, cp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.context_parallel_size
    if world % (tp * cp):
        key = "parallel.tensor_model_parallel_size" if tp > 1 else "parallel.context_parallel_size"
        raise ConfigError(f"{key}: TP·CP = {tp}·{cp} does not divide the {world} processes of this job; allowed: "
                          f"a world of a multiple of {tp * cp} processes (torchrun --nproc_per_node), or smaller TP·CP")
    if on_gpu and cfg.model.cpu_logit_offset != 0.0:
        raise ConfigError(f"model.cpu_logit_offset: got {cfg.model.cpu_logit_offset} on a GPU machine (GPTModel has no such "
                          "channel); allowed: 0 on GPUs (a key of the CPU stand-in)")
    if not on_gpu and cfg.parallel.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel: got true on a CPU machine (megatron-core's sequence-parallel "
                          "mappings need CUDA); allowed: false on CPU")
    dp = world // (tp * cp)
    n = dp * cfg.train.num_microbatches * cfg.train.micro_batch_size
    if n % cfg.rollout.group_size:
        raise ConfigError(f"rollout.group_size: {cfg.rollout.group_size} does not divide the global batch DP·M·micro_batch_size "
                          f"= {dp}·{cfg.train.num_microbatches}·{cfg.train.micro_batch_size} = {n}; allowed: a divisor of {n}")
    return dp


# --------------------------------------------------------------------------------------------- 2. model
def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The innermost model under DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


class Trainer:
    """The policy, its optimizer step, the forward_backward function and the engine's model (GPU or CPU)."""

    def __init__(self, cfg: JobConfig, groups: ParallelGroups, on_gpu: bool) -> None:
        self.cfg, self.groups, self.on_gpu = cfg, groups, on_gpu
        self.model_kwargs: dict = {}
        self.reference = None
        needs_reference = cfg.loss.kl.coef != 0.0
        if on_gpu:
            from megatron.core.pipeline_parallel import get_forward_backward_func

            from mp_grpo.megatron.gpt import build_gpt_for_training, build_gpt_model, megatron_optimizer

            built = build_gpt_for_training(cfg.model, cfg.parallel)
            bf16 = cfg.model.params_dtype == ParamsDtype.BF16
            self.model = built.model
            self.optimizer = megatron_optimizer(self.model, lr=cfg.train.lr, clip_grad=cfg.train.clip_grad, bf16=bf16)
            self.forward_backward = get_forward_backward_func()
            self.model_kwargs = {"fp32_output": False} if bf16 else {}
            fp32_model = replace(cfg.model, params_dtype=ParamsDtype.FP32)
            self.engine_model = build_gpt_model(fp32_model, cfg.parallel)[0]
            if needs_reference:
                self.reference = build_gpt_model(cfg.model, cfg.parallel)[0].eval()
            self.description = (f"GPU: megatron-core GPTModel ({built.layer_spec} layer spec, {cfg.model.params_dtype.value}), "
                                "DistributedDataParallel, forward_backward_func, Megatron Adam")
        else:
            from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

            from mp_grpo.train.cpu_ddp import CpuDistributedDataParallel
            from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config, random_full_weights
            from mp_grpo.train.cpu_schedule import forward_backward_cpu

            from mp_grpo.train.cpu_optimizer import CpuMixedPrecisionAdam

            bf16 = cfg.model.params_dtype == ParamsDtype.BF16
            dtype = torch.bfloat16 if bf16 else torch.float32

            def model_config(params_dtype: torch.dtype):
                config = cpu_model_config(
                    hidden_size=cfg.model.hidden_size, tensor_model_parallel_size=groups.tp_size,
                    context_parallel_size=groups.cp_size, calculate_per_token_loss=cfg.parallel.calculate_per_token_loss,
                    params_dtype=params_dtype,
                )
                config.finalize_model_grads_func = finalize_model_grads
                return config

            config = model_config(dtype)
            offset = cfg.model.cpu_logit_offset
            weights = random_full_weights(config, vocab_size=cfg.model.vocab_size, max_sequence_length=cfg.model.max_sequence_length,
                                          seed=cfg.model.init_seed, logit_offset=offset)

            def stand_in(config=config) -> CpuGPTStandIn:
                m = CpuGPTStandIn(config, vocab_size=cfg.model.vocab_size, max_sequence_length=cfg.model.max_sequence_length,
                                  tp_group=groups.tp, logit_offset_channel=offset != 0.0)
                m.load_full_weights(weights)
                return m

            module = stand_in()
            ddp_config = DistributedDataParallelConfig(average_in_collective=cfg.parallel.average_in_collective)
            # bf16: Megatron's contract — fp32 main_grad buffers in DDP, fp32 main parameters in the optimizer
            self.model = CpuDistributedDataParallel(config, ddp_config, module, dp_cp_group=groups.dp_cp, main_grad=bf16)
            self.optimizer = (CpuMixedPrecisionAdam(module.parameters(), lr=cfg.train.lr) if bf16
                              else torch.optim.Adam(module.parameters(), lr=cfg.train.lr))
            self.forward_backward = partial(_cpu_forward_backward, forward_backward_cpu, groups)
            self.engine_model = stand_in(model_config(torch.float32))  # the engine casts it to engine.dtype
            if needs_reference:  # under the DDP emulation too: the CPU schedule calls model.no_sync()
                self.reference = CpuDistributedDataParallel(config, ddp_config, stand_in().eval(), dp_cp_group=groups.dp_cp)
            self.description = CPU_DESCRIPTION.format(dtype=cfg.model.params_dtype.value)

    @property
    def policy(self) -> torch.nn.Module:
        """The innermost policy model (the weights the engine copies)."""
        return _unwrap(self.model)

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> float:
        """Clip, step; returns the gradient norm (before clipping)."""
        if self.on_gpu:
            _, grad_norm, _ = self.optimizer.step()
            return math.nan if grad_norm is None else float(grad_norm)  # None: an fp16 overflow skipped the step
        # bf16: the fp32 main_grad buffers (Megatron clips the main parameters' gradients, which are these)
        if self.model.main_grad:
            grads = [(p, p.main_grad) for p in self.model.module.parameters() if p.requires_grad]
        else:
            grads = [(p, p.grad) for p in self.model.module.parameters() if p.grad is not None]
        sharded = sum(((g.float() ** 2).sum() for p, g in grads if getattr(p, "tensor_model_parallel", False)), torch.zeros(()))
        replicated = sum(((g.float() ** 2).sum() for p, g in grads if not getattr(p, "tensor_model_parallel", False)), torch.zeros(()))
        norm = float((all_reduce_sum(sharded, self.groups.tp) + replicated).sqrt())
        if norm > self.cfg.train.clip_grad:
            for _, g in grads:
                g.mul_(self.cfg.train.clip_grad / norm)
        self.optimizer.step()
        return norm


def _cpu_forward_backward(fbf, groups, *, forward_step_func, data_iterator, model, num_microbatches, forward_only=False, **_unused):
    return fbf(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
               num_microbatches=num_microbatches, groups=groups, forward_only=forward_only)


# --------------------------------------------------------------------------------------------- 3. rollouts
def rollout_batch(cfg: JobConfig, rollout_index: int, trainer: Trainer, engine: RolloutEngine, grpo: MegatronGRPO,
                  device: torch.device) -> tuple[list, list | None, dict]:
    """This rank's micro-batches of a fresh on-policy rollout batch, their entropies, and batch statistics."""
    from megatron.core import parallel_state as ps

    groups, m, mbs, g = trainer.groups, cfg.train.num_microbatches, cfg.train.micro_batch_size, cfg.rollout.group_size
    n = groups.dp_size * m * mbs
    modulus = cfg.task.modulus or cfg.model.vocab_size
    prompts, prompt_len = make_prompts(num_prompts=n // g, min_length=cfg.rollout.prompt_min_length,
                                       max_length=cfg.rollout.prompt_max_length, modulus=modulus,
                                       seed=cfg.train.seed, step=rollout_index)
    prompts, prompt_len = prompts.repeat_interleave(g, 0).to(device), prompt_len.repeat_interleave(g).to(device)
    gen = engine.generate(prompts, prompt_len, completion_length=cfg.task.completion_length, step=rollout_index,
                          sequence_ids=torch.arange(n, device=device))
    rewards = successor_reward(gen.tokens, prompt_len, cfg.task.completion_length, modulus)
    advantages = group_advantages(rewards, g, ADVANTAGE_STD_EPS)
    # Token-aligned fields on the CPU (micro-batch preparation is host-side); each micro-batch then moves to the device.
    everything = Rollouts(tokens=gen.tokens.cpu(), lengths=gen.lengths.cpu(), loss_mask=gen.completion_mask.cpu(),
                          advantages=advantages.cpu(), rollout_logprobs=gen.rollout_logprobs.cpu())
    first = ps.get_data_parallel_rank() * m * mbs
    sp = groups.tp_size if cfg.parallel.sequence_parallel else 1

    def micro_batch(start: int) -> MicroBatch:
        mb = prepare_micro_batch(everything.select(slice(start, start + mbs)), sequence_format=cfg.parallel.sequence_format,
                                 cp_group=groups.cp, sequence_parallel_size=sp)
        if gen.top_ids is not None:  # engine.topk_logprobs: the loss's top-K trust region reads them
            ids, logprobs = gen.top_k_rows(start, start + mbs)
            mb = mb.with_rollout_top_k(ids.to("cpu"), logprobs.cpu())
        return mb.to(device)

    micro = [micro_batch(first + i * mbs) for i in range(m)]
    filt = replayed_filter(cfg, engine)
    if filt is not None:  # the training pass and the old-log-prob pass both read mb.sampling_filter
        micro = [mb.with_sampling_filter(top_k=filt.top_k, top_p=filt.top_p) for mb in micro]
    old = forward_logprobs(grpo, trainer.forward_backward, trainer.model, micro, model_kwargs=trainer.model_kwargs)
    micro = [mb.with_logprobs(old_logprobs=lp, rollout_logprobs=mb.rollout_logprobs) for mb, lp in zip(micro, old.logprobs)]
    sampled = sum(mb.loss_mask.sum() for mb in micro)
    if filt is not None:  # the boundary rule
        micro, outside = zip(*(drop_outside_filter(mb) for mb in micro))
        micro, dropped = list(micro), sum(outside)
    else:
        dropped = torch.zeros_like(sampled)
    counts = all_reduce_sum(torch.stack([dropped, sampled]).to(torch.float64), groups.dp_cp).tolist()
    if cfg.loss.rollout_correction.bypass:  # the rollout log-probs are the old ones: the loss takes no others
        micro = [replace(mb, old_logprobs=None) for mb in micro]
    if trainer.reference is not None:  # KL(π_θ ‖ π_ref) to the reference's full-vocabulary log-probs
        unfiltered = [replace(mb, sampling_filter=None) for mb in micro]
        ref = forward_logprobs(grpo, trainer.forward_backward, trainer.reference, unfiltered, model_kwargs=trainer.model_kwargs)
        micro = [replace(mb, ref_logprobs=lp) for mb, lp in zip(micro, ref.logprobs)]
    stats = dict(reward=float(rewards.mean()), reward_std=float(rewards.std(unbiased=False)),
                 solved=float((rewards == 1.0).float().mean()),
                 outside_filter=counts[0] / counts[1],  # counts[1] ≥ 1: every completion has a token
                 completions=gen.tokens.cpu(), rewards=rewards.cpu())
    return micro, old.entropy, stats


def replayed_filter(cfg: JobConfig, engine: RolloutEngine) -> SamplingFilter | None:
    """The sampling filter the trainer replays: the engine's (``engine.top_k`` / ``engine.top_p``) unless
    ``engine.replay_filter`` is false; None when there is nothing to replay."""
    if not cfg.engine.replay_filter or engine.sampling_filter is None:
        return None
    return engine.sampling_filter.without_noops(cfg.model.vocab_size)  # e.g. top_k >= V: nothing to replay


def drop_outside_filter(mb: MicroBatch) -> tuple[MicroBatch, torch.Tensor]:
    """The boundary rule (:class:`~mp_grpo.config.job.EngineConfig`, ``replay_filter``): the trained tokens whose
    old log-prob is −inf — sampled by the engine, outside the trainer's replayed filter — leave the loss mask
    (target ``IGNORE_INDEX``, old log-prob 0), so that no term, denominator or metric of the step sees them.
    Returns the micro-batch and the count dropped (an int64 scalar on the device, no host read)."""
    outside = torch.isneginf(mb.old_logprobs) & mb.loss_mask
    keep = mb.loss_mask & ~outside
    ignore = torch.full((), IGNORE_INDEX, dtype=mb.targets.dtype, device=mb.targets.device)
    return replace(mb, loss_mask=keep, targets=torch.where(outside, ignore, mb.targets),
                   old_logprobs=torch.where(outside, torch.zeros_like(mb.old_logprobs), mb.old_logprobs)), outside.sum()


def check_replayed_step(metrics: dict[str, float], micro: list[MicroBatch], group: ProcessGroup | None) -> None:
    """With a replayed filter the log-prob ops and the loss run with ``check_inputs`` off, since a target outside
    the trainer's filter is expected (a later update's; :class:`~mp_grpo.config.job.EngineConfig`,
    ``replay_filter``); any other non-finite input at a trained position is an error, raised here, before the
    optimizer step, on every rank alike:

    1. the given inputs — old, rollout and reference log-probs, advantages — read directly (summed over ``group``,
       the data-parallel × context-parallel ranks);
    2. the policy's log-probs from the step's reduced metrics: ``nonfinite_inputs`` counts the trained positions with
       any non-finite input, ``sampling_filter/outside_tokens`` those whose log-prob is −inf (a target outside the
       filter, or of probability 0); with step 1's inputs finite, the difference is the NaN log-probs (a NaN or
       +inf logit in the row)."""
    # --- 1. the given inputs ---
    bad = torch.zeros((), dtype=torch.float64, device=micro[0].loss_mask.device)
    for mb in micro:
        nonfinite = torch.zeros_like(mb.loss_mask)
        for name in ("old_logprobs", "rollout_logprobs", "ref_logprobs", "advantages"):
            x = getattr(mb, name)
            if x is not None:
                x = x if x.shape == mb.loss_mask.shape else mb.sequences.broadcast(x, mb.loss_mask.shape)
                nonfinite = nonfinite | ~torch.isfinite(x)
        bad = bad + (nonfinite & mb.loss_mask).sum(dtype=torch.float64)
    given = float(all_reduce_sum(bad, group))
    if given > 0:
        raise ValueError(
            f"nonfinite inputs: {given:g} trained position(s) with a NaN / ±inf old, rollout or reference log-prob or "
            "advantage this step; the loop runs the ops unchecked while it replays engine.top_k / engine.top_p, so it "
            "stops here — rerun with engine.replay_filter=false to have the ops name the input"
        )
    # --- 2. the policy's log-probs ---
    policy = metrics["nonfinite_inputs"] - metrics["sampling_filter/outside_tokens"]
    if policy > 0:
        raise ValueError(
            f"nonfinite inputs: {policy:g} trained position(s) with a NaN policy log-prob (a NaN or +inf logit in the "
            "row) this step; the loop runs the ops unchecked while it replays engine.top_k / engine.top_p, so it stops "
            "here — rerun with engine.replay_filter=false to have the ops name the input"
        )


# --------------------------------------------------------------------------------------------- the loop
def run(cfg: JobConfig, *, on_step: Callable[[dict], None] | None = None, on_start: Callable[[dict], None] | None = None,
        on_rollout: Callable[[list[MicroBatch]], None] | None = None,
        on_trainer: Callable[[Trainer], None] | None = None) -> list[dict]:
    """Train ``cfg.train.steps`` GRPO steps; one record per step (see the module docstring).

    Record keys: ``step``, ``reward`` (mean over the rollout batch the step trained on), ``reward_std``,
    ``solved`` (fraction of completions with reward 1), ``metrics`` (MegatronGRPO's, reduced over DP×CP:
    ``loss``, ``mismatch/k3`` = vllm-kl, ``is_weight/...``, ``ratio/...``, ...), ``grad_norm`` (NaN when
    skipped), ``skipped``, ``seconds``, ``completions`` (``[N, S]`` token ids of the rollout batch, CPU),
    ``rewards`` (``[N]``), ``outside_filter`` (fraction of the rollout batch's sampled tokens outside the
    trainer's replayed sampling filter, dropped from the loss by the boundary rule; 0 without a filter).
    ``on_start(info)`` gets the description and layout, ``on_step(record)`` each record, ``on_rollout(micro)``
    this rank's micro-batches of each rollout batch as the steps train on them (old and rollout log-probs,
    the loss mask after the boundary rule), ``on_trainer(trainer)`` the :class:`Trainer` once it is built (its
    ``policy`` holds the current weights at every later call of the other hooks).
    Call it on every rank (torchrun) or in a plain process (a world of one).
    """
    from megatron.core import parallel_state as ps

    # --- 1. distributed setup (the layout checked first: a bad one fails before any process group exists) ---
    dp = check_layout(cfg, world_size(), torch.cuda.is_available())
    device = setup_distributed()
    on_gpu = device.type == "cuda"
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.parallel.tensor_model_parallel_size,
                                 context_parallel_size=cfg.parallel.context_parallel_size)
    try:
        groups = ParallelGroups.from_parallel_state()
        # --- 2. trainer and engine ---
        trainer = Trainer(cfg, groups, on_gpu)
        if on_trainer is not None:
            on_trainer(trainer)
        engine = RolloutEngine(trainer.engine_model, cfg.engine, temperature=cfg.rollout.temperature, seed=cfg.train.seed,
                               tp_group=groups.tp)
        # With a replayed filter a target outside the trainer's kept set is expected (EngineConfig.replay_filter's
        # rules), not an input error: the ops run unchecked (log-prob -inf instead of a raise) and
        # check_replayed_step checks each step's metrics instead.
        replaying = replayed_filter(cfg, engine) is not None
        grpo = MegatronGRPO(cfg.loss, temperature=cfg.rollout.temperature, num_microbatches=cfg.train.num_microbatches,
                            calculate_per_token_loss=cfg.parallel.calculate_per_token_loss, groups=groups,
                            vocab_size=cfg.model.vocab_size, output_path=cfg.model.output_path,
                            logit_dtype=cfg.model.logit_dtype,  # the training step and the forward-only passes
                            output_rows=cfg.model.output_rows,  # loss: the prompt rows skipped by the output layer
                            check_inputs=CheckInputs.OFF if replaying else CheckInputs.DEFERRED)
        if on_start is not None:
            on_start(dict(description=trainer.description, layout=dict(
                world=dist.get_world_size(), tp=groups.tp_size, cp=groups.cp_size, dp=dp, backend=dist.get_backend(),
                sequence_format=cfg.parallel.sequence_format.value, output_path=cfg.model.output_path.value,
                output_rows=cfg.model.output_rows.value,
                logit_dtype=cfg.model.logit_dtype.value, engine_logit_dtype=cfg.engine.logit_dtype.value,
                global_batch=dp * cfg.train.num_microbatches * cfg.train.micro_batch_size)))
        records: list[dict] = []
        micro = entropies = stats = None
        for step in range(cfg.train.steps):
            start = time.perf_counter()
            # --- 3. a rollout batch from the current (or lagging) weights ---
            if step % cfg.train.updates_per_rollout == 0:
                engine.sync_weights(trainer.policy)
                micro, entropies, stats = rollout_batch(cfg, step // cfg.train.updates_per_rollout, trainer, engine, grpo, device)
                if on_rollout is not None:
                    on_rollout(micro)
            # --- 4. one optimizer step ---
            batch = grpo.global_batch(micro, step=step, entropies=entropies)
            trainer.zero_grad()
            losses = trainer.forward_backward(
                forward_step_func=grpo.forward_step_func(batch, step=step, model_kwargs=trainer.model_kwargs),
                data_iterator=iter(micro), model=trainer.model, num_microbatches=cfg.train.num_microbatches,
                seq_length=max(int(mb.input_ids.shape[1]) for mb in micro), micro_batch_size=cfg.train.micro_batch_size,
                forward_only=False,
            )
            metrics = grpo.reduce_metrics(losses)  # MoE models: the routers' metrics too
            if replaying:
                check_replayed_step(metrics, micro, groups.dp_cp)
            skipped = batch.skip_step()
            grad_norm = math.nan if skipped else trainer.optimizer_step()
            record = dict(step=step, metrics=metrics, grad_norm=grad_norm, skipped=skipped,
                          seconds=time.perf_counter() - start, **stats)
            records.append(record)
            if on_step is not None:
                on_step(record)
        return records
    finally:
        ps.destroy_model_parallel()
