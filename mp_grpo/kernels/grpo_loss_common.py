"""Shared pieces of the fused GRPO loss kernels (``grpo_loss_token``, ``grpo_loss_combine``, ``grpo_loss_backward``).

- Codes of the config's modes and the slots of the config-parameter vector (float64, built once per
  GRPOLoss by ``mp_grpo.ops.grpo_loss_plan``); absent bounds are ±inf there (and in what the torch path
  passes to the same ``token_math`` formulas), so a clamp or a test against them is the identity.
- Slots of the per-program partial sums / extremes the combine kernel writes and the finalize kernel
  reduces, and of the metric pairs it writes.
- Token blocks: the sequence of each position (padded rows or packed segments), validity, inputs
  loaded as 0 on masked positions (never read there, so inf / NaN cannot reach a value).
- ``segment_add``: one block's per-sequence sums added to a ``[S, NUM_COLS]`` float64 buffer with a
  float64 cumulative sum and one atomic add per sequence end (and one per inner boundary) — a handful of
  atomics per block, whatever the sequence lengths.
- ``policy_inputs`` / ``gmpo_clip``: the loads and config parameters around the per-token formulas of
  ``token_math`` (written once there, for these kernels and the torch path; ``clamp_sym`` is re-exported here).
- ``expm1``: exact near 0 (k3 and χ² of small log-ratios cancel catastrophically as ``exp(x) - 1``);
  the Triton interpreter has no libdevice, so it is a short series below |x| = 0.5.
"""

import hashlib

import triton
import triton.language as tl

from mp_grpo.kernels.logprob_merge import add_error_counts, merge_rows
from mp_grpo.loss.clamps import COUNT_FLOOR as _COUNT_FLOOR
from mp_grpo.loss.clamps import WEIGHT_MEAN_FLOOR as _WEIGHT_MEAN_FLOOR

# The loss layer's fixed bounds (mp_grpo/loss/clamps.py says why they exist).
COUNT_FLOOR = tl.constexpr(_COUNT_FLOOR)
WEIGHT_MEAN_FLOOR = tl.constexpr(_WEIGHT_MEAN_FLOOR)

EXPM1_SERIES_BOUND = tl.constexpr(0.5)
"""Below this |x| expm1 sums its Taylor series; above, exp(x) - 1 loses at most ~2.5 ulp (e^x / (e^x - 1))."""
EXPM1_SERIES_TERMS = tl.constexpr(17)
"""x^17 / 17! < 1e-19 · |x| for |x| < 0.5: exact to float64 rounding."""

# ------------------------------------------------------------------------------------ mode codes
OBJ_PPO_CLIP = tl.constexpr(0)
OBJ_GSPO = tl.constexpr(1)
OBJ_CISPO = tl.constexpr(2)
OBJ_SAPO = tl.constexpr(3)
OBJ_GMPO = tl.constexpr(4)
OBJ_REINFORCE = tl.constexpr(5)

AGG_TOKEN_MEAN = tl.constexpr(0)
AGG_SEQ_MEAN_TOKEN_MEAN = tl.constexpr(1)
AGG_SEQ_MEAN_TOKEN_SUM = tl.constexpr(2)
AGG_SEQ_MEAN_TOKEN_SUM_NORM = tl.constexpr(3)

LEVEL_NONE = tl.constexpr(0)
LEVEL_TOKEN = tl.constexpr(1)
LEVEL_SEQUENCE = tl.constexpr(2)
LEVEL_GEOMETRIC = tl.constexpr(3)

KL_K1 = tl.constexpr(1)
KL_K2 = tl.constexpr(2)
KL_K3 = tl.constexpr(3)

KL_RATIO_NONE = tl.constexpr(0)
KL_RATIO_BIAS_CORRECTION = tl.constexpr(1)
KL_RATIO_SCORE_FUNCTION = tl.constexpr(2)

