"""A small megatron-core GPTModel ready for training on GPUs: Float16Module, DDP, Megatron's optimizer.

Used by the main job and the GPU tests. The layer spec is megatron-core's local one (no
transformer-engine needed); with transformer-engine installed, its spec is used instead, which is
what context parallelism, packed (THD) sequences and sequence parallelism need (the local spec's
attention supports neither CP nor THD, and its torch LayerNorm refuses sequence parallelism).

Schedule of :func:`build_gpt_for_training`

1. ``TransformerConfig`` from the job's model and parallel sections; dropout off (an RL step compares
   log-probs of the same weights, which dropout would make differ); CPU initialization, so every TP
   layout starts from the same weights for a given seed.
2. ``GPTModel`` with ``parallel_output=True`` (vocab-parallel logits for the loss), moved to the GPU.
3. bf16: wrapped in ``Float16Module``.
4. ``DistributedDataParallel`` (fp32 gradient buffers, synchronous reduction) and the config's hooks:
   ``finalize_model_grads_func`` and ``no_sync_func``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mp_grpo.config.job import ModelConfig, ParallelConfig, ParamsDtype


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class GPTForTraining:
    """The pieces a training step needs."""

    model: torch.nn.Module
    """The DDP-wrapped model (pass it to ``forward_backward_func``)."""
    config: object
    """Its ``TransformerConfig``."""
    layer_spec: str
    """Which layer spec was used ("local" or "transformer_engine")."""


def gpt_transformer_config(model: ModelConfig, parallel: ParallelConfig):
    """Step 1: the ``TransformerConfig`` of the job's GPTModel."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = model.params_dtype == ParamsDtype.BF16
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        calculate_per_token_loss=parallel.calculate_per_token_loss,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
    )


def build_gpt_model(model: ModelConfig, parallel: ParallelConfig) -> tuple[torch.nn.Module, object, str]:
    """Steps 1–3: the (Float16Module-wrapped) GPTModel on the current GPU, its config and the spec's name."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    te = have_transformer_engine()
    needs_te = [
        what for what, on in (
            ("parallel.context_parallel_size > 1", parallel.context_parallel_size > 1),
            ("parallel.sequence_format = packed", parallel.sequence_format.value == "packed"),
            ("parallel.sequence_parallel", parallel.sequence_parallel),
        ) if on
    ]
    if needs_te and not te:
        raise RuntimeError(
            f"{', '.join(needs_te)}: megatron-core's local layer spec cannot run this (its attention has no CP / THD "
            "support and its torch LayerNorm no sequence parallelism); install transformer-engine, or turn it off"
        )
    # --- 1. config ---
    config = gpt_transformer_config(model, parallel)
    torch.manual_seed(model.init_seed)
    model_parallel_cuda_manual_seed(model.init_seed)  # the RNG tracker GPTModel's forward forks from
    # --- 2. GPTModel with vocab-parallel output ---
    spec = get_gpt_layer_with_transformer_engine_spec() if te else get_gpt_layer_local_spec()
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_sequence_length,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute",
    ).cuda()
    # --- 3. bf16 ---
    module: torch.nn.Module = Float16Module(config, gpt) if config.bf16 else gpt
    return module, config, "transformer_engine" if te else "local"


def build_gpt_for_training(model: ModelConfig, parallel: ParallelConfig) -> GPTForTraining:
    """The DDP-wrapped GPTModel of the job (see the module docstring)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    module, config, spec = build_gpt_model(model, parallel)
    # --- 4. DDP and the schedule hooks ---
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False,
        average_in_collective=parallel.average_in_collective,
    )
    ddp = DistributedDataParallel(config, ddp_config, module)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return GPTForTraining(model=ddp, config=config, layer_spec=spec)


def megatron_optimizer(model: torch.nn.Module, *, lr: float, clip_grad: float, bf16: bool):
    """Megatron's Adam for ``model`` (fp32 master weights under bf16; clips and returns the grad norm)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=clip_grad, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32, use_distributed_optimizer=False,
    )
    return get_megatron_optimizer(config, [model])
