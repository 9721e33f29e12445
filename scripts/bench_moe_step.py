#!/usr/bin/env python
"""Benchmark: the training pass of a small mixture-of-experts GPTModel against its no-loss floor, both output paths.

    python scripts/bench_moe_step.py --out OUT                                  # one GPU (EP = 1)
    torchrun --standalone --nproc_per_node 2 scripts/bench_moe_step.py --out OUT   # EP = 2 (and DP = 2)
    python scripts/bench_moe_step.py --report OUT/moe_step.json --out OUT        # the markdown from its JSON

Needs CUDA and megatron-core ≥ 0.17: 0.16's MoE router runs Transformer Engine's GEMM on CUDA, ≥ 0.17 falls back
to ``torch.mm`` (this script refuses 0.16 with that reason).

The model (``SHAPES["small"]``): megatron-core's GPTModel with the local layer spec for experts — ``TopKRouter``
(softmax, top-k, load-balancing loss and z-loss on), ``SequentialMLP`` experts (SwiGLU), the alltoall token
dispatcher — and GQA attention, RMSNorm, RoPE, untied embeddings, the Qwen2.5 vocabulary (V = 151936, so that
the output layer weighs as in a real model); bf16 under ``Float16Module``, Megatron DDP with fp32 gradient
buffers, selective activation recompute. Expert parallelism over every process (EP = DP = world size; TP = 1:
megatron-core's MoELayer refuses TP > 1 without sequence parallelism, which the local spec's norms refuse).

The paths (``step_paths``, on this model): ``floor`` — the decoder alone (GPTModel with its output layer skipped,
no loss; backward from a fixed random gradient of the final hidden states; the routers' aux and z losses still
attached) — plus the bare output-layer matmuls (h @ Wᵀ and its two backward GEMMs) timed apart and added;
``logits`` and ``fused`` — ``MegatronGRPO`` on its two output paths (PPO clip, on-policy, no entropy; its MoE
metrics hooks on). Each: one training ``forward_backward_func`` of ``--micro-batches`` micro-batch(es) of
``--batch`` rows of ``--seq`` tokens per rank, median over ``--iters`` after ``--warmup`` (CUDA events after a
barrier, ``measure.timed_ms``; the slowest rank's median), and the peak allocated memory of one pass (the
largest over the ranks; weights and gradients included).

Writes ``moe_step.json`` (the rows, the shape, the command, the machine) and ``moe_step.md`` into ``--out``
(``moe_step_ep2.*`` at EP = 2).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path as FilePath

import torch
import torch.distributed as dist

sys.path.insert(0, str(FilePath(__file__).resolve().parents[1]))
sys.path.insert(0, str(FilePath(__file__).resolve().parent))

from measure import GiB, median_ms, peak_bytes, timed_ms  # noqa: E402
from step_model import Rig, synthetic_micro_batches  # noqa: E402
from step_paths import Path, output_matmuls, training_pass  # noqa: E402

ROUTER_TORCH_FALLBACK = (0, 17)
"""megatron-core version from which the router's gating GEMM runs without Transformer Engine on CUDA."""
ROPE_BASE = 1_000_000
NORM_EPS = 1e-6
AUX_LOSS_COEFF = 1e-2
"""Load-balancing loss coefficient (Megatron-LM's usual 1e-2)."""
Z_LOSS_COEFF = 1e-3
"""Router z-loss coefficient (ST-MoE's 1e-3)."""
PATHS = (Path.FLOOR, Path.LOGITS, Path.FUSED)
SEED = 1234
MICRO_BATCH_SEED = 7


@dataclass(frozen=True)
class MoEShape:
    """A decoder with routed experts in every layer (GQA, SwiGLU experts, RMSNorm, RoPE, untied embeddings)."""

    name: str
    hidden: int
    layers: int
    heads: int
    query_groups: int
    experts: int
    topk: int
    expert_ffn: int
    vocab: int

    def parameters(self) -> int:
        """Parameter count (experts and embeddings included)."""
        head_dim = self.hidden // self.heads
        attention = self.hidden * (self.heads + 2 * self.query_groups) * head_dim + self.heads * head_dim * self.hidden
        experts = self.experts * 3 * self.hidden * self.expert_ffn
        layer = attention + experts + self.experts * self.hidden + 2 * self.hidden
        return self.layers * layer + 2 * self.vocab * self.hidden + self.hidden


SHAPES = {
    # Qwen1.5-MoE's layout (fine-grained experts, top-4, the Qwen vocabulary) at a quarter of its width and depth
    "small": MoEShape("small", hidden=1024, layers=8, heads=16, query_groups=4, experts=16, topk=4, expert_ffn=704,
                      vocab=151936),
    "tiny": MoEShape("tiny", hidden=64, layers=2, heads=4, query_groups=2, experts=4, topk=2, expert_ffn=64, vocab=1024),
}


