"""A CPU stand-in for GPTModel, built from megatron-core's real tensor-parallel layers.

megatron-core 0.16's GPTModel builds on CPU but cannot run there (its attention asks for a CUDA
buffer), so CPU tests and the CPU main job use this model instead. It keeps everything the loss
adapter sees from GPTModel: the same call ``model(input_ids, position_ids, attention_mask,
packed_seq_params=...)`` and the same output — vocab-parallel logits ``[B, S_local, V_local]``
(``parallel_output=True``), computed in Megatron's ``[S, B, H]`` activation layout. It has no
attention: every position is computed from its own token and position only, so context parallelism
needs no ring exchange and packed segments cannot leak into each other.

Sequence parallelism is not available here: megatron-core's sequence-parallel mappings allocate
their all-gather / reduce-scatter buffers on CUDA. The GPU tests cover it with GPTModel.

Schedule of :meth:`CpuGPTStandIn.forward`

1. Word embeddings (``VocabParallelEmbedding``, all-reduced over TP) + position embeddings, ``[B, S, H]``.
2. To Megatron's ``[S, B, H]``.
3. One residual block: ``x + tanh(W · LayerNorm(x) + b)``; with ``num_moe_experts`` then an MoE block
   ``x + MoELayer(x)``: megatron-core's own ``MoELayer`` (local spec: ``TopKRouter``, ``SequentialMLP``
   experts, the allgather token dispatcher), aux / z losses and routing replay included. Its router's
   gating is the one piece replaced (:class:`CpuTopKRouter`): megatron-core 0.16's moves the router
   weight to CUDA and calls a Transformer Engine GEMM whose import failed.
4. With ``logit_offset_channel``, one more input channel of the output layer, a constant 1: its weight column
   is a per-token bias inside the output GEMM (:func:`random_full_weights` starts it at ``logit_offset``, which
   puts the logits, and their bf16 rounding, at a trained LLM's scale; the softmax does not see the shift).
5. Output layer (``ColumnParallelLinear``, no bias, ``gather_output=False``): ``[S, B, V_local]``,
   returned as ``[B, S, V_local]`` like GPTModel. It is called as GPTModel's ``_postprocess`` calls
   it — ``output_layer(x, weight=...)``, with the word-embedding weight under
   ``share_embeddings_and_output_weights`` — so the fused output path
   (:mod:`mp_grpo.megatron.fused_output`) runs on it unchanged.
"""

from __future__ import annotations

import torch
from megatron.core.enums import ModelType
from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

from mp_grpo.collectives import ProcessGroup, group_rank, group_size


def cpu_model_config(
    *,
    hidden_size: int,
    tensor_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    calculate_per_token_loss: bool = False,
    num_moe_experts: int | None = None,
    moe_router_topk: int = 2,
    moe_aux_loss_coeff: float = 0.0,
    moe_z_loss_coeff: float | None = None,
    moe_enable_routing_replay: bool = False,
    params_dtype: torch.dtype = torch.float32,
) -> TransformerConfig:
    """A ``TransformerConfig`` for :class:`CpuGPTStandIn` (CPU initialization, one layer, ``params_dtype``: fp32, or
    bf16 as Megatron's ``Float16Module`` holds it; with ``num_moe_experts`` an MoE block of that many experts,
    top-``moe_router_topk``, expert FFN size = hidden)."""
    if params_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"params_dtype: got {params_dtype}; allowed: torch.float32 | torch.bfloat16")
    moe = {}
    if num_moe_experts:
        moe = dict(num_moe_experts=num_moe_experts, moe_router_topk=moe_router_topk, moe_aux_loss_coeff=moe_aux_loss_coeff,
                   moe_z_loss_coeff=moe_z_loss_coeff, moe_enable_routing_replay=moe_enable_routing_replay,
                   moe_token_dispatcher_type="allgather", moe_ffn_hidden_size=hidden_size, add_bias_linear=False,
                   moe_router_load_balancing_type="aux_loss")
    return TransformerConfig(**moe,
        num_layers=1,
        hidden_size=hidden_size,
        num_attention_heads=tensor_model_parallel_size,  # unused (no attention); Megatron wants a multiple of TP
        use_cpu_initialization=True,
        tensor_model_parallel_size=tensor_model_parallel_size,
        context_parallel_size=context_parallel_size,
        calculate_per_token_loss=calculate_per_token_loss,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
    )