# ------------------------------------------------------------------------------------ parameter slots
P_LOG_RATIO_CLAMP = tl.constexpr(0)  # policy.log_ratio_clamp (inf: none)
P_CLIP_LOW = tl.constexpr(1)  # 1 - eps_low (-inf: none)
P_CLIP_HIGH = tl.constexpr(2)  # 1 + eps_high (inf: none)
P_GMPO_LOW = tl.constexpr(3)  # -eps_low (-inf: none)
P_GMPO_HIGH = tl.constexpr(4)  # eps_high (inf: none)
P_DELTA = tl.constexpr(5)  # policy.delta (inf: none)
P_DUAL_CLIP_C = tl.constexpr(6)  # policy.dual_clip_c (read only with DUAL_CLIP)
P_TAU_POS = tl.constexpr(7)
P_TAU_NEG = tl.constexpr(8)
P_WEIGHT_MIN = tl.constexpr(9)  # -inf: none
P_WEIGHT_MAX = tl.constexpr(10)  # inf: none
P_REJECT_MIN = tl.constexpr(11)  # -inf: none
P_REJECT_MAX = tl.constexpr(12)  # inf: none
P_OPSM_DELTA = tl.constexpr(13)
P_KL_COEF = tl.constexpr(14)
P_KL_INPUT_CLAMP = tl.constexpr(15)  # inf: none
P_KL_OUTPUT_CLAMP = tl.constexpr(16)  # inf: none
P_ENTROPY_BONUS = tl.constexpr(17)
P_NORM_CONSTANT = tl.constexpr(18)  # aggregation.norm_constant (1: none)
NUM_PARAMS = tl.constexpr(19)

# ------------------------------------------------------------------------------------ partial / metric slots
# Columns of the [programs, PARTIAL_COLS] float64 partials: sums, then extremes (even: min, odd: max).
# Sum column i is the value of metric pair i, except SUM_CHI2_SEQ_COUNT, whose pair slot holds the skip flag.
SUM_SHARE = tl.constexpr(0)
SUM_VALID = tl.constexpr(1)
SUM_POLICY = tl.constexpr(2)
SUM_RATIO = tl.constexpr(3)
SUM_CLIP_LOW = tl.constexpr(4)
SUM_CLIP_HIGH = tl.constexpr(5)
SUM_CLIP_DUAL = tl.constexpr(6)
SUM_WEIGHT_RAW = tl.constexpr(7)
SUM_WEIGHT_TRUNCATED = tl.constexpr(8)
SUM_WEIGHT_APPLIED = tl.constexpr(9)
SUM_REJECTED_ROLLOUT = tl.constexpr(10)
SUM_REJECTED_OPSM = tl.constexpr(11)
SUM_REJECTED_ENTROPY = tl.constexpr(12)
SUM_MISMATCH_K1 = tl.constexpr(13)
SUM_MISMATCH_K3 = tl.constexpr(14)
SUM_CHI2_TOKEN = tl.constexpr(15)
SUM_CHI2_SEQ = tl.constexpr(16)
SUM_CHI2_SEQ_COUNT = tl.constexpr(17)
SUM_KL = tl.constexpr(18)
SUM_ENTROPY = tl.constexpr(19)
NUM_SUMS = tl.constexpr(20)
EXT_RATIO_MIN = tl.constexpr(20)
EXT_RATIO_MAX = tl.constexpr(21)
EXT_WEIGHT_RAW_MIN = tl.constexpr(22)
EXT_WEIGHT_RAW_MAX = tl.constexpr(23)
EXT_WEIGHT_TRUNCATED_MIN = tl.constexpr(24)
EXT_WEIGHT_TRUNCATED_MAX = tl.constexpr(25)
EXT_WEIGHT_APPLIED_MIN = tl.constexpr(26)
EXT_WEIGHT_APPLIED_MAX = tl.constexpr(27)
PARTIAL_COLS = tl.constexpr(28)
NUM_EXTREMES = tl.constexpr(8)

# Metric pairs [NUM_PAIRS, 2] (value, count) written by the finalize kernel; pair i = sum column i except:
PAIR_LOSS = tl.constexpr(0)  # count 1 / M
PAIR_VALID_TOKENS = tl.constexpr(1)  # count 1 / M
PAIR_CHI2_SEQ = tl.constexpr(16)  # count: sequences with a valid token (CP rank 0)
PAIR_SKIPPED = tl.constexpr(17)  # (skip flag, 1)
NUM_PAIRS = tl.constexpr(20)


# ------------------------------------------------------------------------------------ helpers
@triton.jit
def sequence_index(offs, cu_ptr, T, S, search_steps, PACKED: tl.constexpr):
    """Sequence of each position: ``offs // T`` for padded rows; for packed segments the number of
    ``cu[1:]`` entries ≤ the position (``torch.bucketize(..., right=True)``; S past the last segment),
    by a branch-free binary search of ``search_steps`` = S.bit_length() steps."""
    if PACKED:
        lo = tl.zeros_like(offs)
        hi = tl.zeros_like(offs) + S
        for _ in range(search_steps):
            active = lo < hi
            mid = (lo + hi) // 2
            bound = tl.load(cu_ptr + mid + 1, mask=active, other=0)
            right = active & (bound <= offs)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(active & (bound > offs), mid, hi)
        seq = lo
    else:
        seq = offs // T
    return seq


