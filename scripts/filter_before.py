"""The sampling filter's schedule BEFORE the candidates — kept for ``bench_logprob_filter.py``'s before / after
comparison only (one GPU, TP = 1; nothing in ``mp_grpo`` imports this).

Frozen copy of the previous host schedule: the threshold search ran the radix passes over every row — the row
maximum (``amax``, or a by-product of top-k's first counting pass), min-p, top-k's counting passes, top-p's mass
passes and its exact last pass — then the statistics kernel read the shard again with the threshold. It launches
the same kernels the library's fallback launches (``kernels/logprob_filter.py`` with no rows skipped, which is
the code they ran before), so "before" runs the code of before.
"""

from __future__ import annotations

import math

import torch

from mp_grpo.ops.filter_launch import RADIX_COUNT_BITS, RADIX_MASS_BITS, key_bits, radix_histogram, radix_select
from mp_grpo.ops.logprob_launch import new_stats_buffer, shard_statistics
from mp_grpo.ops.sampling_filter import SamplingFilter
from mp_grpo.ops.vocab_parallel_logprobs import VocabParallelLogProbs


def _per_row(value, shape: torch.Size, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A filter field as ``[N]`` values of ``dtype`` (the filter checked by the caller)."""
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).to(dtype)
    return torch.full((math.prod(shape),), value, dtype=dtype, device=device)


def threshold_before(x: torch.Tensor, filt: SamplingFilter, target_shape: torch.Size, *,
                     inv_temperature: float) -> torch.Tensor:
    """``[N]`` fp32 threshold: the radix search over every row (TP = 1)."""
    n, v_local = x.shape
    device = x.device
    bits = key_bits(x.dtype)
    tau = torch.full((n,), float("-inf"), dtype=torch.float32, device=device)
    if n == 0:
        return tau
    # --- 1. row maximum (from top-k's first pass when min-p does not need it first) ---
    row_max = None
    if filt.min_p is not None or filt.top_k is None:
        row_max = x.amax(dim=-1).float()
    # --- 2. min-p ---
    if filt.min_p is not None:
        min_p = _per_row(filt.min_p, target_shape, device, torch.float32)
        tau = torch.maximum(tau, row_max + torch.log(min_p) / inv_temperature)
    # --- 3. top-k: 8 bits a counting pass ---
    if filt.top_k is not None:
        k = _per_row(filt.top_k, target_shape, device, torch.int64)
        budget = torch.where((k <= 0) | (k >= v_local), 0, k).to(torch.int32)
        prefix = torch.zeros(n, dtype=torch.int32, device=device)
        passes = bits // RADIX_COUNT_BITS
        for i in range(passes):
            local_max = torch.empty(n, dtype=torch.float32, device=device) if row_max is None and i == 0 else None
            hist = radix_histogram(x, tau, prefix, shift=bits - RADIX_COUNT_BITS * (i + 1),
                                   digit_bits=RADIX_COUNT_BITS, mass=False, first=i == 0, row_max_out=local_max)
            if local_max is not None:
                row_max = local_max
            radix_select(hist, x, prefix, budget, tau, digit_bits=RADIX_COUNT_BITS, first=i == 0, last=i == passes - 1)
    # --- 4. top-p: 4 bits a mass pass, then the last 8 bits exactly ---
    if filt.top_p is not None:
        top_p = _per_row(filt.top_p, target_shape, device, torch.float32).contiguous()
        prefix = torch.zeros(n, dtype=torch.int32, device=device)
        budget = torch.empty(n, dtype=torch.float32, device=device)
        above = torch.zeros(n, dtype=torch.float32, device=device)
        widths = [RADIX_MASS_BITS] * ((bits - RADIX_COUNT_BITS) // RADIX_MASS_BITS) + [RADIX_COUNT_BITS]
        shift = bits
        for i, width in enumerate(widths):
            shift -= width
            hist = radix_histogram(x, tau, prefix, shift=shift, digit_bits=width, mass=True, row_max=row_max,
                                   inv_temperature=inv_temperature, first=i == 0)
            radix_select(hist, x, prefix, budget, tau, digit_bits=width, first=i == 0, last=i == len(widths) - 1,
                         above=above, top_p=top_p)
    return tau


def _statistics_before(x, t, filt, target_shape, inv_temperature, with_entropy):
    stats = new_stats_buffer(x.shape[0], x.device)
    threshold = threshold_before(x, filt, target_shape, inv_temperature=inv_temperature)
    shard_statistics(x, t, stats, vocab_start=0, inv_temperature=inv_temperature, with_entropy=with_entropy,
                     threshold=threshold)
    return stats, threshold


class LogProbsBefore(VocabParallelLogProbs):
    """``vocab_parallel_logprobs(sampling_filter=...)`` as before (TP = 1, no input checks): the search above, then
    the statistics, the merge and the same backward."""

    @staticmethod
    def forward(ctx, logits, target, with_entropy: bool, filt: SamplingFilter):
        from mp_grpo.ops.checks import CheckInputs
        from mp_grpo.ops.logprob_launch import gather_and_merge
        from mp_grpo.ops.sampling_filter import targets_outside_filter

        ctx.set_materialize_grads(False)
        x = logits.reshape(-1, logits.shape[-1])
        t = target.reshape(-1).to(torch.int64).contiguous()
        stats, threshold = _statistics_before(x, t, filt, target.shape, 1.0, with_entropy)
        merged, _ = gather_and_merge(stats, t, tp_group=None, v_local=x.shape[1], ignore_index=-100,
                                     inv_temperature=1.0, with_entropy=with_entropy, check_inputs=CheckInputs.OFF)
        outside = targets_outside_filter(merged.logprobs, t, -100, CheckInputs.OFF)
        ctx.save_for_backward(x, t, merged.row_max, merged.log_sum, merged.complement, merged.entropy, merged.centered,
                              threshold, outside)
        ctx.logits_shape, ctx.vocab_start, ctx.inv_temperature = logits.shape, 0, 1.0
        ctx.ignore_index, ctx.inplace_backward = -100, False
        if with_entropy:
            return merged.logprobs.view(target.shape), merged.entropy.view(target.shape)
        return merged.logprobs.view(target.shape)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy=None):
        grads = VocabParallelLogProbs.backward(ctx, grad_logprobs, grad_entropy)
        return grads[0], None, None, None


def logprobs_before(logits: torch.Tensor, target: torch.Tensor, filt: SamplingFilter, *, with_entropy: bool = True):
    """The filtered op as before (temperature 1, ``check_inputs=False``)."""
    return LogProbsBefore.apply(logits, target, with_entropy, filt.without_noops(logits.shape[-1]))
