#!/usr/bin/env python
"""Main job: a few GRPO optimizer steps of a small Megatron model on synthetic rollouts.

    torchrun --nproc_per_node 2 scripts/grpo_step.py --config configs/grpo_step.yaml            # GPUs, NCCL
    torchrun --standalone --nproc_per_node 2 scripts/grpo_step.py --config configs/grpo_step_cpu.yaml  # CPU, gloo
    ... [key=value ...]   # dotlist overrides, e.g. parallel.tensor_model_parallel_size=1 loss_preset=gspo
    ... model.output_path=fused   # log-probs from the final hidden states, never holding the logits

Schedule
1. Distributed setup: NCCL on GPUs, gloo on CPU (Triton kernels under the interpreter);
   ``parallel_state`` with the config's TP and CP, DP = world / (TP·CP).
2. Model: GPTModel (megatron-core, Float16Module for bf16, DDP, Megatron's Adam) on GPUs. On CPU,
   where megatron-core 0.16's GPTModel and ``forward_backward_func`` need CUDA, the CPU stand-in
   (megatron-core's VocabParallelEmbedding + ColumnParallelLinear), a DDP emulation and
   :func:`mp_grpo.train.cpu_schedule.forward_backward_cpu` (megatron-core's own ``forward_step``,
   ``backward_step`` and ``finalize_model_grads``) — the same loss contract; the job says so.
3. Every ``updates_per_rollout`` steps, a rollout batch: synthetic prompts and completions, rewards,
   group-normalized advantages (the same global batch on every rank; each DP rank takes its rows),
   cut into this rank's micro-batches (shift, padding or packing, CP split); one no-grad pass gives
   the old log-probs and entropies; rollout log-probs = old + mismatch noise; reference log-probs from
   the initial weights when the loss has a KL term.
4. Each step: the GlobalBatch, ``forward_backward_func`` with :class:`mp_grpo.megatron.MegatronGRPO`'s
   ``forward_step_func`` (on ``model.output_path``: the model's logits, or its final hidden states and
   output weight through the fused output layer; the no-grad passes of 3. use the same path), metrics reduced over DP×CP, the optimizer step (skipped when the mismatch
   monitor says so); a progress bar and one table row per step on rank 0.
5. A JSON log (config, layout, per-step metrics) written by rank 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before mp_grpo imports triton
    # The interpreter evaluates masked-off lanes too (log(0), 0/0 there never reach a result); numpy warns.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
# megatron-core announces each fallback when neither transformer-engine nor apex is installed (both optional).
warnings.filterwarnings("ignore", message=r".*(Transformer Engine and Apex are|Apex is) not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without install

import torch.distributed as dist  # noqa: E402
from tqdm import tqdm  # noqa: E402

from mp_grpo.collectives import all_reduce_sum  # noqa: E402
from mp_grpo.config.job import JobConfig, ParamsDtype, load_job_config  # noqa: E402
from mp_grpo.loss.metrics import reduce_metrics  # noqa: E402
from mp_grpo.megatron import MegatronGRPO, ParallelGroups, prepare_micro_batch  # noqa: E402
from mp_grpo.train.synthetic import synthesize_rollouts  # noqa: E402

COLUMNS = [  # (header, metric name(s): the first present is shown, format)
    ("step", None, "{:>4d}"),
    ("loss", "loss", "{:>9.4f}"),
    ("policy", "policy_loss", "{:>9.4f}"),
    ("clip lo/hi", None, "{:>11s}"),
    ("ratio", "ratio/mean", "{:>7.4f}"),
    ("IS w", ("is_weight/applied/mean", "is_weight/truncated/mean"), "{:>6.3f}"),
    ("rejected", "rejected_frac/rollout", "{:>8.3f}"),
    ("vllm-kl", "mismatch/k3", "{:>9.2e}"),
    ("entropy", "entropy", "{:>7.3f}"),
    ("reward", None, "{:>6.3f}"),
    ("tokens", "valid_tokens", "{:>6.0f}"),
    ("grad norm", None, "{:>9.3e}"),
    ("skip", None, "{:>4s}"),
    ("s", None, "{:>5.1f}"),
]


# --------------------------------------------------------------------------------------------- 1. setup
def setup_distributed() -> tuple[torch.device, str]:
    on_gpu = torch.cuda.is_available()
    backend = "nccl" if on_gpu else "gloo"
    if "RANK" not in os.environ:  # plain `python scripts/grpo_step.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    return (torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")), backend


def check_layout(cfg: JobConfig, on_gpu: bool) -> int:
    world, tp, cp = dist.get_world_size(), cfg.parallel.tensor_model_parallel_size, cfg.parallel.context_parallel_size
    if world % (tp * cp):
        raise SystemExit(f"parallel: world size {world} is not a multiple of TP·CP = {tp}·{cp}; launch {tp * cp}·DP processes")
    if not on_gpu and cfg.parallel.sequence_parallel:
        raise SystemExit("parallel.sequence_parallel: megatron-core's sequence-parallel mappings need CUDA; set it false on CPU")
    return world // (tp * cp)


# --------------------------------------------------------------------------------------------- 2. model
class Trainer:
    """The model, its optimizer step and the forward_backward function — GPU or CPU (see the docstring)."""

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
            if needs_reference:
                self.reference = build_gpt_model(cfg.model, cfg.parallel)[0].eval()
            self.description = (f"GPU: megatron-core GPTModel ({built.layer_spec} layer spec, {cfg.model.params_dtype.value}), "
                                "DistributedDataParallel, forward_backward_func, Megatron Adam")
        else:
            from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

            from mp_grpo.train.cpu_ddp import CpuDistributedDataParallel
            from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config, random_full_weights
            from mp_grpo.train.cpu_schedule import forward_backward_cpu

            config = cpu_model_config(
                hidden_size=cfg.model.hidden_size, tensor_model_parallel_size=groups.tp_size,
                context_parallel_size=groups.cp_size, calculate_per_token_loss=cfg.parallel.calculate_per_token_loss,
            )
            config.finalize_model_grads_func = finalize_model_grads
            weights = random_full_weights(config, vocab_size=cfg.model.vocab_size,
                                          max_sequence_length=cfg.model.max_sequence_length, seed=cfg.model.init_seed)

            def stand_in() -> CpuGPTStandIn:
                m = CpuGPTStandIn(config, vocab_size=cfg.model.vocab_size,
                                  max_sequence_length=cfg.model.max_sequence_length, tp_group=groups.tp)
                m.load_full_weights(weights)
                return m

            module = stand_in()
            ddp_config = DistributedDataParallelConfig(average_in_collective=cfg.parallel.average_in_collective)
            self.model = CpuDistributedDataParallel(config, ddp_config, module, dp_cp_group=groups.dp_cp)
            self.optimizer = torch.optim.Adam(module.parameters(), lr=cfg.train.lr)
            self.forward_backward = partial(_cpu_forward_backward, forward_backward_cpu, groups)
            if needs_reference:
                self.reference = stand_in().eval()
            self.description = (
                "CPU: megatron-core 0.16's GPTModel and forward_backward_func need CUDA, so this run uses the CPU "
                "stand-in (megatron-core VocabParallelEmbedding + ColumnParallelLinear, fp32) and "
                "mp_grpo.train.cpu_schedule (megatron-core's forward_step / backward_step / finalize_model_grads "
                "in a CPU loop, Megatron DDP's reduction emulated) — the same loss contract as on GPUs"
            )

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> float:
        """Clip, step; returns the gradient norm (before clipping)."""
        if self.on_gpu:
            _, grad_norm, _ = self.optimizer.step()
            return math.nan if grad_norm is None else float(grad_norm)  # None: an fp16 overflow skipped the step
        params = [p for p in self.model.module.parameters() if p.grad is not None]
        sharded = sum(((p.grad.float() ** 2).sum() for p in params if getattr(p, "tensor_model_parallel", False)), torch.zeros(()))
        replicated = sum(((p.grad.float() ** 2).sum() for p in params if not getattr(p, "tensor_model_parallel", False)), torch.zeros(()))
        norm = float((all_reduce_sum(sharded, self.groups.tp) + replicated).sqrt())
        if norm > self.cfg.train.clip_grad:
            for p in params:
                p.grad.mul_(self.cfg.train.clip_grad / norm)
        self.optimizer.step()
        return norm

    @torch.no_grad()
    def logprobs(self, model: torch.nn.Module, grpo: MegatronGRPO, mb) -> tuple[torch.Tensor, torch.Tensor | None]:
        return grpo.model_logprobs(model, mb, model_kwargs=self.model_kwargs)


def _cpu_forward_backward(fbf, groups, *, forward_step_func, data_iterator, model, num_microbatches, **_unused):
    return fbf(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
               num_microbatches=num_microbatches, groups=groups)


# --------------------------------------------------------------------------------------------- 3. rollouts
def rollout_micro_batches(cfg: JobConfig, step: int, trainer: Trainer, grpo: MegatronGRPO, device: torch.device):
    """This rank's micro-batches of a fresh rollout batch, with old / rollout / reference log-probs."""
    from megatron.core import parallel_state as ps

    groups, m, mbs = trainer.groups, cfg.train.num_microbatches, cfg.train.micro_batch_size
    synth = synthesize_rollouts(cfg.rollout, num_sequences=groups.dp_size * m * mbs, vocab_size=cfg.model.vocab_size,
                                seed=cfg.train.seed + step)
    first = ps.get_data_parallel_rank() * m * mbs
    sp = groups.tp_size if cfg.parallel.sequence_parallel else 1
    micro, entropies = [], []
    for i in range(m):
        rows = slice(first + i * mbs, first + (i + 1) * mbs)
        mb = prepare_micro_batch(synth.rollouts.select(rows), sequence_format=cfg.parallel.sequence_format,
                                 cp_group=groups.cp, sequence_parallel_size=sp)
        mb = mb.to(device)
        old, entropy = trainer.logprobs(trainer.model, grpo, mb)
        noise = mb.layout.target_field(synth.mismatch_noise[rows], 0.0).to(device)
        rollout = torch.where(mb.loss_mask, old + noise, torch.zeros_like(old))
        mb = mb.with_logprobs(old_logprobs=old, rollout_logprobs=rollout)
        if trainer.reference is not None:
            mb = replace(mb, ref_logprobs=trainer.logprobs(trainer.reference, grpo, mb)[0])
        micro.append(mb)
        entropies.append(entropy)
    return micro, entropies, float(synth.rewards.mean())


