"""megatron-core GPTModel through the real ``forward_backward_func``: TP = 2, DP = 2 (two GPUs) and TP = 4,
TP = 2 × DP = 2 (four GPUs), TP = 4 × DP = 2 (eight) give the gradients of TP = 1, DP = 1.

Run on a machine with ≥ 2 CUDA GPUs (skipped otherwise; each layout is skipped without its GPUs)::

    NCCL_NVLS_ENABLE=0 python -m pytest tests/gpu -v -s

Each case is a fresh ``torchrun`` (NCCL) launched from pytest, like the CPU tests:

1. ``reference`` (1 GPU): GPTModel (local layer spec, 2 layers) built from a seed; its initial weights are
   saved. For fp32 and for bf16 (``Float16Module``) and for every contract variant (the 2-tuple and
   the 3-tuple ``calculate_per_token_loss`` loss, DDP averaging in the collective or not, two loss
   configs), the whole global batch goes through ``forward_backward_func`` as ONE micro-batch; the
   gradients (DDP's fp32 ``main_grad``) are saved.
2. Each layout of ``LAYOUTS`` (e.g. ``tp2``: TP = 2, DP = 1, 2 micro-batches of 4; ``dp2``: TP = 1, DP = 2,
   2 micro-batches of 2 per rank): the same weights (sharded along each parameter's ``partition_dim``), the
   same sequences; after one ``forward_backward_func`` the gradients, gathered over TP, must equal the
   reference's.
3. The fused output path (``model.output_path=fused``: ``MegatronGRPO(output_path=OutputPath.FUSED)`` reads
   GPTModel's final hidden states and output weight instead of its logits) on every layout, and sequence
   parallelism (``tp2`` with ``sequence_parallel=True``, logits and fused; needs transformer-engine's layer
   spec, skipped without it), against the same logits-path reference.

Where Transformer Engine imports, every case builds TE's layer spec (``mp_grpo.megatron.gpt`` picks it), whose fp32
GEMMs run on TF32 tensor cores unless ``NVIDIA_TF32_OVERRIDE=0``: the launcher (``tests/gpu/launch.py``) sets it for
every run, the reference's included — without it the fp32 gradients differ by ~1e-4 relative L2 against the 2e-5
asked for.

Gradients are compared by their relative L2 error ‖g − g_ref‖ / ‖g_ref‖: over all parameters together it must
stay within ``tests/tolerances``' rtol of the model's dtype (fp32: 2e-5, bf16: 1.6e-2), and so must every single
parameter in fp32 (in bf16: ``BF16_PER_PARAMETER_RTOL``); the reduced loss must match at the same rtol. A wrong
factor in the loss scaling (M, DP, the token count) fails by far. The errors of every variant are printed (``-s``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the worker processes run this file as a script

from tests.gpu.launch import init_nccl, needs_gpus, torchrun, worker_main  # noqa: E402

NUM_SEQUENCES = 8
VOCAB = 512
LOSS_CONFIGS = {
    "ppo_token_tis": ["rollout_correction.weight_level=token", "rollout_correction.weight_max=2.0"],
    "gspo_seq_mean": ["policy.objective=gspo", "aggregation.mode=seq_mean_token_mean",
                      "rollout_correction.weight_level=geometric", "rollout_correction.weight_max=1.5",
                      "kl.coef=0.0", "entropy.bonus_coef=0.01"],
}
# (calculate_per_token_loss, average_in_collective, loss config)
VARIANTS = [(False, False, "ppo_token_tis"), (False, True, "gspo_seq_mean"), (True, False, "gspo_seq_mean"),
            (True, False, "ppo_token_tis")]
DTYPES = ["fp32", "bf16"]
LAYOUTS = {
    # name: tensor-parallel size, GPUs (DP = GPUs / TP), micro-batches per rank
    "tp2": dict(tp=2, gpus=2, num_microbatches=2),
    "dp2": dict(tp=1, gpus=2, num_microbatches=2),
    "tp4": dict(tp=4, gpus=4, num_microbatches=2),
    "tp2_dp2": dict(tp=2, gpus=4, num_microbatches=2),
    "tp4_dp2": dict(tp=4, gpus=8, num_microbatches=2),
}
TINY_NORM = 1e-30
"""Floor of a reference gradient's norm in the relative error (every GPTModel parameter gets a gradient)."""
BF16_PER_PARAMETER_RTOL = 0.1
"""bf16 bound for a single parameter's gradient: the LayerNorm gradients are small and their bf16 rounding error
relative to their norm reaches ~3e-2 between two layouts — as large as between bf16 and fp32 (measured with this
model on CPU). A wrong scaling factor gives ≥ 0.5."""


