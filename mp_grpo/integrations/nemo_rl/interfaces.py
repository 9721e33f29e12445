"""NeMo-RL's loss-interface enums: NeMo-RL's own when it is importable, same-valued stand-ins otherwise.

NeMo-RL compares ``loss_fn.input_type == LossInputType.LOGIT`` and ``loss_fn.loss_type == LossType.TOKEN_LEVEL``
with its own enum members, and members of two enum classes never compare equal: inside a NeMo-RL process
the loss must carry NeMo-RL's members. Without NeMo-RL (tests, this package's own use) the stand-ins below
have the same names and values (``nemo_rl/algorithms/loss/interfaces.py``).
"""

from __future__ import annotations

import enum


class _LossType(enum.Enum):
    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class _LossInputType(enum.Enum):
    LOGIT = "logit"
    LOGPROB = "logprob"


class _MetricNormalizer(enum.Enum):
    TOKENS = "tokens"
    SEQUENCES = "sequences"
    NONE = "none"


def _nemo_rl_enums() -> tuple[type[enum.Enum], type[enum.Enum], type[enum.Enum], bool]:
    try:
        from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType, MetricNormalizer
    except ImportError:
        return _LossType, _LossInputType, _MetricNormalizer, False
    return LossType, LossInputType, MetricNormalizer, True


LossType, LossInputType, MetricNormalizer, NEMO_RL_IMPORTABLE = _nemo_rl_enums()
"""NeMo-RL's ``LossType``, ``LossInputType`` and ``MetricNormalizer`` (or the stand-ins), and whether NeMo-RL
was importable."""
