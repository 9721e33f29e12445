"""Pipeline parallelism on GPUs: GPTModel with PP = 2 (two GPUs) and PP = 2 × TP = 2 (four GPUs) through the real
``forward_backward_func`` gives the one-GPU gradients (each layout skipped without its GPUs).

Run on a machine with ≥ 2 GPUs (4 for PP = 2 × TP = 2)::

    NCCL_NVLS_ENABLE=0 python -m pytest tests/gpu/test_megatron_pipeline.py -v -s

1. ``case_reference`` (1 GPU): GPTModel (local layer spec, 2 layers, fp32), the whole batch as ONE micro-batch
   through ``forward_backward_func``, for every variant; the weights and DDP's ``main_grad`` are saved.
2. ``case_pipeline`` at TP = 1 (``pp2``, 2 GPUs: one transformer layer per stage; embeddings on stage 0, final
   LayerNorm and output layer on stage 1) and at TP = 2 (``pp2_tp2``, 4 GPUs: each stage's parameters sharded
   over a TP pair): the same weights (stage s's local ``decoder.layers.0`` is global layer s; a tensor-parallel
   parameter is cut along its ``partition_dim``), 2 micro-batches of 4 sequences padded to a fixed length
   (Megatron's p2p shapes), the same ``forward_backward_func`` call on every rank (megatron-core's 1F1B
   schedule). Only the last stage has the old / rollout log-probs: the step-level config's decisions are
   broadcast from it. Every rank's gradients, gathered over TP, must equal the reference's for the parameters
   its stage holds (relative L2 within the fp32 tolerance), and ``MegatronGRPO.reduce_metrics`` must return the
   reference loss on every rank.

Variants: logits and fused output paths × (2-tuple loss, 3-tuple ``calculate_per_token_loss``) × (a plain
config, a step-level config: IS-weight normalization + mismatch monitor).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the worker processes run this file as a script

from tests.gpu.launch import init_nccl, needs_gpus, torchrun, worker_main  # noqa: E402

NUM_SEQUENCES = 8
VOCAB = 512
SEQ_LEN = 64
LOSS_CONFIGS = {
    "ppo_token_tis": ["rollout_correction.weight_level=token", "rollout_correction.weight_max=2.0"],
    "step_level": ["rollout_correction.weight_level=token", "rollout_correction.weight_max=2.0",
                   "rollout_correction.normalize_weights=true", "mismatch.skip_threshold=100.0"],
}
VARIANTS = [(per_token, name) for per_token in (False, True) for name in LOSS_CONFIGS]
OUTPUT_PATHS = ["logits", "fused"]
TINY_NORM = 1e-30
"""Floor of a reference gradient's norm in the relative error."""


LAYOUTS = {
    # name: (tensor-parallel size, GPUs); PP = 2, DP = 1
    "pp2": (1, 2),
    "pp2_tp2": (2, 4),
}

needs_two_gpus = needs_gpus(2)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pipeline_reference")
    print(torchrun(__file__, "case_reference", 1, out_dir=str(out)))
    return out


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_pipeline_layout_equals_one_gpu(layout: str, reference_dir: Path) -> None:
    tp, gpus = LAYOUTS[layout]
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"{layout} needs {gpus} CUDA GPUs")
    print(torchrun(__file__, "case_pipeline", gpus, out_dir=str(reference_dir), tp=tp))


# ------------------------------------------------------------------------------------------------ workers
def _rollouts():
    from mp_grpo.config.job import RolloutConfig
    from mp_grpo.megatron.rollouts import Rollouts
    from mp_grpo.train.synthetic import synthesize_rollouts

    cfg = RolloutConfig(group_size=4, prompt_min_length=4, prompt_max_length=12, completion_min_length=4,
                        completion_max_length=40, tool_mask_fraction=0.2, mismatch_std=0.1)
    r = synthesize_rollouts(cfg, num_sequences=NUM_SEQUENCES, vocab_size=VOCAB, seed=3).rollouts
    gen = torch.Generator().manual_seed(4)
    rollout = -torch.rand(r.tokens.shape, generator=gen) * 6.0 - 2.0
    old = rollout + 0.3 * torch.randn(r.tokens.shape, generator=gen)
    return Rollouts(tokens=r.tokens, lengths=r.lengths, loss_mask=r.loss_mask, advantages=r.advantages,
                    rollout_logprobs=rollout, old_logprobs=old)


def _build(per_token: bool):
    """DDP-wrapped GPTModel of this pipeline stage and tensor-parallel rank (fp32, local spec), megatron-core's
    hooks set."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from mp_grpo.config.job import ModelConfig, ParallelConfig, ParamsDtype
    from mp_grpo.megatron.gpt import gpt_transformer_config

    pp, tp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    model_cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_attention_heads=4,
                            max_sequence_length=SEQ_LEN, params_dtype=ParamsDtype("fp32"), init_seed=1234)
    config = gpt_transformer_config(model_cfg, ParallelConfig(tensor_model_parallel_size=tp,
                                                              calculate_per_token_loss=per_token))
    config = dataclasses.replace(config, pipeline_model_parallel_size=pp)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                   max_sequence_length=SEQ_LEN, parallel_output=True, share_embeddings_and_output_weights=False,
                   position_embedding_type="learned_absolute",
                   pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage()).cuda()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), gpt)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return ddp, gpt


def _global_name(local: str) -> str:
    """Stage s's ``decoder.layers.0.*`` is global layer s (one layer per stage)."""
    from megatron.core import parallel_state as ps

    prefix = "decoder.layers.0."
    if local.startswith(prefix):
        return f"decoder.layers.{ps.get_pipeline_model_parallel_rank()}.{local[len(prefix):]}"
    return local


