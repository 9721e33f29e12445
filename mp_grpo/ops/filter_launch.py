"""Host launchers of the sampling filter's kernels: the candidate pass and its select kernel
(``kernels/logprob_candidates.py``), and the radix passes of the fallback (``kernels/logprob_filter.py``).
No collective here: :mod:`mp_grpo.ops.sampling_filter` makes them."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from mp_grpo.kernels.launch_config import LogprobLaunchConfig, ceil_div, logprob_launch_config
from mp_grpo.kernels.logprob_candidates import (
    logprob_candidate_select_kernel,
    logprob_candidates_kernel,
    logprob_group_max_kernel,
)
from mp_grpo.kernels.logprob_filter import (
    MODE_COUNT,
    MODE_EXACT,
    MODE_MASS,
    logprob_radix_hist_kernel,
    logprob_radix_search_kernel,
    logprob_radix_select_kernel,
)
from mp_grpo.ops.launcher import LaunchMeta, launch, launch_meta

RADIX_COUNT_BITS = 8
"""Key bits per counting pass of the fallback (256 digits: ``tl.histogram``)."""
RADIX_MASS_BITS = 4
"""Key bits per mass pass of the fallback (16 digits: a weighted one-hot sum, ~3 instructions per element per digit)."""
HEAD_WIDTH = 4
"""int32 words of a candidate row's head: (raw row max, sum-exp, candidates kept or -1, theta key)."""


def key_bits(dtype: torch.dtype) -> int:
    """Bits of the logits' order key: the stored 16 of bf16 / fp16, 32 for fp32."""
    return 16 if dtype in (torch.bfloat16, torch.float16) else 32


class Candidates(NamedTuple):
    """One buffer per row, ``[..., N, HEAD_WIDTH + candidates]`` int32 (one tensor: one all-gather), and its two views."""

    buffer: torch.Tensor
    """``[..., N, W]`` int32."""
    head: torch.Tensor
    """``[..., N, 4]`` int32 view."""
    values: torch.Tensor
    """``[..., N, CAP]`` view in the logits' dtype."""