class CpuTopKRouter(TopKRouter):
    """megatron-core's ``TopKRouter`` with a gating GEMM that runs on CPU (see the module docstring, step 3)."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)


class CpuGPTStandIn(MegatronModule):
    """GPTModel's interface and tensor-parallel data path on CPU; see the module docstring."""

    def __init__(
        self,
        config: TransformerConfig,
        *,
        vocab_size: int,
        max_sequence_length: int,
        tp_group: ProcessGroup | None = None,
        share_embeddings_and_output_weights: bool = False,
        logit_offset_channel: bool = False,
    ) -> None:
        """``config.params_dtype``: every parameter and activation in it (bf16: as Megatron's ``Float16Module``
        casts GPTModel). ``logit_offset_channel``: the output layer reads a constant-1 channel more (step 4)."""
        super().__init__(config=config)
        if config.sequence_parallel:
            raise ValueError("config.sequence_parallel: the CPU stand-in cannot run sequence parallelism (see the module docstring)")
        if logit_offset_channel and share_embeddings_and_output_weights:
            raise ValueError("logit_offset_channel: the output layer reads hidden_size + 1 channels, so its weight cannot "
                             "be the word embeddings' (share_embeddings_and_output_weights)")
        self.logit_offset_channel = logit_offset_channel
        self.model_type = ModelType.encoder_or_decoder
        self.vocab_size = vocab_size
        self.tp_group = tp_group
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        init = torch.nn.init.normal_
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size, config.hidden_size, init_method=init, config=config, tp_group=tp_group
        )
        self.position_embeddings = torch.nn.Embedding(max_sequence_length, config.hidden_size)
        self.norm = torch.nn.LayerNorm(config.hidden_size)
        self.mix = torch.nn.Linear(config.hidden_size, config.hidden_size)
        self.output_layer = ColumnParallelLinear(
            config.hidden_size + int(logit_offset_channel), vocab_size, config=config, init_method=init, bias=False, gather_output=False,
            skip_weight_param_allocation=share_embeddings_and_output_weights, tp_group=tp_group,
        )
        self.moe = None
        if config.num_moe_experts:
            if config.tensor_model_parallel_size > 1:
                raise ValueError("num_moe_experts with TP > 1 needs sequence parallelism, which the CPU stand-in cannot run")
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
            from megatron.core.transformer.spec_utils import build_module

            spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
            self.moe = build_module(spec.submodules.mlp, config=config)  # process groups: megatron-core's parallel_state
            self.moe.router.__class__ = CpuTopKRouter  # the same instance (RouterReplay registered it once)
            self.moe.set_layer_number(1)
        if config.params_dtype != torch.float32:  # the torch modules too (Megatron's layers are created in it)
            self.to(config.params_dtype)

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline hook called by Megatron's schedule; this model is a single stage."""

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        # --- 1. embeddings ---
        x = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        # --- 2. Megatron's [S, B, H] ---
        x = x.transpose(0, 1).contiguous()
        # --- 3. residual block ---
        x = x + torch.tanh(self.mix(self.norm(x)))
        if self.moe is not None:
            x = x + self.moe(x)[0]
        # --- 4. the constant channel of the per-token logit offset ---
        if self.logit_offset_channel:
            x = torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)
        # --- 5. vocab-parallel output layer (tied: GPTModel's shared_embedding_or_output_weight) ---
        weight = self.word_embeddings.weight if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(x, weight=weight)
        return logits.transpose(0, 1).contiguous()

    @torch.no_grad()
    def load_full_weights(self, full: dict[str, torch.Tensor]) -> None:
        """Copy unsharded weights in (vocab-sharded ones cut to this TP rank's rows; tied: no output-layer weight)."""
        tp, rank = group_size(self.word_embeddings.tp_group), group_rank(self.word_embeddings.tp_group)
        for name, param in self.named_parameters():
            value = full[name]
            if getattr(param, "tensor_model_parallel", False):
                rows = value.shape[0] // tp
                value = value[rank * rows : (rank + 1) * rows]
            if value.shape != param.shape:
                raise ValueError(f"{name}: weights of shape {tuple(value.shape)} for a parameter of shape {tuple(param.shape)} "
                                 "(logit_offset given to random_full_weights iff the model has logit_offset_channel)")
            param.copy_(value)  # rounded to the model's dtype


def random_full_weights(config: TransformerConfig, *, vocab_size: int, max_sequence_length: int, seed: int,
                        logit_offset: float = 0.0) -> dict[str, torch.Tensor]:
    """Unsharded fp32 weights for :class:`CpuGPTStandIn`, the same on every rank for a given seed. ``logit_offset``
    ≠ 0: for a model with ``logit_offset_channel``, the output weight's last column (the constant channel's) is
    that value for every token, the other weights those of the same seed without it."""
    gen = torch.Generator().manual_seed(seed)
    h = config.hidden_size

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    dense = {
        "word_embeddings.weight": normal(vocab_size, h, std=1.0),
        "position_embeddings.weight": normal(max_sequence_length, h, std=0.3),
        "norm.weight": 1.0 + normal(h, std=0.1),
        "norm.bias": normal(h, std=0.1),
        "mix.weight": normal(h, h, std=h**-0.5),
        "mix.bias": normal(h, std=0.1),
        "output_layer.weight": normal(vocab_size, h, std=h**-0.5),
    }
    # drawn after the dense weights: an MoE model's dense weights equal the dense model's for a seed
    moe = {}
    if config.num_moe_experts:
        moe["moe.router.weight"] = normal(config.num_moe_experts, h, std=0.3)
        for e in range(config.num_moe_experts):
            moe[f"moe.experts.local_experts.{e}.linear_fc1.weight"] = normal(config.moe_ffn_hidden_size, h, std=h**-0.5)
            moe[f"moe.experts.local_experts.{e}.linear_fc2.weight"] = normal(h, config.moe_ffn_hidden_size, std=h**-0.5)
    if logit_offset != 0.0:
        column = torch.full((vocab_size, 1), float(logit_offset))
        dense["output_layer.weight"] = torch.cat([dense["output_layer.weight"], column], dim=1)
    return dense | moe