def _load(gpt: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """The reference's weights into this rank's parameters: this stage's layers, a tensor-parallel parameter's
    shard along its ``partition_dim``."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for local, p in gpt.named_parameters():
            full = weights[_global_name(local)]
            if getattr(p, "tensor_model_parallel", False):
                full = full.chunk(tp, dim=p.partition_dim)[rank]
            p.copy_(full.to(p.device))


def _gathered_grads(gpt: torch.nn.Module) -> dict[str, torch.Tensor]:
    """DDP's fp32 ``main_grad`` of this stage's parameters by global name, tensor-parallel shards gathered."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    grads = {}
    for local, p in gpt.named_parameters():
        g = p.main_grad.float()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g.contiguous(), group=ps.get_tensor_model_parallel_group())
            g = torch.cat(parts, dim=p.partition_dim)
        grads[_global_name(local)] = g.cpu()
    return grads


def _step(per_token: bool, name: str, output_path: str, num_microbatches: int, weights):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mp_grpo.config import load_config
    from mp_grpo.config.job import OutputPath
    from mp_grpo.megatron import MegatronGRPO, prepare_micro_batch

    ddp, gpt = _build(per_token)
    _load(gpt, weights)
    rollouts = _rollouts()
    size = NUM_SEQUENCES // num_microbatches
    micro = [prepare_micro_batch(rollouts.select(slice(i * size, (i + 1) * size)), seq_len=SEQ_LEN).to("cuda")
             for i in range(num_microbatches)]
    if not ps.is_pipeline_last_stage():  # only the last stage has the log-probs (its forward-only pass)
        micro = [dataclasses.replace(mb, old_logprobs=None, rollout_logprobs=None) for mb in micro]
    grpo = MegatronGRPO(load_config(None, LOSS_CONFIGS[name]), temperature=0.8, calculate_per_token_loss=per_token,
                        output_path=OutputPath(output_path))
    batch = grpo.global_batch(micro, step=0)
    ddp.zero_grad_buffer()
    losses = get_forward_backward_func()(
        forward_step_func=grpo.forward_step_func(batch, step=0), data_iterator=iter(micro), model=ddp,
        num_microbatches=num_microbatches, seq_length=SEQ_LEN, micro_batch_size=size, forward_only=False)
    metrics = grpo.reduce_metrics(losses)
    return gpt, _gathered_grads(gpt), metrics, batch.skip_step()


def case_reference(out_dir: str) -> None:
    from megatron.core import parallel_state as ps

    init_nccl()
    ps.initialize_model_parallel()
    out = Path(out_dir)
    _, gpt = _build(False)
    weights = {n: p.detach().float().cpu().clone() for n, p in gpt.named_parameters()}
    torch.save(weights, out / "weights.pt")
    for output_path in OUTPUT_PATHS:
        for per_token, name in VARIANTS:
            _, grads, metrics, skip = _step(per_token, name, output_path, 1, weights)
            torch.save({"grads": grads, "loss": metrics["loss"], "skip": skip},
                       out / f"ref_{output_path}_{per_token}_{name}.pt")
            print(f"reference {output_path} per_token={per_token} {name}: loss {metrics['loss']:.6f}")
    ps.destroy_model_parallel()


def case_pipeline(out_dir: str, tp: int) -> None:
    from megatron.core import parallel_state as ps

    from tests.tolerances import tolerance

    init_nccl()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=2)
    out = Path(out_dir)
    weights = torch.load(out / "weights.pt")
    rtol = tolerance(torch.float32)["rtol"]
    failures = []
    for output_path in OUTPUT_PATHS:
        for per_token, name in VARIANTS:
            ref = torch.load(out / f"ref_{output_path}_{per_token}_{name}.pt")
            _, grads, metrics, skip = _step(per_token, name, output_path, 2, weights)
            where = (f"pp2 tp{tp} stage {ps.get_pipeline_model_parallel_rank()} tp rank "
                     f"{ps.get_tensor_model_parallel_rank()} {output_path} per_token={per_token} {name}")
            errors = {n: float((g - ref["grads"][n]).norm() / ref["grads"][n].norm().clamp(min=TINY_NORM))
                      for n, g in grads.items()}
            failures += [f"grad {n}: relative L2 error {e:.2e} > {rtol:.1e} [{where}]" for n, e in errors.items()
                         if not e <= rtol]
            if not abs(metrics["loss"] - ref["loss"]) <= rtol * abs(ref["loss"]):
                failures.append(f"loss {metrics['loss']:.6f} vs reference {ref['loss']:.6f} [{where}]")
            if skip != ref["skip"]:
                failures.append(f"skip_step {skip} vs reference {ref['skip']} [{where}]")
            worst = max(errors, key=errors.get)
            if ps.get_tensor_model_parallel_rank() == 0:  # the TP ranks of a stage hold the same gathered gradients
                print(f"{where}: loss {metrics['loss']:.6f} (reference {ref['loss']:.6f}); {len(errors)} parameters, "
                      f"worst relative L2 error {errors[worst]:.2e} ({worst})")
    ps.destroy_model_parallel()
    assert not failures, "\n".join(failures)


if __name__ == "__main__":
    worker_main({"case_reference": case_reference, "case_pipeline": case_pipeline})
