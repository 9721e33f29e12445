"""Host launch code and autograd Functions around the Triton kernels."""

from mp_grpo.ops.fused_linear_logprobs import FusedLinearLogProbs, fused_linear_logprobs
from mp_grpo.ops.vocab_parallel_logprobs import VocabParallelLogProbs, vocab_parallel_logprobs

__all__ = ["FusedLinearLogProbs", "VocabParallelLogProbs", "fused_linear_logprobs", "vocab_parallel_logprobs"]