@triton.jit
def token_block(pid, mask_ptr, cu_ptr, N, T, S, search_steps, PACKED: tl.constexpr, BLOCK: tl.constexpr):
    """(positions, their sequence, valid) of block ``pid``: valid = in range, loss mask ≠ 0, inside a sequence."""
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < N
    seq = sequence_index(offs, cu_ptr, T, S, search_steps, PACKED)
    mask = tl.load(mask_ptr + offs, mask=in_range, other=0)
    valid = in_range & (mask != 0) & (seq < S)
    return offs, seq, valid


@triton.jit
def load_clean(ptr, offs, valid, COMPUTE: tl.constexpr):
    """``ptr[offs]`` in the compute dtype where valid; 0 elsewhere, without reading it."""
    return tl.load(ptr + offs, mask=valid, other=0.0).to(COMPUTE)


@triton.jit
def param(params_ptr, slot, COMPUTE: tl.constexpr):
    """One config parameter, rounded to the compute dtype (as the torch path rounds a Python scalar)."""
    return tl.load(params_ptr + slot).to(COMPUTE)


@triton.jit
def token_logprobs(
    lp_ptr, ent_ptr, stats_ptr, target_ptr, row_out_ptr, errors_ptr, offs, valid,
    N, TP, V_global, ignore_index, stride_stats_rank, stride_stats_row,
    HAS_ENTROPY: tl.constexpr, FROM_STATS: tl.constexpr, STORE_ROWS: tl.constexpr, COMPUTE: tl.constexpr,
):
    """Sanitized (log π_θ, entropy) of the block: loaded from ``lp_ptr`` / ``ent_ptr``, or with FROM_STATS merged
    from the all-gathered ``[TP, N + 1, 4]`` log-prob statistics (``logprob_merge.merge_rows``, the log-prob op's
    merge) — then with STORE_ROWS also (M, log S, entropy) of every position in range stored at
    ``row_out_ptr + {0, N, 2N}`` for the log-prob backward, and the merge's error counts added into
    ``errors_ptr``. 0 where not valid (never read there); entropy 0 without HAS_ENTROPY."""
    in_range = offs < N
    if FROM_STATS:
        merged, entropy, row_max, log_sum, shard_mismatches, out_of_range = merge_rows(
            stats_ptr, target_ptr, offs, in_range, N, TP, V_global, ignore_index, stride_stats_rank,
            stride_stats_row, HAS_ENTROPY,
        )
        lp = tl.where(valid, merged, 0.0).to(COMPUTE)
        ent = tl.where(valid, entropy, 0.0).to(COMPUTE)
        if STORE_ROWS:
            tl.store(row_out_ptr + offs, row_max, mask=in_range)
            tl.store(row_out_ptr + N + offs, log_sum, mask=in_range)
            if HAS_ENTROPY:
                tl.store(row_out_ptr + 2 * N + offs, entropy, mask=in_range)
            add_error_counts(errors_ptr, shard_mismatches, out_of_range, in_range)
    else:
        lp = load_clean(lp_ptr, offs, valid, COMPUTE)
        ent = tl.zeros_like(lp)
        if HAS_ENTROPY:
            ent = load_clean(ent_ptr, offs, valid, COMPUTE)
    return lp, ent


