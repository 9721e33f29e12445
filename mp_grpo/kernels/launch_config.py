"""The one place that picks block sizes and warps for the log-prob kernels.

Chosen by a sweep on one GPU (``scripts/bench_logprob.py --sweep``, results in
``docs/benchmarks/logprob_sweep.json``). Under the Triton interpreter (CPU) small blocks keep tests fast.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton
from triton import knobs

INTERPRETER: bool = bool(knobs.runtime.interpret)
"""Whether Triton runs its interpreter (read once: Triton decides it when the kernels are defined, at import;
reading the knob per launch cost a few microseconds of host time each)."""


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for grid sizes, in plain Python (``triton.cdiv`` is a constexpr function: a few
    microseconds of host time per call)."""
    return -(-a // b)


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
    filter_count_block_v: int
    """Columns per loop step of the threshold search's counting passes (``tl.histogram`` of 256 digits)."""
    filter_count_warps: int
    filter_mass_block_v: int
    """Columns per loop step of its mass passes (a ``[16, filter_mass_block_v]`` fp32 register accumulator)."""
    filter_mass_warps: int
    candidate_group: int
    """Columns per group of the candidate search: the statistics' read keeps each group's maximum
    (``kernels/logprob_candidates.py``)."""
    candidate_keep: int
    """Groups whose maxima set the candidates' threshold: top-k with k <= this always finishes on them."""
    candidate_groups_cap: int
    """Most groups read again for candidates (more: ties, the row takes the fallback)."""
    candidate_cap: int
    """Most candidates a row keeps (a power of two; more: the row takes the fallback)."""
    candidates_warps: int
    """Warps of the per-row candidate kernel (its group maxima in registers)."""
    select_warps: int
    """Warps of the candidate select kernel (one program a row over ``TP x candidate_cap`` candidates)."""
    support_block_k: int = 128
    """Ids per loop step of the captured-support kernels (``kernels/logprob_support.py``; one program a row gathers
    its support's logits: one id a thread at 4 warps)."""
    support_warps: int = 4
    ids_block_k: int = 32
    """Ids per loop step of the kernels at the engine's top-K ids (``kernels/logprob_at_ids.py``; K = 20 fits one)."""
    ids_block_s: int = 128
    """Support ids per step of the top-K ids' membership test (a ``[ids_block_k, ids_block_s]`` compare)."""
    ids_warps: int = 1


LONG_ROW_V_LOCAL = 2**16
"""Shards wider than this take the long-row launch configuration (8192 columns, 8 warps)."""


def candidate_group(v_local: int) -> int:
    """Columns per candidate group for a shard of ``v_local`` columns: the smallest power of two >= 8 that keeps the
    row's group maxima at or under 1024 — 2048 for long rows (> ``LONG_ROW_V_LOCAL``), so that the chosen groups'
    re-read stays ~11 % of the row. The candidate kernel holds them in one warp's registers (32 / 64 keys a lane)."""
    most = 2048 if v_local > LONG_ROW_V_LOCAL else 1024
    return max(8, triton.next_power_of_2(ceil_div(v_local, most)))


@functools.lru_cache(maxsize=256)
def logprob_launch_config(v_local: int) -> LogprobLaunchConfig:
    """Launch parameters for a shard of ``v_local`` columns.

    Depends on ``v_local`` (and interpreter vs GPU) only, never on the number of rows: the per-row
    reduction order is fixed by these block sizes, which is what makes the log-probs batch-invariant
    (docs/kernel.md, "Batch invariance").
    """
    if INTERPRETER:
        block = max(min(triton.next_power_of_2(v_local), 64), 8)
        # Tiny candidate sets (the 4 largest of 8-column groups, at most 16 candidates): the CPU tests' rows of
        # 40-300 columns run both the candidate path and the fallback (tests/ops/test_sampling_filter_paths.py).
        return LogprobLaunchConfig(block, 1, block, 1, 16, block, 1, block, 1, candidate_group=8, candidate_keep=4,
                                   candidate_groups_cap=8, candidate_cap=16, candidates_warps=1, select_warps=1,
                                   support_block_k=8, support_warps=1, ids_block_k=4, ids_block_s=8, ids_warps=1)
    # H200 sweep, N = 16384, bf16 (docs/benchmarks/logprob_sweep.json): 4096 columns with 4 warps
    # was fastest or within 1 % of it for both kernels at V_local = 151936 and 18992. Long shards take
    # 8192 x 8 (H100, fwd+bwd as CUDA-graph replays, docs/benchmarks/logprob_filter.md "Batch invariance"):
    # at V_local = 151936 it is the best of the sweep at N = 256 and 16384 and within 1.6 % of it at 2048,
    # where 4096 x 4 cost 11 % at N = 256 (few one-row programs want more warps each); at 18992, 4096 x 4
    # stays (8192 x 8 is 3-5 % slower at N = 2048 / 16384). Measured at those two sizes only: the
    # threshold between them is a choice (2**16).
    long_row = v_local > LONG_ROW_V_LOCAL
    block = min(triton.next_power_of_2(v_local), 8192 if long_row else 4096)
    warps = 8 if long_row else 4
    return LogprobLaunchConfig(
        stats_block_v=block,
        stats_warps=warps,
        backward_block_v=block,
        backward_warps=warps,
        merge_block_n=256,
        # The radix fallback's passes (H100, N = 16384 bf16, V = 151936 and 18992, a sweep of the pass kernels alone,
        # every row searched): counting 4096 x 4 warps (8.68 / 1.16 ms; the best of 2048-8192 x 4-8);
        # masses on a [16, 512] tile, 512 x 4 warps (7.66 / 1.01 ms: fastest at V = 18992, within 0.3 % of
        # 1024 x 4 at 151936; 64 fp32 accumulators a thread).
        filter_count_block_v=min(triton.next_power_of_2(v_local), 4096),
        filter_count_warps=4,
        filter_mass_block_v=min(triton.next_power_of_2(v_local), 512),
        filter_mass_warps=4,
        # The 128 largest group maxima: top-k <= 128 always finishes on the candidates; ~130-200 candidates a row
        # (a trained policy's or iid rows), at most 512 (1 KB a row in bf16); the chosen groups re-read are
        # ~128 x group / V_local of the row (11 % at V_local = 151936: groups of 128 columns; 22 % at 18992: 32).
        # The per-row kernels run one warp a row (no block-wide barrier; many rows in flight): with 4 warps and
        # groups of 16 at V_local = 18992 the candidate kernel took 0.33 ms, 1.5x the read (H100, N = 16384).
        candidate_group=candidate_group(v_local),
        candidate_keep=128,
        candidate_groups_cap=256,
        candidate_cap=512,
        candidates_warps=1,
        select_warps=1,
        # Not swept: a support of up to 512 ids (prime-rl's cap) in 4 steps of one id a thread; the engine's top-K
        # ids (K = 20) in one step of one warp. Their cost beside the unrestricted op: docs/benchmarks/fused.md.
        support_block_k=128,
        support_warps=4,
        ids_block_k=32,
        ids_block_s=128,
        ids_warps=1,
    )