def _relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm().clamp(min=TINY_NORM))


# ------------------------------------------------------------------------------------------------ pytest
needs_two_gpus = needs_gpus(2)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpt_reference")
    print(torchrun(__file__, "case_reference", 1, out_dir=str(out)))
    return out


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gpt_layout_equals_one_gpu(layout: str, reference_dir: Path) -> None:
    gpus = LAYOUTS[layout]["gpus"]
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"{layout} needs {gpus} CUDA GPUs")
    print(torchrun(__file__, "case_layout", gpus, out_dir=str(reference_dir), layout=layout))


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gpt_fused_output_equals_one_gpu_logits(layout: str, reference_dir: Path) -> None:
    gpus = LAYOUTS[layout]["gpus"]
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"{layout} needs {gpus} CUDA GPUs")
    print(torchrun(__file__, "case_layout", gpus, out_dir=str(reference_dir), layout=layout, output_path="fused"))


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("output_path", ["logits", "fused"])
def test_gpt_sequence_parallel_equals_one_gpu(output_path: str, reference_dir: Path) -> None:
    if importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("sequence parallelism needs transformer-engine's layer spec (the local spec's torch LayerNorm "
                    "refuses it); tests/gpu/test_megatron_fused_output.py covers the output layer under SP without it")
    print(torchrun(__file__, "case_layout", 2, out_dir=str(reference_dir), layout="tp2", output_path=output_path,
                    sequence_parallel=True))


# ------------------------------------------------------------------------------------------------ workers
def _configs(tp: int, dtype: str, per_token: bool, avg: bool, sequence_parallel: bool = False):
    from mp_grpo.config.job import ModelConfig, ParallelConfig, ParamsDtype

    model = ModelConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_attention_heads=4,
                        max_sequence_length=64, params_dtype=ParamsDtype(dtype), init_seed=1234)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, calculate_per_token_loss=per_token, average_in_collective=avg,
                              sequence_parallel=sequence_parallel)
    return model, parallel


def _rollouts():
    from mp_grpo.config.job import RolloutConfig
    from mp_grpo.megatron.rollouts import Rollouts
    from mp_grpo.train.synthetic import synthesize_rollouts

    cfg = RolloutConfig(group_size=4, prompt_min_length=4, prompt_max_length=12, completion_min_length=4,
                        completion_max_length=40, tool_mask_fraction=0.2, mismatch_std=0.1)
    synth = synthesize_rollouts(cfg, num_sequences=NUM_SEQUENCES, vocab_size=VOCAB, seed=3)
    r = synth.rollouts
    # Rollout-engine log-probs independent of the model: the correction weights then differ from 1.
    gen = torch.Generator().manual_seed(4)
    rollout = -torch.rand(r.tokens.shape, generator=gen) * 6.0 - 2.0
    return Rollouts(tokens=r.tokens, lengths=r.lengths, loss_mask=r.loss_mask, advantages=r.advantages,
                    rollout_logprobs=rollout)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    from megatron.core.transformer.module import Float16Module

    inner = model.module
    return inner.module if isinstance(inner, Float16Module) else inner


