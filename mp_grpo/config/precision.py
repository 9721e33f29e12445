"""The precision of the output layer's logits: :class:`LogitDtype` (Megatron-LM's ``--output-logit-dtype``).

Every log-prob mp_grpo makes — the training step's, the old and reference policies' forward-only passes, the
rollout engine's of the main job — is computed from the logits of the output layer ``hidden @ weightᵀ``. With
bf16 hidden states and weight, the products are exact in fp32 and cuBLAS sums them in fp32; what the setting
decides is whether that fp32 sum is rounded to bf16 before the softmax. Rounded, a log-prob carries an error
of the order of the logits' bf16 rounding (0.16 nats at most, 0.023 on average, at logit maxima near 30 on one
H100: ``docs/benchmarks/precision.md``); kept in fp32, that of the tensor cores' fp32 accumulation (2.4e-4 at most,
6e-5 on average there; 1e-5 on average for the tokens a policy samples). The
gradients flow into the same bf16 GEMMs either way: only the logits' values differ, never the dtype of the
weights or of their gradients.
"""

from __future__ import annotations

from enum import Enum


class LogitDtype(str, Enum):
    """Dtype of the logits the log-probs, the entropy and the loss are computed from.

    The names and values of Megatron-LM's ``--output-logit-dtype`` (GPTModel's ``logit_dtype``); NeMo-RL's
    ``policy.megatron_cfg.fp32_lm_head: true``, TRL's ``cast_lm_head_to_fp32``, vLLM's ``head_dtype=float32`` and
    sglang's ``--enable-fp32-lm-head`` ask for what ``FP32`` gives — here without an fp32 copy of the weight or
    of the hidden states, and without fp32 GEMMs.
    """

    BF16 = "bf16"
    """The logits in the output layer's own dtype: rounded to bf16 under bf16 training, as every framework's
    output layer makes them (fp32 for an fp32 model)."""
    FP32 = "fp32"
    """The logits of the same bf16 operands kept in fp32: the GEMM writes its fp32 accumulator (on the fused path
    one chunk at a time), never rounded to bf16; the logits' gradient is rounded to the operands' dtype for the
    backward GEMMs, as on the bf16 path."""
