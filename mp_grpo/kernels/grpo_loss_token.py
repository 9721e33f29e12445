"""Fused GRPO loss, pass 1 of 2 (forward): the per-sequence sums (Triton).

Each program reads one block of BLOCK token positions once and adds, per sequence, the sums of the
columns the combine pass needs (``mp_grpo/loss/sequence.py`` lists them) into a zeroed float64
``[S, NUM_COLS]`` buffer:

    column 0            valid tokens of the sequence (its length n)
    COL_SEQ_IN   (≥ 0)  gspo: the clamped log-ratio ℓ; gmpo: ℓ clipped one-sidedly in log space
    COL_D        (≥ 0)  d = clamp(trainer − rollout), the rollout-correction log-ratio
    COL_OPSM     (≥ 0)  behaviour − log π_θ (rollout, else old), the OPSM divergence

Masked positions are never read (they add 0). Each block adds each sequence's sum of its own positions
(a segmented scan, ``segment_add``: no other sequence's terms enter it); sums of sequences that span blocks meet
through float64 atomic adds, a few per block, whose order's rounding stays far below the compute dtype's. Under
context parallelism the host all-reduces the buffer over the CP group before the combine pass.

With FROM_STATS the log-probs are merged from the log-prob op's all-gathered statistics here (the merge is a
few loads a position; ``mp_grpo/ops/logits_grpo_loss.py``) instead of loaded.

Schedule: 1. the block's positions, their sequences and validity; 2. the sanitized inputs and log-ratios (a valid
position with a NaN / ±inf input dropped, as the combine pass drops it: ``grpo_loss_common.token_inputs``);
3. each column's per-sequence sums added to the buffer.
"""

import triton
import triton.language as tl

from mp_grpo.kernels.grpo_loss_common import (
    block_ends,
    gmpo_clip,
    segment_add,
    sequence_index,
    token_block,
    token_inputs,
)
from mp_grpo.kernels.grpo_loss_constants import OBJ_GMPO


@triton.jit
def grpo_loss_token_kernel(
    # token inputs, flat [N] (any float dtype; loss mask any dtype, nonzero = trained on); the reference log-probs
    # and the entropy only to drop the positions where they are not finite, as the combine kernel does
    lp_ptr, old_ptr, rollout_ptr, ref_ptr, ent_ptr, adv_ptr, mask_ptr,
    # FROM_STATS: the log-prob statistics [TP, N + 1, 4] fp32 and the targets [N] int64 (lp_ptr unused)
    stats_ptr, target_ptr,
    # sequences: cu_seqlens [S + 1] (packed only), config parameters (float64), the sums (float64, zeroed)
    cu_ptr, params_ptr, seq_sums_ptr,
    # sizes
    N, T, S, search_steps,
    # FROM_STATS: sizes and strides of the statistics, 1 / temperature
    TP, V_global, ignore_index, stride_stats_rank, stride_stats_row, inv_temperature,
    # meta-parameters
    FROM_STATS: tl.constexpr,
    PACKED: tl.constexpr, HAS_OLD: tl.constexpr, HAS_ROLLOUT: tl.constexpr, BYPASS: tl.constexpr,
    HAS_REF: tl.constexpr, HAS_ENTROPY: tl.constexpr, ADV_PER_TOKEN: tl.constexpr, OBJECTIVE: tl.constexpr,
    NUM_COLS: tl.constexpr, COL_SEQ_IN: tl.constexpr, COL_D: tl.constexpr, COL_OPSM: tl.constexpr,
    COMPUTE: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    # --- 1. positions, sequences, validity ---
    offs, seq, valid = token_block(pid, mask_ptr, cu_ptr, N, T, S, search_steps, PACKED, BLOCK)
    seq_next = sequence_index(offs + 1, cu_ptr, T, S, search_steps, PACKED)
    end, _ = block_ends(offs, seq_next, seq, N, BLOCK)

    # --- 2. sanitized inputs (log-probs loaded, or merged from the statistics; positions with a non-finite input
    #        dropped) and log-ratios ---
    valid, lp, _, old, rollout, _, adv, log_ratio, _, d, _, _, _, _, _, _ = token_inputs(
        lp_ptr, ent_ptr, old_ptr, rollout_ptr, ref_ptr, adv_ptr, stats_ptr, target_ptr, lp_ptr, lp_ptr,
        offs, seq, valid, params_ptr, N, TP, V_global, ignore_index, stride_stats_rank, stride_stats_row,
        inv_temperature, HAS_ENTROPY, FROM_STATS, False, HAS_OLD, HAS_ROLLOUT, HAS_REF, BYPASS, ADV_PER_TOKEN, COMPUTE,
    )

    # --- 3. per-sequence sums of every column ---
    segment_add(seq_sums_ptr, valid.to(tl.float64), seq, end, S, NUM_COLS, 0)
    if COL_SEQ_IN >= 0:
        seq_in = log_ratio
        if OBJECTIVE == OBJ_GMPO:
            seq_in, _, _ = gmpo_clip(log_ratio, adv, params_ptr, COMPUTE)
        segment_add(seq_sums_ptr, seq_in.to(tl.float64), seq, end, S, NUM_COLS, COL_SEQ_IN)
    if COL_D >= 0:
        segment_add(seq_sums_ptr, d.to(tl.float64), seq, end, S, NUM_COLS, COL_D)
    if COL_OPSM >= 0:
        behaviour = old
        if HAS_ROLLOUT:
            behaviour = rollout
        divergence = tl.where(valid, behaviour - lp, 0.0)
        segment_add(seq_sums_ptr, divergence.to(tl.float64), seq, end, S, NUM_COLS, COL_OPSM)
