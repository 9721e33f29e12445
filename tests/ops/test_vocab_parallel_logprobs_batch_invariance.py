"""Batch invariance (CPU, Triton interpreter): a row's log-prob, entropy and gradient are bitwise the same
whatever the number of rows, its position, the leading shape and the row-count-dependent launch
parameters; with and without a sampling filter. The GPU counterpart with large row counts is
tests/gpu/test_logprob_batch_invariance.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mp_grpo.ops import SamplingFilter, logprob_launch
from tests.ops.batch_invariance import assert_batch_invariant, run_rows


@pytest.mark.parametrize(
    "dtype,filt",
    [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, SamplingFilter(top_k=9, top_p=0.9, min_p=0.01))],
    ids=["fp32", "bf16", "bf16-filtered"],
)
def test_rows_are_bitwise_batch_invariant(dtype, filt):
    assert_batch_invariant(
        100, dtype, "cpu", (1, 3, 17, 64), filt=filt, seed=int(dtype.itemsize),
        leading_shapes=((8, 8), (4, 16)) if filt is None else (),  # the filtered case is slow in the interpreter
    )


def test_merge_block_does_not_change_bits(monkeypatch):
    """The merge kernel's rows per program (the only launch parameter shaped by the row count) changes
    no bit of any row."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 70, generator=gen) * 3
    target = torch.randint(0, 70, (9,), generator=gen)
    g_lp, g_ent = torch.randn(9, generator=gen), torch.randn(9, generator=gen)
    default = run_rows(logits, target, g_lp, g_ent, filt=None)
    original = logprob_launch.logprob_launch_config
    monkeypatch.setattr(logprob_launch, "logprob_launch_config",
                        lambda v: dataclasses.replace(original(v), merge_block_n=2))
    other = run_rows(logits, target, g_lp, g_ent, filt=None)
    for a, b, name in zip(default, other, ("log-prob", "entropy", "gradient")):
        assert torch.equal(a, b), name
