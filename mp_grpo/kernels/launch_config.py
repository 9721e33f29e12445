"""The one place that picks block sizes and warps for the log-prob kernels.

Chosen by a sweep on one H100 (``scripts/bench_logprob.py --sweep``; the table is in
``docs/benchmarks/logprob.md``). Under the Triton interpreter (CPU) small blocks keep tests fast.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
from triton import knobs


@dataclass(frozen=True)
class LogprobLaunchConfig:
    stats_block_v: int
    """Columns per loop step of the statistics kernel (one program per row)."""
    stats_warps: int
    backward_block_v: int
    """Columns per program of the backward kernel (grid: rows x column blocks)."""
    backward_warps: int
    merge_block_n: int
    """Rows per program of the merge kernel."""


def logprob_launch_config(v_local: int) -> LogprobLaunchConfig:
    """Launch parameters for a shard of ``v_local`` columns."""
    if knobs.runtime.interpret:
        block = min(triton.next_power_of_2(v_local), 64)
        return LogprobLaunchConfig(block, 1, block, 1, 16)
    stats_block = min(triton.next_power_of_2(v_local), 4096)
    backward_block = min(triton.next_power_of_2(v_local), 4096)
    return LogprobLaunchConfig(
        stats_block_v=stats_block,
        stats_warps=8 if stats_block >= 2048 else 4,
        backward_block_v=backward_block,
        backward_warps=8 if backward_block >= 2048 else 4,
        merge_block_n=256,
    )