# --------------------------------------------------------------------------------------------- 4. steps
def _width(fmt: str) -> int:
    return len(fmt.format(0 if "d" in fmt else 0.0 if ("f" in fmt or "e" in fmt) else ""))


def header() -> str:
    return " ".join(f"{h:>{max(_width(fmt), len(h))}}" for h, _, fmt in COLUMNS)


def format_row(row: dict) -> str:
    m = row["metrics"]
    special = {
        "step": row["step"],
        "clip lo/hi": None if "clip_frac/low" not in m else f"{m['clip_frac/low']:.3f}/{m['clip_frac/high']:.3f}",
        "reward": row["reward"],
        "grad norm": row["grad_norm"],
        "skip": "yes" if row["skipped"] else "no",
        "s": row["seconds"],
    }
    cells = []
    for h, name, fmt in COLUMNS:
        names = (name,) if isinstance(name, str) else name
        value = special[h] if name is None else next((m[n] for n in names if n in m), None)
        width = max(_width(fmt), len(h))
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            cells.append("-".rjust(width))
        else:
            cells.append(fmt.format(value).rjust(width))
    return " ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="job YAML (configs/grpo_step.yaml, configs/grpo_step_cpu.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. train.steps=2")
    args = parser.parse_args()
    cfg = load_job_config(args.config, args.overrides)

    # --- 1. distributed setup ---
    device, backend = setup_distributed()
    on_gpu = device.type == "cuda"
    dp = check_layout(cfg, on_gpu)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.parallel.tensor_model_parallel_size,
                                 context_parallel_size=cfg.parallel.context_parallel_size)
    groups = ParallelGroups.from_parallel_state()
    rank0 = dist.get_rank() == 0

    # --- 2. model ---
    trainer = Trainer(cfg, groups, on_gpu)
    grpo = MegatronGRPO(cfg.loss, temperature=cfg.rollout.temperature, num_microbatches=cfg.train.num_microbatches,
                        calculate_per_token_loss=cfg.parallel.calculate_per_token_loss, groups=groups,
                        vocab_size=cfg.model.vocab_size, output_path=cfg.model.output_path)
    layout = dict(world=dist.get_world_size(), tp=groups.tp_size, cp=groups.cp_size, dp=dp, backend=backend,
                  sequence_format=cfg.parallel.sequence_format.value, output_path=cfg.model.output_path.value,
                  global_batch=dp * cfg.train.num_microbatches * cfg.train.micro_batch_size)
    if rank0:
        print(trainer.description, flush=True)
        print("layout: " + ", ".join(f"{k}={v}" for k, v in layout.items()), flush=True)

    rows: list[dict] = []
    bar = tqdm(total=cfg.train.steps, desc="grpo", disable=not (rank0 and cfg.output.progress_bar), dynamic_ncols=True)
    if rank0:
        tqdm.write(header())
    micro = entropies = None
    reward = math.nan
    for step in range(cfg.train.steps):
        start = time.perf_counter()
        # --- 3. rollouts ---
        if step % cfg.train.updates_per_rollout == 0:
            micro, entropies, reward = rollout_micro_batches(cfg, step, trainer, grpo, device)
        # --- 4. one optimizer step ---
        batch = grpo.global_batch(micro, step=step, entropies=entropies)
        trainer.zero_grad()
        losses = trainer.forward_backward(
            forward_step_func=grpo.forward_step_func(batch, step=step, model_kwargs=trainer.model_kwargs),
            data_iterator=iter(micro), model=trainer.model, num_microbatches=cfg.train.num_microbatches,
            seq_length=max(int(mb.input_ids.shape[1]) for mb in micro), micro_batch_size=cfg.train.micro_batch_size,
            forward_only=False,
        )
        metrics = reduce_metrics(losses, groups.dp_cp)
        skipped = batch.skip_step()
        grad_norm = math.nan if skipped else trainer.optimizer_step()
        row = dict(step=step, metrics=metrics, reward=reward, grad_norm=grad_norm, skipped=skipped,
                   seconds=time.perf_counter() - start)
        rows.append(row)
        if rank0:
            tqdm.write(format_row(row))
        bar.set_postfix(loss=f"{metrics['loss']:.4f}")
        bar.update()
    bar.close()

    # --- 5. JSON log ---
    if rank0:
        path = Path(cfg.output.json_log)
        path.parent.mkdir(parents=True, exist_ok=True)
        log = dict(description=trainer.description, layout=layout,
                   config=json.loads(json.dumps(asdict(cfg), default=lambda e: e.value)),
                   steps=[_finite(r) for r in rows])
        path.write_text(json.dumps(log, indent=2))
        print(f"wrote {path}", flush=True)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _finite(x):
    """JSON-safe copy: non-finite floats become null."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


if __name__ == "__main__":
    main()