def log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def megatron_core_version() -> tuple[int, int]:
    from mp_grpo.megatron.moe import megatron_core_version as version

    return version()


def init_distributed() -> int:
    """NCCL over every process, one GPU each; megatron-core's parallel_state with EP = world size. Returns EP."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29519")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    ep = dist.get_world_size()
    ps.initialize_model_parallel(expert_model_parallel_size=ep)
    return ep


def moe_config(shape: MoEShape, ep: int):
    """The ``TransformerConfig`` of ``shape`` at expert-parallel size ``ep`` (bf16, no dropout, selective recompute)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.query_groups, kv_channels=shape.hidden // shape.heads, ffn_hidden_size=shape.expert_ffn,
        normalization="RMSNorm", layernorm_epsilon=NORM_EPS, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=True, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=shape.experts, moe_router_topk=shape.topk, moe_ffn_hidden_size=shape.expert_ffn,
        moe_aux_loss_coeff=AUX_LOSS_COEFF, moe_z_loss_coeff=Z_LOSS_COEFF, moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=ep, recompute_granularity="selective",
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, use_cpu_initialization=False,
    )


def moe_rig(shape: MoEShape, *, seq_len: int, ep: int) -> Rig:
    """``shape`` as megatron-core's GPTModel on this GPU (experts split over the EP group), ready for steps."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from mp_grpo.megatron import ParallelGroups

    config = moe_config(shape, ep)
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    spec = get_gpt_layer_local_spec(num_experts=shape.experts, moe_grouped_gemm=False, normalization="RMSNorm")
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=shape.vocab, max_sequence_length=seq_len,
                   parallel_output=True, share_embeddings_and_output_weights=False, position_embedding_type="rope",
                   rotary_base=ROPE_BASE).cuda()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    ddp = DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return Rig(model=ddp, groups=ParallelGroups.from_parallel_state(), forward_backward_func=get_forward_backward_func(),
               hidden=shape.hidden, vocab=shape.vocab, model_kwargs={"fp32_output": False})


def _over_ranks(value: float, op) -> float:
    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=op)
    return float(t)


def measure_paths(rig: Rig, micro, *, iters: int, warmup: int) -> dict[str, dict]:
    """Each path's training pass: median ms (slowest rank) and peak GiB (largest rank); the floor with its matmuls."""
    rows: dict[str, dict] = {}
    tokens = sum(int(mb.input_ids.numel()) for mb in micro)
    for path in PATHS:
        run = training_pass(rig, path, micro)  # the gradients accumulate over the passes, as in bench_step.py
        rig.zero_grad()
        ms = _over_ranks(timed_ms(run, iters, warmup=warmup), dist.ReduceOp.MAX)
        peak = _over_ranks(peak_bytes(run) / GiB, dist.ReduceOp.MAX)
        rows[path.value] = dict(ms=round(ms, 3), peak_gib=round(peak, 3))
        log(f"{path.value}: {ms:.2f} ms, peak {peak:.2f} GiB")
        del run
        torch.cuda.empty_cache()
    matmuls = output_matmuls(tokens, rig.hidden, rig.vocab, backward=True, device="cuda")
    matmul_ms = _over_ranks(median_ms(matmuls), dist.ReduceOp.MAX)
    del matmuls
    torch.cuda.empty_cache()
    floor = rows[Path.FLOOR.value]
    floor.update(decoder_ms=floor["ms"], output_matmuls_ms=round(matmul_ms, 3), ms=round(floor["ms"] + matmul_ms, 3))
    for name, row in rows.items():
        row["x_floor"] = round(row["ms"] / floor["ms"], 4)
    log(f"floor = decoder {floor['decoder_ms']:.2f} ms + output matmuls {matmul_ms:.2f} ms; "
        + ", ".join(f"{n} {r['x_floor']:.3f}x" for n, r in rows.items() if n != Path.FLOOR.value))
    return rows


