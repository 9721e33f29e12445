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
from mp_grpo.loss.clamps import COUNT_FLOOR


def token_divisor(
    mode: Aggregation,
    norm_constant: float | None,
    global_tokens: torch.Tensor,
    global_sequences: torch.Tensor,
    seq_count: torch.Tensor,
) -> torch.Tensor:
    """``D_t`` (broadcastable to the tokens), every factor floored at :data:`COUNT_FLOOR`.

    ``seq_count`` is the per-token broadcast of the whole sequence's valid-token count.
    """
    sequences = global_sequences.clamp(min=COUNT_FLOOR)
    if mode == Aggregation.TOKEN_MEAN:
        return global_tokens.clamp(min=COUNT_FLOOR)
    if mode == Aggregation.SEQ_MEAN_TOKEN_MEAN:
        return seq_count.clamp(min=COUNT_FLOOR) * sequences
    if mode == Aggregation.SEQ_MEAN_TOKEN_SUM:
        return sequences
    return sequences * norm_constant  # type: ignore[operator]