@triton.jit
def policy_inputs(
    lp, old_ptr, rollout_ptr, adv_ptr, offs, seq, valid, params_ptr,
    HAS_OLD: tl.constexpr, HAS_ROLLOUT: tl.constexpr, BYPASS: tl.constexpr, ADV_PER_TOKEN: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    """Sanitized (log π_θ — ``lp``, from :func:`token_logprobs` —, log π_old, rollout, A), the clamped log-ratio ℓ,
    its gradient mask, and the rollout-correction log-ratio d = clamp(trainer − rollout) (0 without rollout
    log-probs).

    On-policy (no old log-probs) π_old = stopgrad π_θ: ℓ = 0 with gradient 1. Bypass: π_old = rollout and
    the trainer side of d is stopgrad π_θ.
    """
    rollout = tl.zeros_like(lp)
    if HAS_ROLLOUT:
        rollout = load_clean(rollout_ptr, offs, valid, COMPUTE)
    if HAS_OLD:
        old = load_clean(old_ptr, offs, valid, COMPUTE)
    elif BYPASS:
        old = rollout
    else:
        old = lp
    if ADV_PER_TOKEN:
        adv = load_clean(adv_ptr, offs, valid, COMPUTE)
    else:
        adv = tl.load(adv_ptr + seq, mask=valid, other=0.0).to(COMPUTE)
    clamp = param(params_ptr, P_LOG_RATIO_CLAMP, COMPUTE)
    log_ratio, log_ratio_inside = clamp_sym(lp - old, clamp)
    d = tl.zeros_like(lp)
    if HAS_ROLLOUT:
        if BYPASS:
            d, _ = clamp_sym(lp - rollout, clamp)
        else:
            d, _ = clamp_sym(old - rollout, clamp)
    return lp, old, rollout, adv, log_ratio, log_ratio_inside, d


@triton.jit
def gmpo_clip(log_ratio, adv, params_ptr, COMPUTE: tl.constexpr):
    """GMPO's one-sided clip in log space with the config's bounds (``token_math.gmpo_log_clip``):
    (clipped ℓ, lower clip active, upper clip active)."""
    high_bound = param(params_ptr, P_GMPO_HIGH, COMPUTE)
    low_bound = param(params_ptr, P_GMPO_LOW, COMPUTE)
    clipped, _, low, high = gmpo_log_clip(log_ratio, adv, low_bound, high_bound)
    return clipped, low, high


@triton.jit
def block_ends(offs, seq_next, seq, N, BLOCK: tl.constexpr):
    """(a sequence ends at this position within the block, the position is the block's last in range)."""
    last = (offs + 1 >= N) | (tl.arange(0, BLOCK) == BLOCK - 1)
    end = (offs < N) & (last | (seq != seq_next))
    return end, last


@triton.jit
def segment_add(buf_ptr, x, seq, seq_next, end, last, S, NUM_COLS: tl.constexpr, COL: tl.constexpr):
    """``buf[s, COL] += Σ x`` over this block's positions of every sequence s (float64 ``x``, 0 off-sequence).

    With C the block's inclusive cumulative sum, a sequence ending at position e within the block gets
    +C[e]; the sequence after an inner boundary e gets −C[e]: each sequence then receives the sum of its
    own positions. Positions of no sequence (s = S) add nothing.
    """
    c = tl.cumsum(x, axis=0)
    tl.atomic_add(buf_ptr + seq * NUM_COLS + COL, c, mask=end & (seq < S), sem="relaxed")
    tl.atomic_add(buf_ptr + seq_next * NUM_COLS + COL, -c, mask=end & ~last & (seq_next < S), sem="relaxed")


@triton.jit
def expm1(x):
    """``exp(x) - 1``, exact near 0: x·(1 + x/2·(1 + x/3·(…))) for |x| < 0.5, else exp(x) - 1."""
    small = tl.abs(x) < EXPM1_SERIES_BOUND
    xs = tl.where(small, x, 0.0)
    q = tl.zeros_like(xs) + 1.0
    for k in tl.static_range(EXPM1_SERIES_TERMS, 1, -1):
        q = 1.0 + q * xs * (1.0 / k)
    return tl.where(small, xs * q, tl.exp(x) - 1.0)


@triton.jit
def masked_sum(x, valid):
    """Σ x where valid, in float64 (a 0-dim value)."""
    return tl.sum(tl.where(valid, x.to(tl.float64), 0.0), axis=0)


@triton.jit
def masked_min(x, valid):
    """min x where valid, float64; +inf when nothing is valid."""
    return tl.min(tl.where(valid, x.to(tl.float64), float("inf")), axis=0)


@triton.jit
def masked_max(x, valid):
    """max x where valid, float64; −inf when nothing is valid."""
    return tl.max(tl.where(valid, x.to(tl.float64), float("-inf")), axis=0)


def _constants_key() -> int:
    """A hash of every ``tl.constexpr`` of this module (name and value)."""
    values = sorted((name, repr(value.value)) for name, value in globals().items() if isinstance(value, tl.constexpr))
    return int(hashlib.sha256(repr(values).encode()).hexdigest()[:15], 16)


CONSTANTS_KEY: int = _constants_key()
"""Passed to the kernels that read this module's constants as ``K.NAME`` (combine, finalize) as their
``CONSTANTS_KEY`` compile-time argument. Why: Triton checks, at every launch, each module global a kernel
names bare (``NAME``) against its value at compile time — about a microsecond each, ~68 µs of host time per
combine launch. Read as attributes of the module (``K.NAME``) they are not checked, and not hashed into
Triton's cache key either: this key puts their values back into it, so that editing a constant recompiles."""


# The per-token formulas (mp_grpo/kernels/token_math.py) read this module's codes, so they are imported last;
# clamp_sym is re-exported from here.
from mp_grpo.kernels.token_math import clamp_sym, gmpo_log_clip  # noqa: E402,F401
