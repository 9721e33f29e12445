"""Host launch code and autograd Functions around the Triton kernels."""

from mp_grpo.ops.checks import CheckInputs, check_errors
from mp_grpo.ops.fused_linear_logprobs import (
    FusedLinearLogProbs,
    fused_linear_logprobs,
    fused_linear_logprobs_with_top_k,
)
from mp_grpo.ops.sampling_filter import SamplingFilter, count_outside_filter
from mp_grpo.ops.token_ids import CapturedSupport, TokenIds
from mp_grpo.ops.top_k_logprobs import TokenLogprobs
from mp_grpo.ops.vocab_parallel_logprobs import (
    VocabParallelLogProbs,
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_with_top_k,
)

__all__ = [
    "CapturedSupport",
    "CheckInputs",
    "check_errors",
    "FusedLinearLogProbs",
    "SamplingFilter",
    "TokenIds",
    "TokenLogprobs",
    "VocabParallelLogProbs",
    "count_outside_filter",
    "fused_linear_logprobs",
    "fused_linear_logprobs_with_top_k",
    "vocab_parallel_logprobs",
    "vocab_parallel_logprobs_with_top_k",
]
