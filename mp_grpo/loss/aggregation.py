"""From per-token terms to this micro-batch's share of the step objective.

Every mode is a sum over the valid tokens of the step of ``c_t / D_t``; this module gives ``D_t``:

* ``token_mean``:              D = global valid tokens N;
* ``seq_mean_token_mean``:     D_t = n_seq(t) · S (n_seq: valid tokens of t's sequence, whole sequence);
* ``seq_mean_token_sum``:      D = S;
* ``seq_mean_token_sum_norm``: D = S · norm_constant;

with S the global sequence count (sequences with a valid token, or every sequence with
``count_empty_sequences``). N and S come from the :class:`~mp_grpo.GlobalBatch`, so a micro-batch's share
``Σ_{t in it} c_t / D_t`` does not depend on how the step is split: the shares of all micro-batches of all
ranks add up to the objective of the whole step, and so do their gradients.
"""

from __future__ import annotations

import torch

from mp_grpo.config.loss import Aggregation
from mp_grpo.kernels import token_math
from mp_grpo.loss.dialect import CODES, torch_formula

_floor_count = torch_formula(token_math.floor_count)
_token_divisor = torch_formula(token_math.token_divisor)
AGGREGATION_CODES = {
    Aggregation.TOKEN_MEAN: CODES.AGG_TOKEN_MEAN, Aggregation.SEQ_MEAN_TOKEN_MEAN: CODES.AGG_SEQ_MEAN_TOKEN_MEAN,
    Aggregation.SEQ_MEAN_TOKEN_SUM: CODES.AGG_SEQ_MEAN_TOKEN_SUM,
    Aggregation.SEQ_MEAN_TOKEN_SUM_NORM: CODES.AGG_SEQ_MEAN_TOKEN_SUM_NORM,
}
"""An :class:`Aggregation` as the formula's ``AGGREGATION`` code."""


def token_divisor(
    mode: Aggregation,
    norm_constant: float | None,
    global_tokens: torch.Tensor,
    global_sequences: torch.Tensor,
    seq_count: torch.Tensor,
) -> torch.Tensor:
    """``D_t`` (broadcastable to the tokens), every factor floored at :data:`COUNT_FLOOR`.

    ``seq_count`` is the per-token broadcast of the whole sequence's valid-token count.
    (:func:`mp_grpo.kernels.token_math.token_divisor`, the kernels' formula.)
    """
    count_floor = _floor_count(seq_count) if mode == Aggregation.SEQ_MEAN_TOKEN_MEAN else seq_count
    norm = 1.0 if norm_constant is None else norm_constant
    return _token_divisor(global_tokens, global_sequences, count_floor, norm, AGGREGATION_CODES[mode])
