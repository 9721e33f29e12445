"""The fused GRPO loss kernels' constants: codes of the config's modes, slots of the config-parameter vector and of
the per-program partials / metric pairs, and the fixed floors of the per-token formulas.

Plain ``tl.constexpr`` values and nothing else, at the bottom of the house: the kernels
(``grpo_loss_token``, ``grpo_loss_combine``, ``grpo_loss_finalize``), the per-token formulas of
:mod:`mp_grpo.kernels.token_math` (as ``K.*``), the host plan (``mp_grpo.ops.grpo_loss_plan``) and the torch
path (``mp_grpo.loss``: :data:`mp_grpo.loss.dialect.CODES`, :mod:`mp_grpo.loss.clamps`) all read them from here.
The config-parameter vector (float64, built once per GRPOLoss by ``mp_grpo.ops.grpo_loss_plan``) holds ±inf for
an absent bound, so a clamp or a test against it is the identity.
"""

import hashlib

import triton.language as tl

# ------------------------------------------------------------------------------------ fixed floors
COUNT_FLOOR = tl.constexpr(1.0)
"""Floor of every count used as a divisor (tokens, sequences, a sequence's length). A count of 0 only
occurs where every numerator is exactly 0 (no valid token), so any positive floor leaves the result
exact; it keeps 0/0 — and its NaN gradient — out of masked positions."""

WEIGHT_MEAN_FLOOR = tl.constexpr(1e-8)
"""Below this global mean the IS weights are left unnormalized (verl's rule): a mean this small means
(almost) every weight truncated to 0, and dividing by it would blow the few others up to ~1e8."""

LOGPROB_MAX = tl.constexpr(0.0)
"""Ceiling of a log-prob before the trust region's divergences exponentiate it: a probability is at most 1, and a
trainer's log-prob a rounding above 0 (a log-softmax of a near-deterministic row) is probability 1, not e^(+ε) > 1
(whose binary KL term log(1 − π) would be NaN)."""

LOG1MEXP_SPLIT = tl.constexpr(-0.6931471805599453)
"""−ln 2: above it log(1 − eˣ) is taken as log(−expm1(x)), below as log(1 − eˣ) — each branch where the other
cancels (Mächler, "Accurately computing log(1 − exp(−|a|))", 2012). Not a clamp: both branches are exact."""

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

TR_NONE = tl.constexpr(0)
TR_BINARY_TV = tl.constexpr(1)
TR_BINARY_KL = tl.constexpr(2)
TR_GIVEN = tl.constexpr(3)  # the divergence is an input per token (top-K TV / KL, computed by mp_grpo.loss.trust_region)

M2PO_NONE = tl.constexpr(0)
M2PO_ALL = tl.constexpr(1)
M2PO_CLIP_QUADRANTS = tl.constexpr(2)

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
P_TR_DELTA_LOW = tl.constexpr(19)  # trust_region.delta_low (inf: none)
P_TR_DELTA_HIGH = tl.constexpr(20)  # trust_region.delta_high (inf: none)
NUM_PARAMS = tl.constexpr(21)

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
SUM_NONFINITE = tl.constexpr(20)  # valid positions dropped for a non-finite input (metric nonfinite_inputs)
# Per input, the valid positions where it is non-finite (the deferred ledger's counts, in NONFINITE_INPUTS' order):
SUM_NONFINITE_LOGPROBS = tl.constexpr(21)
SUM_NONFINITE_OLD = tl.constexpr(22)
SUM_NONFINITE_ROLLOUT = tl.constexpr(23)
SUM_NONFINITE_REF = tl.constexpr(24)
SUM_NONFINITE_ADVANTAGES = tl.constexpr(25)
SUM_NONFINITE_ENTROPY = tl.constexpr(26)
NUM_NONFINITE_INPUTS = tl.constexpr(6)
SUM_REJECTED_TRUST_REGION = tl.constexpr(27)
SUM_REJECTED_M2PO = tl.constexpr(28)
NUM_SUMS = tl.constexpr(29)
EXT_RATIO_MIN = tl.constexpr(29)
EXT_RATIO_MAX = tl.constexpr(30)
EXT_WEIGHT_RAW_MIN = tl.constexpr(31)
EXT_WEIGHT_RAW_MAX = tl.constexpr(32)
EXT_WEIGHT_TRUNCATED_MIN = tl.constexpr(33)
EXT_WEIGHT_TRUNCATED_MAX = tl.constexpr(34)
EXT_WEIGHT_APPLIED_MIN = tl.constexpr(35)
EXT_WEIGHT_APPLIED_MAX = tl.constexpr(36)
PARTIAL_COLS = tl.constexpr(37)
NUM_EXTREMES = tl.constexpr(8)

# Metric pairs [NUM_PAIRS, 2] (value, count) written by the finalize kernel; pair i = sum column i except:
PAIR_LOSS = tl.constexpr(0)  # count 1 / M
PAIR_VALID_TOKENS = tl.constexpr(1)  # count 1 / M
PAIR_CHI2_SEQ = tl.constexpr(16)  # count: sequences with a valid token (CP rank 0)
PAIR_SKIPPED = tl.constexpr(17)  # (skip flag, 1)
PAIR_NONFINITE = tl.constexpr(20)  # count 1 / M
NUM_PAIRS = tl.constexpr(29)  # through SUM_REJECTED_M2PO (the per-input non-finite columns between are pairs too, unread)


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
