"""Megatron's 2·CP chunk layout as index tensors (mp_grpo/megatron/context_parallel.py).

The padded split is also checked against megatron-core's own ``get_batch_on_this_cp_rank`` under
torchrun in tests/megatron/test_loss_func.py.
"""

from __future__ import annotations

import pytest
import torch

from mp_grpo.megatron.context_parallel import cp_positions, select_positions, thd_cp_positions


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ranks_hold_chunks_r_and_mirror(cp: int) -> None:
    seq_len = 2 * cp * 3
    chunk = seq_len // (2 * cp)
    seen = []
    for rank in range(cp):
        pos = cp_positions(seq_len, cp, rank)
        assert pos.dtype == torch.int64 and pos.numel() == 2 * chunk
        assert pos[:chunk].tolist() == list(range(rank * chunk, (rank + 1) * chunk))
        mirror = 2 * cp - 1 - rank
        assert pos[chunk:].tolist() == list(range(mirror * chunk, (mirror + 1) * chunk))
        seen.append(pos)
    assert sorted(torch.cat(seen).tolist()) == list(range(seq_len))  # every position on exactly one rank


def test_thd_splits_every_segment() -> None:
    cu = torch.tensor([0, 4, 12, 16], dtype=torch.int32)  # segments of 4, 8, 4 tokens; CP = 2
    rank0 = thd_cp_positions(cu, 2, 0).tolist()
    rank1 = thd_cp_positions(cu, 2, 1).tolist()
    assert rank0 == [0, 3, 4, 5, 10, 11, 12, 15]
    assert rank1 == [1, 2, 6, 7, 8, 9, 13, 14]


def test_select_positions_leaves_input_alone() -> None:
    x = torch.arange(12).view(2, 6)
    before = x.clone()
    out = select_positions(x, cp_positions(6, 3, 1))
    assert out.tolist() == [[1, 4], [7, 10]]
    assert torch.equal(x, before)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="seq_len .* multiple of 2·cp_size"):
        cp_positions(10, 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        cp_positions(8, 2, 2)
    with pytest.raises(ValueError, match="multiple of 2·cp_size"):
        thd_cp_positions(torch.tensor([0, 4, 10]), 2, 0)