def _one_step(tp: int, dtype: str, per_token: bool, avg: bool, config_name: str, rows: list[int],
              num_microbatches: int, weights: dict[str, torch.Tensor] | None, output_path: str = "logits",
              sequence_parallel: bool = False):
    """One forward_backward_func over this rank's ``rows``; returns (the model, reduced metrics)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mp_grpo.config import load_config
    from mp_grpo.config.job import OutputPath
    from mp_grpo.loss.metrics import reduce_metrics
    from mp_grpo.megatron import MegatronGRPO, prepare_micro_batch
    from mp_grpo.megatron.gpt import build_gpt_for_training

    model_cfg, parallel_cfg = _configs(tp, dtype, per_token, avg, sequence_parallel)
    built = build_gpt_for_training(model_cfg, parallel_cfg)
    gpt = _unwrap(built.model)
    if weights is not None:
        _load_sharded(gpt, weights)
    rollouts = _rollouts()
    size = len(rows) // num_microbatches
    micro = []
    for i in range(num_microbatches):
        part = rollouts.select(torch.tensor(rows[i * size:(i + 1) * size]))
        micro.append(prepare_micro_batch(part, seq_len=64, sequence_parallel_size=tp if sequence_parallel else 1).to("cuda"))
    grpo = MegatronGRPO(load_config(None, LOSS_CONFIGS[config_name]), temperature=0.8,
                        num_microbatches=num_microbatches, calculate_per_token_loss=per_token,
                        output_path=OutputPath(output_path))
    batch = grpo.global_batch(micro, step=0)
    built.model.zero_grad_buffer()
    losses = get_forward_backward_func()(
        forward_step_func=grpo.forward_step_func(batch, step=0, model_kwargs={"fp32_output": False} if dtype == "bf16" else None),
        data_iterator=iter(micro), model=built.model, num_microbatches=num_microbatches, seq_length=64,
        micro_batch_size=size, forward_only=False,
    )
    return gpt, reduce_metrics(losses, grpo.groups.dp_cp)


def _load_sharded(gpt: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            full = weights[name]
            if getattr(p, "tensor_model_parallel", False):
                full = full.chunk(tp, dim=p.partition_dim)[rank]
            p.copy_(full.to(device=p.device, dtype=p.dtype))


def _full_grads(gpt: torch.nn.Module) -> dict[str, torch.Tensor]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    out = {}
    for name, p in gpt.named_parameters():
        g = p.main_grad.float()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g.contiguous(), group=ps.get_tensor_model_parallel_group())
            g = torch.cat(parts, dim=p.partition_dim)
        out[name] = g.cpu()
    return out


def case_reference(out_dir: str) -> None:
    from megatron.core import parallel_state as ps

    init_nccl()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    out = Path(out_dir)
    model_cfg, parallel_cfg = _configs(1, "fp32", False, False)
    from mp_grpo.megatron.gpt import build_gpt_model

    gpt, _, spec = build_gpt_model(model_cfg, parallel_cfg)
    weights = {name: p.detach().float().cpu().clone() for name, p in gpt.named_parameters()}
    torch.save(weights, out / "weights.pt")
    print(f"layer spec: {spec}")
    rows = list(range(NUM_SEQUENCES))
    for dtype in DTYPES:
        for per_token, avg, name in VARIANTS:
            gpt, metrics = _one_step(1, dtype, per_token, avg, name, rows, 1, weights)
            torch.save({"grads": _full_grads(gpt), "loss": metrics["loss"]}, out / f"ref_{dtype}_{per_token}_{avg}_{name}.pt")
            print(f"reference {dtype} per_token={per_token} avg={avg} {name}: loss {metrics['loss']:.6f}")
    ps.destroy_model_parallel()


def case_layout(out_dir: str, layout: str, output_path: str = "logits", sequence_parallel: bool = False) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from tests.tolerances import tolerance

    init_nccl()
    tp, m = LAYOUTS[layout]["tp"], LAYOUTS[layout]["num_microbatches"]
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    out = Path(out_dir)
    weights = torch.load(out / "weights.pt")
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = NUM_SEQUENCES // dp
    rows = list(range(dp_rank * per_rank, (dp_rank + 1) * per_rank))
    failures = []
    for dtype in DTYPES:
        dt = torch.float32 if dtype == "fp32" else torch.bfloat16
        for per_token, avg, name in VARIANTS:
            ref = torch.load(out / f"ref_{dtype}_{per_token}_{avg}_{name}.pt")
            gpt, metrics = _one_step(tp, dtype, per_token, avg, name, rows, m, weights, output_path, sequence_parallel)
            grads = _full_grads(gpt)
            where = f"{layout}{' sp' if sequence_parallel else ''} {output_path} {dtype} per_token={per_token} avg={avg} {name}"
            rtol = tolerance(dt)["rtol"]
            per_param_bound = rtol if dtype == "fp32" else BF16_PER_PARAMETER_RTOL
            errors = {pname: _relative_l2(grads[pname], g_ref) for pname, g_ref in ref["grads"].items()}
            whole = _relative_l2(torch.cat([grads[p].flatten() for p in ref["grads"]]),
                                 torch.cat([g.flatten() for g in ref["grads"].values()]))
            worst_name = max(errors, key=errors.get)
            if not whole <= rtol:
                failures.append(f"all gradients: relative L2 error {whole:.2e} > {rtol:.1e} [{where}]")
            failures += [f"grad {n}: relative L2 error {e:.2e} > {per_param_bound:.1e} [{where}]"
                         for n, e in errors.items() if not e <= per_param_bound]
            if not abs(metrics["loss"] - ref["loss"]) <= rtol * abs(ref["loss"]):
                failures.append(f"loss {metrics['loss']:.6f} vs reference {ref['loss']:.6f} [{where}]")
            if dist.get_rank() == 0:
                print(f"{where}: loss {metrics['loss']:.6f} (reference {ref['loss']:.6f}); relative L2 error of all "
                      f"gradients {whole:.2e}, worst parameter {errors[worst_name]:.2e} ({worst_name})")
    ps.destroy_model_parallel()
    assert not failures, "\n".join(failures)


if __name__ == "__main__":
    worker_main({"case_reference": case_reference, "case_layout": case_layout})
