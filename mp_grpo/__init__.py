"""mp_grpo: model-parallel GRPO loss for Megatron-core.

- :func:`vocab_parallel_logprobs`: exact token log-probs (and entropy) from a vocabulary sharded
  over tensor-parallel ranks, one Triton pass forward and one backward, one small collective.
- :func:`fused_linear_logprobs`: the same from the hidden states and the output-layer weight shard,
  chunk by chunk, never holding the whole logits; :func:`fused_linear_loss`: a token-separable loss of
  those log-probs with its gradient made in forward (no recompute). Each takes the rollout engine's
  :class:`CapturedSupport` (log-probs renormalized over the ids it sampled from); the ``*_with_top_k`` ops also
  return the log-probs at the engine's top-K ids (:class:`TokenIds`).
- :class:`GRPOLoss`, :class:`GlobalBatch`, :func:`reduce_metrics`, :class:`LossConfig`, :func:`load_config`:
  the GRPO-family loss with every correction, normalized by the step's explicit global account
  (``docs/loss.md``); :class:`PaddedSequences` / :class:`PackedSequences` for padded, packed and
  context-parallel sequences; :func:`preset_names` lists the shipped loss presets, :class:`ConfigError` is
  what a bad config raises; :class:`LogitDtype` sets the precision of the output layer's logits (``bf16`` as
  the model makes them, ``fp32`` from the same bf16 operands at bf16 cost: ``README.md``, "Precision").
"""

__version__ = "0.1.0"
"""The package's version: the one place it is written (``pyproject.toml`` reads it, ``dynamic = ["version"]``)."""

# First, before anything imports triton: on a machine without a GPU this selects Triton's
# interpreter (see mp_grpo/kernels/__init__.py).
import mp_grpo.kernels  # noqa: F401  isort: skip

from mp_grpo.ops import (
    CapturedSupport,
    TokenIds,
    fused_linear_logprobs,
    fused_linear_logprobs_with_top_k,
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_with_top_k,
)
from mp_grpo.ops.checks import CheckInputs, check_errors
from mp_grpo.ops.fused_linear_loss import fused_linear_loss

# The GRPO-family loss layer (plain torch) and its typed config (omegaconf is only needed by load_config).
from mp_grpo.config import ConfigError, LogitDtype, LossConfig, load_config, preset_names  # noqa: E402  isort: skip
from mp_grpo.loss import (  # noqa: E402  isort: skip
    GlobalBatch, GRPOLoss, LossBackend, PackedSequences, PaddedSequences, SequenceLayout, reduce_metrics,
)

__all__ = ["CheckInputs", "check_errors", "fused_linear_logprobs", "fused_linear_loss", "vocab_parallel_logprobs"]
__all__ += ["CapturedSupport", "TokenIds", "fused_linear_logprobs_with_top_k", "vocab_parallel_logprobs_with_top_k"]
__all__ += ["ConfigError", "GRPOLoss", "GlobalBatch", "LogitDtype", "LossBackend", "LossConfig", "PackedSequences",
            "PaddedSequences", "SequenceLayout", "load_config", "preset_names", "reduce_metrics"]
__all__ += ["__version__"]
