"""The model and data of ``bench_step.py``: a Qwen2.5-shaped megatron-core GPTModel and synthetic micro-batches.

- :class:`ModelShape` / :data:`SHAPES`: Qwen2.5-0.5B and -1.5B (GQA, SwiGLU, RMSNorm, RoPE θ = 10⁶, QKV bias,
  tied embeddings, V = 151936), Qwen2.5-7B (the same layout, untied embeddings, V = 152064; for TP = 4) and a
  tiny shape for smoke tests (its heads and query groups divide by 4, so it runs at every TP size).
- :func:`gpt_config`: their ``TransformerConfig`` with selective or full activation recompute, bf16, no dropout.
- :class:`LayerSpec` / :func:`layer_spec`: the decoder layer — Transformer Engine's (megatron-core's
  ``get_gpt_layer_with_transformer_engine_spec``: TE's fused attention, its norms fused into the next linear
  layer; what Megatron users train with) or megatron-core's local one (unfused attention that stores the S × S
  scores; runs without TE); :func:`default_spec`: TE wherever ``transformer_engine`` imports.
- :class:`Rig`: what a step needs — the DDP-wrapped model, its config, the process groups, a
  ``forward_backward_func`` with Megatron's keyword signature, and the model-call keywords; :func:`gpu_rig`
  builds it on the current GPU at the tensor-parallel size ``parallel_state`` was initialized with
  (the layer spec asked for, no sequence parallelism — the local spec's norms refuse it, and both specs are run
  alike —, ``Float16Module``, Megatron DDP with fp32 gradient buffers, ``finalize_model_grads``); :func:`cpu_rig`
  builds one from the CPU stand-ins (``mp_grpo.train``: no attention) for the tests and ``bench_step.py --dry-run``.
- :func:`synthetic_micro_batches`: padded micro-batches of full-length rows (a prompt, then a completion
  trained on: the last 7/8 of a row, or the last ``loss_fraction`` of it), random tokens, one advantage per sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from mp_grpo.megatron import MicroBatch, ParallelGroups, Rollouts, prepare_micro_batch


@dataclass(frozen=True)
class ModelShape:
    """A decoder's dimensions (Qwen2.5 layout: GQA, SwiGLU, RMSNorm, RoPE, QKV bias, tied embeddings)."""

    name: str
    hidden: int
    layers: int
    heads: int
    query_groups: int
    ffn: int
    vocab: int
    tied: bool = True
    """Input embedding and output layer share one weight (Qwen2.5-0.5B / -1.5B; not -7B)."""

    def parameters(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        head_dim = self.hidden // self.heads
        qkv = self.hidden * (self.heads + 2 * self.query_groups) * head_dim + (self.heads + 2 * self.query_groups) * head_dim
        layer = qkv + self.heads * head_dim * self.hidden + 3 * self.hidden * self.ffn + 2 * self.hidden
        return self.layers * layer + (1 if self.tied else 2) * self.vocab * self.hidden + self.hidden

    def check_tensor_parallel(self, tp: int) -> None:
        """Refuse a TP size the shape cannot be split over (heads, query groups, FFN, vocabulary)."""
        for name in ("heads", "query_groups", "ffn", "vocab"):
            if getattr(self, name) % tp:
                raise ValueError(f"--tp: the {self.name} shape's {name} ({getattr(self, name)}) does not divide "
                                 f"over {tp} tensor-parallel ranks")


SHAPES = {
    "0.5b": ModelShape("0.5b", hidden=896, layers=24, heads=14, query_groups=2, ffn=4864, vocab=151936),
    "1.5b": ModelShape("1.5b", hidden=1536, layers=28, heads=12, query_groups=2, ffn=8960, vocab=151936),
    "7b": ModelShape("7b", hidden=3584, layers=28, heads=28, query_groups=4, ffn=18944, vocab=152064, tied=False),
    "tiny": ModelShape("tiny", hidden=64, layers=2, heads=8, query_groups=4, ffn=128, vocab=1024),
}

ROPE_BASE = 1_000_000
"""Qwen2.5's rotary base θ."""
NORM_EPS = 1e-6
"""Qwen2.5's RMSNorm epsilon."""
PROMPT_FRACTION = 8
"""A row's first S / 8 tokens are its prompt (not trained on); the rest is the completion."""


class LayerSpec(str, Enum):
    """The decoder layer's implementation (megatron-core's layer specs)."""

    TE = "te"
    """``get_gpt_layer_with_transformer_engine_spec()``: Transformer Engine's modules (fused attention with
    ``cu_seqlens`` support, RMSNorm fused into the following linear layer). Needs ``transformer_engine``."""
    LOCAL = "local"
    """``get_gpt_layer_local_spec(normalization="RMSNorm")``: megatron-core's own modules; its core attention is
    unfused (softmax over stored S × S scores, in megatron-core's global memory buffer)."""


def default_spec() -> LayerSpec:
    """TE's spec wherever ``transformer_engine`` imports, else the local one."""
    from mp_grpo.megatron.gpt import have_transformer_engine

    return LayerSpec.TE if have_transformer_engine() else LayerSpec.LOCAL


def layer_spec(spec: LayerSpec):
    """megatron-core's ``ModuleSpec`` of a decoder layer for ``spec``; TE asked for where it does not import: an
    error naming ``--spec``."""
    from megatron.core.models.gpt import gpt_layer_specs

    from mp_grpo.megatron.gpt import have_transformer_engine

    spec = LayerSpec(spec)
    if spec == LayerSpec.LOCAL:
        return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    if not have_transformer_engine():
        raise RuntimeError("--spec te: transformer_engine does not import here (put Transformer Engine on PYTHONPATH, "
                           "NVTE_FRAMEWORK=pytorch) — or run --spec local")
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()


class Recompute(str, Enum):
    """Megatron's activation recompute."""

    SELECTIVE = "selective"
    """``recompute_granularity="selective"``: the core attention is recomputed in backward."""
    FULL = "full"
    """``recompute_granularity="full"``, uniform, one layer per unit: only each layer's input is kept."""


def gpt_config(shape: ModelShape, recompute: Recompute, *, bf16: bool = True, tp: int = 1):
    """The ``TransformerConfig`` of ``shape`` at tensor-parallel size ``tp`` (no dropout, initialized on the GPU,
    no sequence parallelism)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    full = recompute == Recompute.FULL
    dtype = torch.bfloat16 if bf16 else torch.float32
    return TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.query_groups, ffn_hidden_size=shape.ffn, kv_channels=shape.hidden // shape.heads,
        normalization="RMSNorm", layernorm_epsilon=NORM_EPS, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=True, hidden_dropout=0.0, attention_dropout=0.0,
        recompute_granularity=recompute.value, recompute_method="uniform" if full else None,
        recompute_num_layers=1 if full else None,
        bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype, use_cpu_initialization=False,
        tensor_model_parallel_size=tp,
    )


@dataclass
class Rig:
    """One model ready for steps; see the module docstring."""

    model: torch.nn.Module
    """DDP-wrapped (Megatron's on GPU, the CPU stand-in's on CPU); what ``forward_backward_func`` takes."""
    groups: ParallelGroups
    forward_backward_func: Callable
    """With Megatron's keyword signature (``forward_step_func=, data_iterator=, model=, num_microbatches=,
    seq_length=, micro_batch_size=, forward_only=``)."""
    hidden: int
    vocab: int
    model_kwargs: dict = field(default_factory=dict)
    """mp_grpo's model call: ``{"fp32_output": False}`` under ``Float16Module`` (bf16 logits / hidden states)."""

    def schedule(self, forward_step_func: Callable, micro: list[MicroBatch], *, forward_only: bool) -> list:
        """One ``forward_backward_func`` over ``micro``; its ``loss_reduced`` list."""
        return self.forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=iter(micro), model=self.model,
            num_microbatches=len(micro), seq_length=int(micro[0].input_ids.shape[1]),
            micro_batch_size=int(micro[0].input_ids.shape[0]), forward_only=forward_only,
        )

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()


