"""What to hand Megatron's schedule so that its own scaling turns GRPOLoss's share back into the gradient.

GRPOLoss's contract: it returns this micro-batch's *share* ℓ of the step objective J, such that
summing the gradients over the M micro-batches of every rank of the DP×CP group gives ∇J exactly.
Megatron-core 0.16 then scales what the loss function returns, in three places:

* ``schedules.forward_step_calc_loss`` (last pipeline stage only): a 2-tuple ``(loss, metrics)``
  is multiplied by the CP size and divided by M; a 3-tuple ``(loss, num_tokens, metrics)`` is
  left alone when ``config.calculate_per_token_loss`` is set (otherwise divided by ``num_tokens``
  and by M — a pattern this adapter does not use).
* ``DistributedDataParallel`` reduces over the DP×CP group. Without ``calculate_per_token_loss``
  it averages, whichever way ``average_in_collective`` chooses (True: ``ReduceOp.AVG``; False:
  gradients pre-scaled by 1/|DP×CP| and summed), so the factor is 1/|DP×CP| = 1/(DP·CP). With it,
  it sums (factor 1; ``average_in_collective`` must then be False, which Megatron asserts).
* ``finalize_model_grads`` with ``calculate_per_token_loss``: the ``num_tokens`` of all micro-
  batches, broadcast from the last pipeline stage and summed over DP×CP into N, divides every
  gradient (when N > 0).

Derivation (Σ runs over the DP×CP ranks and their micro-batches; ℓ' is what we return):

* ``calculate_per_token_loss=False``: ∇ = (CP / M) · (1 / (DP·CP)) · Σ ∇ℓ' = Σ ∇ℓ' / (M·DP), so
  ``ℓ' = M · DP · ℓ`` gives ∇J. (CP cancels: Megatron multiplies by CP because its own losses are
  CP-local means; our share is already a share of the DP×CP total.)
* ``calculate_per_token_loss=True``: ∇ = Σ ∇ℓ' / N. Returning ``num_tokens`` = this micro-batch's
  local valid (loss-mask) tokens makes N the step's global valid-token count G — the count the
  GlobalBatch made with one all-reduce — so ``ℓ' = G · ℓ`` gives ∇J. When G = 0, ℓ is exactly 0
  with a zero gradient, and Megatron skips its division.
  Any other count works the same way as long as ``ℓ' = N · ℓ``: for an MoE model the adapter reports the
  routed-token account A instead (``mp_grpo.megatron.moe``), which gives the routers' aux / z losses their
  scale, and returns ``ℓ' = A · ℓ``.

Neither depends on TP (every TP rank returns the same loss; Megatron's tensor-parallel layers make
each rank's gradient that of its shard) nor on PP (the scaling is applied on the last stage, the
gradient flows back through the stages unchanged, and DDP/finalize scale every stage alike).
``config.grad_scale_func`` (fp16 loss scaling) multiplies on top and the optimizer undoes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MegatronScaling:
    """The schedule parameters that decide the factor between GRPOLoss's share and Megatron's loss."""

    calculate_per_token_loss: bool
    """``TransformerConfig.calculate_per_token_loss``: the loss function returns a 3-tuple with a token count."""
    num_microbatches: int
    """M, as passed to ``forward_backward_func`` (micro-batches per rank per optimizer step)."""
    dp_size: int
    """Pure data-parallel size DP = |DP×CP| / CP."""

    def __post_init__(self) -> None:
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be ≥ 1, got {self.num_microbatches}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be ≥ 1, got {self.dp_size}")

    def megatron_loss(self, share: torch.Tensor, global_valid_tokens: torch.Tensor) -> torch.Tensor:
        """ℓ' from ℓ (see the module docstring): ``G·ℓ`` with per-token loss, else ``M·DP·ℓ``.

        ``global_valid_tokens`` is the global count N the reported ``num_tokens`` add up to — the GlobalBatch's
        valid tokens G, or an MoE model's routed-token account (only used with per-token loss).
        """
        if self.calculate_per_token_loss:
            return share * global_valid_tokens.to(share.dtype)
        return share * float(self.num_microbatches * self.dp_size)