def markdown(report: dict) -> str:
    s = report["shape"]
    lines = [
        f"# Training pass of a mixture-of-experts GPTModel: mp_grpo against the no-loss floor (EP = {report['ep']})", "",
        f"Command: `{report['command']}` — {report['machine']['gpu']} × {report['ep']}, {report['date']}, megatron-core "
        f"{report['machine']['megatron_core']}, torch {report['machine']['torch']}.", "",
        f"Model `{s['name']}`: hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads ({s['query_groups']} "
        f"query groups), {s['experts']} experts of FFN {s['expert_ffn']} in every layer, top-{s['topk']}, V = "
        f"{s['vocab']}, {report['parameters'] / 1e6:.0f} M parameters; local layer spec (SequentialMLP experts, "
        f"alltoall dispatcher, aux loss {AUX_LOSS_COEFF:g} and z-loss {Z_LOSS_COEFF:g}), bf16, selective recompute. "
        f"Per rank and pass: {report['micro_batches']} micro-batch(es) of {report['batch']} × {report['seq']} tokens. "
        f"Median of {report['iters']} passes after {report['warmup']} (the slowest rank's), peak allocated memory (the "
        "largest rank's).", "",
        "| path | training pass (ms) | × floor | peak (GiB) |",
        "|---|---|---|---|",
    ]
    for name, row in report["rows"].items():
        extra = (f" (decoder {row['decoder_ms']:.2f} + output matmuls {row['output_matmuls_ms']:.2f})"
                 if "decoder_ms" in row else "")
        lines.append(f"| {name} | {row['ms']:.2f}{extra} | {row['x_floor']:.3f} | {row['peak_gib']:.2f} |")
    floor = report["rows"].get(Path.FLOOR.value, {})
    below = [(name, row) for name, row in report["rows"].items()
             if name != Path.FLOOR.value and "decoder_ms" in floor and row["ms"] < floor["ms"]]
    if below:
        over = "; ".join(f"{name} {row['ms'] - floor['decoder_ms']:+.2f} ms" for name, row in below)
        lines += ["", f"Below 1.000: the whole pass (output layer and loss included) against the floor's decoder alone — "
                  f"{over} — where the output layer's GEMMs take {floor['output_matmuls_ms']:.2f} ms timed apart on an "
                  "idle GPU: inside this pass most of their time costs no wall time, so a ratio below 1.000 means at "
                  "the floor, not faster than it. The pass is not bound by GPU work alone (megatron-core's alltoall "
                  "dispatcher reads each MoE layer's token counts on the host; the SequentialMLP experts run one "
                  "after another)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=FilePath, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per row")
    parser.add_argument("--batch", type=int, default=4, help="rows per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per pass and rank")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--report", type=FilePath, metavar="MOE_STEP_JSON",
                        help="no measurement: rewrite the markdown of this moe_step*.json into --out")
    args = parser.parse_args(argv)
    if args.report:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.report.stem}.md").write_text(markdown(json.loads(args.report.read_text())))
        return
    for name in ("seq", "batch", "micro_batches", "iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    version = megatron_core_version()
    if version < ROUTER_TORCH_FALLBACK:
        raise SystemExit(f"megatron-core {version[0]}.{version[1]}: its MoE router runs Transformer Engine's GEMM on "
                         "CUDA; run with megatron-core ≥ 0.17 (e.g. 0.19) on PYTHONPATH")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    ep = init_distributed()
    shape = SHAPES[args.shape]
    if shape.experts % ep:
        raise SystemExit(f"{shape.experts} experts do not split over {ep} expert-parallel ranks")
    rig = moe_rig(shape, seq_len=args.seq, ep=ep)
    micro = synthetic_micro_batches(args.micro_batches, args.batch, args.seq, shape.vocab,
                                    seed=MICRO_BATCH_SEED + dist.get_rank(), device="cuda")
    log(f"{shape.name}: {shape.parameters() / 1e6:.0f} M parameters, EP = {ep}, {args.micro_batches} × {args.batch} × "
        f"{args.seq} tokens per rank")
    rows = measure_paths(rig, micro, iters=args.iters, warmup=args.warmup)
    if dist.get_rank() == 0:
        from megatron.core import package_info

        args.out.mkdir(parents=True, exist_ok=True)
        stem = "moe_step" if ep == 1 else f"moe_step_ep{ep}"
        launcher = "python" if ep == 1 else f"torchrun --standalone --nproc_per_node {ep}"
        command = f"{launcher} scripts/bench_moe_step.py " + " ".join(argv if argv is not None else sys.argv[1:])
        report = dict(command=command.replace(str(args.out), "OUT"), date=date.today().isoformat(),
                      machine=dict(gpu=torch.cuda.get_device_name(), python=platform.python_version(),
                                   torch=torch.__version__, megatron_core=package_info.__version__),
                      shape=asdict(shape), parameters=shape.parameters(), ep=ep, seq=args.seq, batch=args.batch,
                      micro_batches=args.micro_batches, iters=args.iters, warmup=args.warmup, rows=rows)
        (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
        (args.out / f"{stem}.md").write_text(markdown(report))
        log(f"wrote {args.out / stem}.json / .md")
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
