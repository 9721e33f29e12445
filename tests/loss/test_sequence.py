"""Sequence layouts (mp_grpo/loss/sequence.py): per-sequence sums and broadcasts, packed = padded, bad input.

The context-parallel all-reduce (SumOverGroup, sum forward and sum backward) is exercised under torchrun in
test_layout_invariance.py (case_context_parallel)."""

from __future__ import annotations

import pytest
import torch

from mp_grpo.loss import PackedSequences, PaddedSequences, sum_over_group


def test_padded_sums_and_broadcast() -> None:
    x = torch.randn(3, 5, 2, dtype=torch.float64, requires_grad=True)
    layout = PaddedSequences()
    sums = layout.seq_sum(x, torch.Size([3, 5]))
    torch.testing.assert_close(sums, x.sum(1))
    back = layout.broadcast(sums, torch.Size([3, 5]))
    assert back.shape == (3, 5, 2)
    torch.testing.assert_close(back[:, 4], sums)
    g = torch.randn(3, 5, 2, dtype=torch.float64)
    (back * g).sum().backward()
    torch.testing.assert_close(x.grad, g.sum(1, keepdim=True).expand(3, 5, 2))  # d(broadcast of the sum)
    assert layout.num_sequences(torch.Size([3, 5])) == 3 and layout.owns_sequences
    assert layout.in_sequence(torch.Size([3, 5]), x.device) is None


@pytest.mark.parametrize("shape", ["flat", "row"])
def test_packed_matches_segments(shape: str) -> None:
    cu = torch.tensor([0, 3, 3, 7, 9])  # an empty segment; positions 9, 10 are after the last one
    n = 11
    x = torch.randn(n, dtype=torch.float64, requires_grad=True)
    token_shape = torch.Size([n]) if shape == "flat" else torch.Size([1, n])
    layout = PackedSequences(cu)
    xs = x.view(token_shape)
    sums = layout.seq_sum(xs, token_shape)
    expected = torch.stack([x[0:3].sum(), x[3:3].sum(), x[3:7].sum(), x[7:9].sum()])
    torch.testing.assert_close(sums, expected)
    inside = layout.in_sequence(token_shape, x.device)
    assert inside.reshape(-1).tolist() == [True] * 9 + [False] * 2
    values = torch.tensor([10.0, 20.0, 30.0, 40.0], dtype=torch.float64)
    spread = layout.broadcast(values, token_shape).reshape(-1)
    assert spread.tolist() == [10.0] * 3 + [30.0] * 4 + [40.0] * 2 + [0.0] * 2
    g = torch.randn(4, dtype=torch.float64)
    (sums * g).sum().backward()
    assert x.grad.tolist() == [g[0].item()] * 3 + [g[2].item()] * 4 + [g[3].item()] * 2 + [0.0] * 2
    mask = torch.ones(token_shape, dtype=torch.bool)
    assert layout.valid_tokens(mask).reshape(-1).tolist() == [True] * 9 + [False] * 2
    assert layout.num_sequences(token_shape) == 4


def test_sum_over_group_without_group_is_identity() -> None:
    x = torch.randn(3, requires_grad=True)
    assert sum_over_group(x, None) is x


@pytest.mark.parametrize(
    ("cu", "match"),
    [
        (torch.tensor([[0, 3]]), "1-D"),
        (torch.tensor([0.0, 3.0]), "int32/int64"),
        ([0, 3], "tensor"),
        (torch.tensor([1, 3]), "start at 0"),
        (torch.tensor([0, 4, 3]), "never decrease"),
    ],
)
def test_packed_rejects_bad_cu_seqlens(cu, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PackedSequences(cu)


def test_token_shape_checks_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"logprobs must be \[B, T\]"):
        PaddedSequences().check_tokens(torch.Size([4]), "logprobs")
    with pytest.raises(ValueError, match=r"masks\[0\] must be \[T\] or \[1, T\]"):
        PackedSequences(torch.tensor([0, 2])).check_tokens(torch.Size([2, 2]), "masks[0]")
