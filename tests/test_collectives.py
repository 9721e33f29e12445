"""The collective helpers (mp_grpo/collectives.py): a group of one returns early; several ranks under torchrun / gloo."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_grpo.collectives import all_gather_stacked, all_gather_varlen, all_reduce_sum, group_size
from tests.distributed import torchrun, worker_main


def _values(rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s 1-D values: distinct per rank and position, so a misplaced value is seen."""
    return torch.arange(size, dtype=torch.float64) + 100.0 * rank + 0.5


def test_a_group_of_one_makes_no_collective() -> None:
    x = torch.randn(5, dtype=torch.float64)
    assert group_size(None) == 1
    assert all_gather_varlen(x, None) is x
    assert torch.equal(all_gather_stacked(x, None), x.unsqueeze(0))
    summed = all_reduce_sum(x, None)
    assert torch.equal(summed, x) and summed is not x  # a new tensor: the caller's is never reduced in place


def case_varlen(sizes: list[int]) -> None:
    rank = dist.get_rank()
    mine = _values(rank, sizes[rank])
    before = mine.clone()
    gathered = all_gather_varlen(mine, dist.group.WORLD)
    expected = torch.cat([_values(r, n) for r, n in enumerate(sizes)])
    assert torch.equal(gathered, expected), (gathered, expected)
    assert torch.equal(mine, before)


def test_all_gather_varlen_concatenates_in_rank_order() -> None:
    # unequal sizes, one rank empty; every rank empty (the gather of the values is skipped)
    torchrun(__file__, "case_varlen", nproc=3, sizes=[3, 0, 5])
    torchrun(__file__, "case_varlen", nproc=2, sizes=[0, 0])


if __name__ == "__main__":
    worker_main({"case_varlen": case_varlen})