def gpu_rig(shape: ModelShape, recompute: Recompute, *, seq_len: int, spec: LayerSpec, seed: int = 1234) -> Rig:
    """``shape`` as megatron-core's GPTModel with the ``spec`` layer on the current GPU, split over ``parallel_state``'s
    tensor-parallel group (initialized before; every rank of it builds the same model and feeds it the same
    micro-batches)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    shape.check_tensor_parallel(tp)
    config = gpt_config(shape, recompute, tp=tp)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    gpt = GPTModel(
        config=config, transformer_layer_spec=layer_spec(spec),
        vocab_size=shape.vocab, max_sequence_length=seq_len, parallel_output=True,
        share_embeddings_and_output_weights=shape.tied, position_embedding_type="rope", rotary_base=ROPE_BASE,
    ).cuda()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    ddp = DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return Rig(model=ddp, groups=ParallelGroups.from_parallel_state(), forward_backward_func=get_forward_backward_func(),
               hidden=shape.hidden, vocab=shape.vocab, model_kwargs={"fp32_output": False})


def cpu_rig(groups: ParallelGroups, *, hidden: int, vocab: int, seq_len: int, seed: int = 3) -> Rig:
    """A :class:`Rig` from the CPU stand-ins at ``groups``' TP size: ``mp_grpo.train``'s GPT stand-in (megatron-core's
    ``VocabParallelEmbedding`` + ``ColumnParallelLinear``, no attention, tied embeddings), its DDP with fp32
    ``main_grad`` and megatron-core's ``finalize_model_grads`` in a micro-batch loop. The same full weights on
    every layout (``seed``)."""
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

    from mp_grpo.train.cpu_ddp import CpuDistributedDataParallel
    from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config, random_full_weights
    from mp_grpo.train.cpu_schedule import forward_backward_cpu

    config = cpu_model_config(hidden_size=hidden, tensor_model_parallel_size=groups.tp_size)
    config.finalize_model_grads_func = finalize_model_grads
    model = CpuGPTStandIn(config, vocab_size=vocab, max_sequence_length=seq_len, tp_group=groups.tp,
                          share_embeddings_and_output_weights=True)
    model.load_full_weights(random_full_weights(config, vocab_size=vocab, max_sequence_length=seq_len, seed=seed))
    model.word_embeddings.weight.zero_out_wgrad = True  # as GPTModel does for the tied weight
    ddp = CpuDistributedDataParallel(config, DistributedDataParallelConfig(), model, dp_cp_group=groups.dp_cp,
                                     main_grad=True)

    def forward_backward_func(**kwargs):
        kwargs.pop("seq_length"), kwargs.pop("micro_batch_size")
        return forward_backward_cpu(groups=groups, **kwargs)

    return Rig(model=ddp, groups=groups, forward_backward_func=forward_backward_func, hidden=hidden, vocab=vocab)


def synthetic_micro_batches(num: int, batch: int, seq_len: int, vocab: int, *, seed: int,
                            device: torch.device | str, loss_fraction: float | None = None) -> list[MicroBatch]:
    """``num`` padded micro-batches of ``batch`` full rows of ``seq_len`` tokens (see the module docstring); with
    ``loss_fraction`` the completion is that fraction of each row (its first token always a prompt)."""
    gen = torch.Generator().manual_seed(seed)
    if loss_fraction is None:
        prompt = max(seq_len // PROMPT_FRACTION, 1)
    else:
        prompt = max(seq_len - round(loss_fraction * seq_len), 1)
    micro = []
    for _ in range(num):
        tokens = torch.randint(0, vocab, (batch, seq_len), generator=gen)
        loss_mask = torch.zeros(batch, seq_len, dtype=torch.bool)
        loss_mask[:, prompt:] = True
        rollouts = Rollouts(tokens=tokens, lengths=torch.full((batch,), seq_len), loss_mask=loss_mask,
                            advantages=torch.randn(batch, generator=gen))
        micro.append(prepare_micro_batch(rollouts, seq_len=seq_len).to(device))
    return micro