def candidates_of(buffer: torch.Tensor, dtype: torch.dtype) -> Candidates:
    """The views of a candidate buffer (``[N, W]`` or all-gathered ``[TP, N, W]``) holding logits of ``dtype``."""
    words = dtype.itemsize  # bytes per element: the head is HEAD_WIDTH * 4 bytes = 16 / itemsize elements
    return Candidates(buffer, buffer[..., :HEAD_WIDTH], buffer.view(dtype)[..., HEAD_WIDTH * 4 // words:])


@functools.lru_cache(maxsize=64)
def _group_max_meta(cfg: LogprobLaunchConfig, has_sum: bool) -> LaunchMeta:
    return LaunchMeta(GROUP=cfg.candidate_group, HAS_SUM=has_sum,
                      BLOCK_V=max(cfg.stats_block_v, cfg.candidate_group), num_warps=cfg.stats_warps)


@functools.lru_cache(maxsize=64)
def _candidates_meta(cfg: LogprobLaunchConfig, key: int, n_groups: int) -> LaunchMeta:
    return LaunchMeta(KEY_BITS=key, GROUP=cfg.candidate_group, KEEP=cfg.candidate_keep,
                      GROUPS_CAP=cfg.candidate_groups_cap, CAP=cfg.candidate_cap,
                      GROUPS_PAD=triton.next_power_of_2(n_groups),
                      CHUNK=min(max(1, 512 // cfg.candidate_group), triton.next_power_of_2(cfg.candidate_groups_cap)),
                      num_warps=cfg.candidates_warps)


class GroupMaxima(NamedTuple):
    maxima: torch.Tensor
    """[n, n_groups] the maximum of each group of columns, in the logits' dtype."""
    found: Candidates
    """The new candidate buffer, its head's row maximum and sum-exp written."""


def group_maxima(logits: torch.Tensor, *, with_sum: bool, inv_temperature: float) -> GroupMaxima:
    """Step 1 of :func:`gather_candidates`: one read of ``logits`` ``[n, V_local]`` — the group maxima, each row's raw
    maximum and (``with_sum``) sum-exp."""
    n, v_local = logits.shape
    cfg = logprob_launch_config(v_local)
    words = HEAD_WIDTH + cfg.candidate_cap * logits.dtype.itemsize // 4
    found = candidates_of(torch.empty(n, words, dtype=torch.int32, device=logits.device), logits.dtype)
    n_groups = ceil_div(v_local, cfg.candidate_group)
    maxima = torch.empty(n, n_groups, dtype=logits.dtype, device=logits.device)
    if n > 0:
        launch_meta(logprob_group_max_kernel, (n,), _group_max_meta(cfg, with_sum),
            logits, maxima, found.head,
            v_local, n_groups, logits.stride(0), maxima.stride(0), found.head.stride(0),
            inv_temperature,
        )
    return GroupMaxima(maxima, found)


def candidates_from_maxima(logits: torch.Tensor, grouped: GroupMaxima) -> Candidates:
    """Step 2 of :func:`gather_candidates`: per row, theta from the group maxima and the chosen groups' columns
    >= theta (a re-read of ~``candidate_keep`` groups)."""
    n, v_local = logits.shape
    cfg = logprob_launch_config(v_local)
    maxima, found = grouped
    if n > 0:
        index = torch.empty(n, cfg.candidate_groups_cap, dtype=torch.int32, device=logits.device)
        launch_meta(logprob_candidates_kernel, (n,), _candidates_meta(cfg, key_bits(logits.dtype), maxima.shape[1]),
            logits, maxima, index, found.head, found.values,
            v_local, maxima.shape[1], logits.stride(0), maxima.stride(0), index.stride(0), found.head.stride(0),
            found.values.stride(0),
        )
    return found


def gather_candidates(logits: torch.Tensor, *, with_sum: bool, inv_temperature: float) -> Candidates:
    """Each row's candidates (its largest logits), raw maximum and (``with_sum``) sum-exp, in a new buffer: one read
    of ``logits`` ``[n, V_local]`` that keeps the group maxima, then a small kernel a row that re-reads the chosen
    groups (``kernels/logprob_candidates.py``)."""
    return candidates_from_maxima(logits, group_maxima(logits, with_sum=with_sum, inv_temperature=inv_temperature))


class Selected(NamedTuple):
    tau: torch.Tensor
    """[n] fp32 threshold (rows not finished: min-p's alone)."""
    row_max: torch.Tensor
    """[n] fp32 raw row maximum over the whole vocabulary."""
    finished: torch.Tensor
    """[n] int8: 1 where the candidates gave the threshold."""


def select_from_candidates(
    gathered: Candidates,  # [TP, n, W] all-gathered (TP = 1: this rank's, unsqueezed)
    logits: torch.Tensor,  # [n, V_local] this rank's shard
    *,
    rank: int,
    v_global: int,
    top_k: torch.Tensor | None,  # [n] int32, 0: off
    top_p: torch.Tensor | None,  # [n] fp32
    min_p: torch.Tensor | None,  # [n] fp32
    inv_temperature: float,
    stats: torch.Tensor | None = None,  # [N + 1, 4] fp32: this shard's statistics of the finished rows go here
    target: torch.Tensor | None = None,  # [n] int64 (with stats)
    row_start: int = 0,
    with_entropy: bool = False,
) -> Selected:
    """The threshold of every row that the candidates decide, and with ``stats`` that row's statistics
    (one launch, one program a row)."""
    tp, n, _ = gathered.buffer.shape
    v_local = logits.shape[1]
    device = logits.device
    out = Selected(torch.empty(n, dtype=torch.float32, device=device), torch.empty(n, dtype=torch.float32, device=device),
                   torch.empty(n, dtype=torch.int8, device=device))
    if n == 0:
        return out
    cfg = logprob_launch_config(v_local)
    placeholder = out.tau  # unused pointers
    write_stats = stats is not None
    launch(logprob_candidate_select_kernel, (n,),
        gathered.head, gathered.values, logits,
        target if write_stats else placeholder,
        top_k if top_k is not None else placeholder,
        top_p if top_p is not None else placeholder,
        min_p if min_p is not None else placeholder,
        out.tau, out.row_max, out.finished,
        stats if write_stats else placeholder,
        row_start, v_local, rank * v_local, v_global, tp, rank,
        gathered.head.stride(0), gathered.head.stride(1), gathered.values.stride(0), gathered.values.stride(1),
        logits.stride(0), stats.stride(0) if write_stats else 0,
        inv_temperature,
        KEY_BITS=key_bits(logits.dtype), GROUP=1, CAP=cfg.candidate_cap,
        TP_PAD=triton.next_power_of_2(tp), HAS_MIN_P=min_p is not None, HAS_TOP_K=top_k is not None,
        HAS_TOP_P=top_p is not None, HAS_ENTROPY=with_entropy, WRITE_STATS=write_stats,
        num_warps=min(8, max(cfg.select_warps, triton.next_power_of_2(tp) // 2)),  # ~16 candidates a thread
    )
    return out


def radix_histogram(
    logits: torch.Tensor,  # [n, V_local], last dim contiguous
    tau: torch.Tensor,  # [n] fp32: only columns with logit >= tau count
    prefix: torch.Tensor,  # [n] int32 digits chosen so far
    *,
    shift: int,
    digit_bits: int,
    mass: bool,
    row_max: torch.Tensor | None = None,  # [n] fp32 row maximum over the whole vocabulary (masses)
    inv_temperature: float = 1.0,
    first: bool,
    row_max_out: torch.Tensor | None = None,  # [n] fp32 out: this shard's row maximum
    skip: torch.Tensor | None = None,  # [n] int8: rows to leave alone (nonzero)
) -> torch.Tensor:
    """``[n, 2**digit_bits]`` histogram of one digit of the logits' key (one read of the shard): int32 counts,
    or with ``mass`` fp32 masses exp((x - M) / T) — summed per digit (``digit_bits = 4``) or, on the last
    pass (``shift == 0``, ``digit_bits = 8``), counts times the exact weight of each digit's value.
    Rows flagged in ``skip`` are not read and their histogram rows not written.
    See ``kernels/logprob_filter.py``."""
    n, v_local = logits.shape
    bins = 1 << digit_bits
    exact = mass and digit_bits == RADIX_COUNT_BITS
    hist = torch.empty(n, bins, dtype=torch.float32 if mass else torch.int32, device=logits.device)
    if n == 0:
        return hist
    cfg = logprob_launch_config(v_local)
    one_hot = mass and not exact
    launch(logprob_radix_hist_kernel, (n,),
        logits, tau, prefix, row_max if row_max is not None else tau, hist,
        row_max_out if row_max_out is not None else tau,
        skip if skip is not None else tau,
        v_local, logits.stride(0), hist.stride(0), inv_temperature, shift,
        KEY_BITS=key_bits(logits.dtype),
        DIGIT_BITS=digit_bits,
        MODE=(MODE_EXACT if exact else (MODE_MASS if mass else MODE_COUNT)).value,
        HAS_PREFIX=not first,
        HAS_ROW_MAX_OUT=row_max_out is not None,
        HAS_SKIP=skip is not None,
        BLOCK_V=cfg.filter_mass_block_v if one_hot else cfg.filter_count_block_v,
        num_warps=cfg.filter_mass_warps if one_hot else cfg.filter_count_warps,
    )
    return hist


def radix_select(
    hist: torch.Tensor,  # [n, 2**digit_bits] TP-summed
    logits: torch.Tensor,  # [n, V_local] (its dtype only)
    prefix: torch.Tensor,  # [n] int32 in/out
    budget: torch.Tensor,  # [n] in/out: int32 k left (top-k) or fp32 p * S (top-p)
    tau: torch.Tensor,  # [n] fp32 in/out
    *,
    digit_bits: int,
    first: bool,
    last: bool,
    above: torch.Tensor | None = None,  # [n] fp32 in/out (top-p)
    top_p: torch.Tensor | None = None,  # [n] fp32 (top-p)
    skip: torch.Tensor | None = None,  # [n] int8: rows to leave alone (nonzero)
) -> None:
    """Pick each row's digit from the histogram, update the search state in place; on the last pass raise
    ``tau`` to the threshold's logit (one tiny launch, one program per row)."""
    n = hist.shape[0]
    if n == 0:
        return
    is_top_p = top_p is not None
    launch(logprob_radix_select_kernel, (n,),
        hist, logits, prefix, budget, above if is_top_p else tau, top_p if is_top_p else tau, tau,
        skip if skip is not None else tau,
        n, hist.stride(0),
        KEY_BITS=key_bits(logits.dtype),
        DIGIT_BITS=digit_bits, IS_TOP_P=is_top_p, IS_FIRST=first, IS_LAST=last, HAS_SKIP=skip is not None,
        num_warps=1,
    )


def radix_search(
    logits: torch.Tensor,  # [n, V] the whole vocabulary (TP = 1)
    tau: torch.Tensor,  # [n] fp32 in/out
    row_max: torch.Tensor,  # [n] fp32 raw row maximum
    *,
    top_k: torch.Tensor | None,  # [n] int32 in/out (0: off), the search's budget
    top_p: torch.Tensor | None,  # [n] fp32
    skip: torch.Tensor,  # [n] int8: rows to leave alone (nonzero)
    inv_temperature: float,
) -> None:
    """TP = 1: the fallback's whole radix search of every row not skipped, in one launch (top-k's counting passes,
    then top-p's mass passes and its exact pass, each pass one read of the row); raises ``tau`` in place."""
    n, v_local = logits.shape
    if n == 0 or (top_k is None and top_p is None):
        return
    cfg = logprob_launch_config(v_local)
    device = logits.device
    prefix = torch.empty(n, dtype=torch.int32, device=device)
    scratch = torch.empty(2, n, dtype=torch.float32, device=device)  # top-p's budget and mass above
    count_hist = torch.empty(n if top_k is not None else 1, 256, dtype=torch.int32, device=device)
    mass_hist = torch.empty(n if top_p is not None else 1, 256, dtype=torch.float32, device=device)
    launch(logprob_radix_search_kernel, (n,),
        logits, tau, row_max, top_k if top_k is not None else prefix, top_p if top_p is not None else tau,
        prefix, scratch[0], scratch[1], count_hist, mass_hist, skip,
        v_local, logits.stride(0), inv_temperature,
        KEY_BITS=key_bits(logits.dtype), HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None,
        COUNT_BLOCK_V=cfg.filter_count_block_v, MASS_BLOCK_V=cfg.filter_mass_block_v,
        num_warps=cfg.filter_count_warps,
    )
