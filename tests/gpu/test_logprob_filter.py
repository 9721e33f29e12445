"""vocab_parallel_logprobs with a sampling filter on a CUDA GPU, at real vocabulary sizes, vs the float64
reference that filters the full softmax (tests/reference.py). Skipped without a GPU.

    python -m pytest tests/gpu/test_logprob_filter.py tests/gpu/test_logprob_batch_invariance.py -v
"""

from __future__ import annotations

import pytest
import torch

from mp_grpo import vocab_parallel_logprobs
from mp_grpo.ops import SamplingFilter, count_outside_filter
from tests.reference import filtered_logprobs_reference, sampling_filter_keep_reference
from tests.tolerances import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FILTERS = [
    dict(top_k=20),
    dict(top_k=50),
    dict(top_p=0.9),
    dict(top_p=0.95),
    dict(min_p=0.05),
    dict(top_k=50, top_p=0.95, min_p=0.01),
]


def _peaky_logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A language-model-like row: a few dominant tokens over a long tail."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, vocab, device="cuda", generator=gen) * 2
    x[:, :40] += torch.linspace(9, 3, 40, device="cuda")
    return x[:, torch.randperm(vocab, device="cuda", generator=gen)].to(dtype)


@pytest.mark.parametrize("vocab", [151936, 18992])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("filt", FILTERS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_filter_matches_reference_on_gpu(vocab, dtype, filt):
    logits = _peaky_logits(16, vocab, dtype, seed=vocab % 97)
    temperature = 0.9
    keep = sampling_filter_keep_reference(logits.cpu(), temperature=temperature, **filt)
    gen = torch.Generator().manual_seed(1)
    target = torch.multinomial(keep.double(), 1, generator=gen).squeeze(1).cuda()
    target[3] = -100
    x = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(x, target, temperature=temperature, with_entropy=True,
                                      sampling_filter=SamplingFilter(**filt))
    x_ref = logits.cpu().double().requires_grad_()
    lp_ref, ent_ref = filtered_logprobs_reference(x_ref, target.cpu(), temperature=temperature, **filt)
    assert_close(lp, lp_ref, torch.float32, "logprobs")
    assert_close(ent, ent_ref, torch.float32, "entropy")
    g_lp, g_ent = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    ((lp.double().cpu() * g_lp).sum() + (ent.double().cpu() * g_ent).sum()).backward()
    ((lp_ref * g_lp).sum() + (ent_ref * g_ent).sum()).backward()
    assert_close(x.grad, x_ref.grad, dtype, "grad")


def test_per_row_filters_and_outside_targets_on_gpu():
    logits = _peaky_logits(8, 18992, torch.bfloat16, seed=3)
    filt = dict(top_k=torch.tensor([20, 0, 50, 1, 5, 100, 0, 7], device="cuda"),
                top_p=torch.tensor([0.9, 0.95, 1.0, 0.5, 0.8, 0.9, 0.99, 1.0], device="cuda"))
    keep = sampling_filter_keep_reference(logits.cpu(), **{k: v.cpu() for k, v in filt.items()})
    target = torch.multinomial(keep.double(), 1, generator=torch.Generator().manual_seed(2)).squeeze(1)
    target[5] = int((~keep[5]).nonzero()[0])  # outside the kept set
    target = target.cuda()
    lp = vocab_parallel_logprobs(logits, target, sampling_filter=SamplingFilter(**filt), check_inputs=False)
    lp_ref, _ = filtered_logprobs_reference(logits.cpu(), target.cpu(), **{k: v.cpu() for k, v in filt.items()})
    assert_close(lp, lp_ref, torch.float32, "logprobs")
    assert int(count_outside_filter(lp, target)) == 1
    with pytest.raises(ValueError, match="outside the sampling_filter's kept set"):
        vocab_parallel_logprobs(logits, target, sampling_filter=SamplingFilter(**filt))
