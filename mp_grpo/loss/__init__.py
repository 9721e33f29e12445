"""The GRPO-family loss layer, in plain torch (one concern per module).

- :mod:`.grpo_loss`: :class:`GRPOLoss`, the per-micro-batch loss (orchestrates the modules below), and
  :class:`LossBackend` (plain torch, or the fused kernels of :mod:`mp_grpo.ops.grpo_loss`); :mod:`.torch_path`:
  its plain-torch stages; :mod:`.input_checks`: its input checks.
- :mod:`.global_batch`: :class:`GlobalBatch`, the step's global counts and step-level decisions;
  :mod:`.fingerprint`: what its ranks must hold alike, checked in its all-reduce.
- :mod:`.sequence`: :class:`SequenceLayout` — padded, packed (THD) and context-parallel sequences.
- :mod:`.objectives`, :mod:`.rollout_correction`, :mod:`.opsm`, :mod:`.entropy`, :mod:`.kl`,
  :mod:`.mismatch`, :mod:`.aggregation`: the terms; :mod:`.clamps`: the fixed bounds.
- :mod:`.trust_region`: DPPO's divergence trust region (binary / top-K TV or KL; :class:`TopKLogprobs`, the top-K
  input); :mod:`.m2po`: M2PO's step-level second-moment mask.
- :mod:`.vespo`: VESPO's gamma weight; :mod:`.covariance`: clip_cov / kl_cov's token selection (per call);
  :mod:`.adaptive_entropy`: the adaptive entropy coefficient (state outside the loss).
- :mod:`.metrics`: exactly reducible metric dicts and :func:`reduce_metrics`.
"""

from mp_grpo.loss.adaptive_entropy import AdaptiveEntropyCoefficient
from mp_grpo.loss.global_batch import GlobalBatch, RankDisagreementError, StaleGlobalBatchError
from mp_grpo.loss.grpo_loss import GRPOLoss, LossBackend, fused_unsupported
from mp_grpo.loss.metrics import reduce_metrics
from mp_grpo.loss.sequence import PackedSequences, PaddedSequences, SequenceLayout, SumOverGroup, sum_over_group
from mp_grpo.loss.trust_region import TopKLogprobs

__all__ = [
    "AdaptiveEntropyCoefficient",
    "GRPOLoss",
    "GlobalBatch",
    "LossBackend",
    "PackedSequences",
    "PaddedSequences",
    "RankDisagreementError",
    "SequenceLayout",
    "StaleGlobalBatchError",
    "SumOverGroup",
    "TopKLogprobs",
    "fused_unsupported",
    "reduce_metrics",
    "sum_over_group",
]
