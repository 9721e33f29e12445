"""Batch invariance on a CUDA GPU: a row's log-prob, entropy and gradient are bitwise the same alone and
among 7 … 65536 other rows, at any position and leading shape, with and without a sampling filter.
Skipped without a GPU (the CPU suite checks the same under the Triton interpreter with small counts).

    python -m pytest tests/gpu/test_logprob_batch_invariance.py -v
"""

from __future__ import annotations

import pytest
import torch

from mp_grpo.ops import SamplingFilter
from tests.ops.batch_invariance import assert_batch_invariant

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize(
    "vocab,batch_sizes",
    [(18992, (1, 7, 1000, 16384, 65536)), (151936, (1, 33, 4096))],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_invariant_on_gpu(vocab, batch_sizes, dtype):
    if dtype == torch.float32 and vocab == 18992:
        batch_sizes = batch_sizes[:-1]  # 65536 x 18992 fp32 logits + gradient: 10 GB, skip the largest
    assert_batch_invariant(vocab, dtype, "cuda", batch_sizes, filt=None, leading_shapes=((8, 125), (64, 64), (256, 256)))


@pytest.mark.parametrize("filt", [SamplingFilter(top_k=50), SamplingFilter(top_p=0.95), SamplingFilter(top_k=50, top_p=0.9)],
                         ids=["top_k", "top_p", "top_k+top_p"])
def test_batch_invariant_filtered_on_gpu(filt):
    assert_batch_invariant(151936, torch.bfloat16, "cuda", (1, 33, 4096), filt=filt, leading_shapes=((64, 64),))
