"""mp_grpo: model-parallel GRPO loss for Megatron-core.

- :func:`vocab_parallel_logprobs`: exact token log-probs (and entropy) from a vocabulary sharded
  over tensor-parallel ranks, one Triton pass forward and one backward, one small collective.
"""

# First, before anything imports triton: on a machine without a GPU this selects Triton's
# interpreter (see mp_grpo/kernels/__init__.py).
import mp_grpo.kernels  # noqa: F401  isort: skip

from mp_grpo.ops import vocab_parallel_logprobs

__all__ = ["vocab_parallel_logprobs"]
