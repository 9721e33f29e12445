"""Host launch code and autograd Functions around the Triton kernels."""

from mp_grpo.ops.checks import CheckInputs, check_errors
from mp_grpo.ops.fused_linear_logprobs import FusedLinearLogProbs, fused_linear_logprobs
from mp_grpo.ops.sampling_filter import SamplingFilter, count_outside_filter
from mp_grpo.ops.vocab_parallel_logprobs import VocabParallelLogProbs, vocab_parallel_logprobs

__all__ = [
    "CheckInputs",
    "check_errors",
    "FusedLinearLogProbs",
    "SamplingFilter",
    "VocabParallelLogProbs",
    "count_outside_filter",
    "fused_linear_logprobs",
    "vocab_parallel_logprobs",
]
