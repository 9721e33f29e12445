"""Host launch code and autograd Functions around the Triton kernels."""

from mp_grpo.ops.vocab_parallel_logprobs import VocabParallelLogProbs, vocab_parallel_logprobs

__all__ = ["VocabParallelLogProbs", "vocab_parallel_logprobs"]
