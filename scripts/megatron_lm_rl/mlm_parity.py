"""The loss-parity check inside the run: on the first micro-batch the forward step hands its loss, mp_grpo's loss and
gradient against Megatron-LM's own GRPO loss on the same batch and the same logits.

:class:`ParityCheckedForwardStep` is ``GRPOForwardStep`` whose ``loss_func``, the first time it runs, also computes
(on a detached copy of the model's logits, so the training step itself is untouched):

1. **mp_grpo**: ``GRPOForwardStep.loss_on_logits`` — this micro-batch's share of the step objective (its loss sum
   over the step's valid tokens, ``GlobalBatch``) — and its gradient with respect to the logits;
2. **Megatron-LM, its own precision**: its forward step's path on the same logits — ``selective_log_softmax`` of
   positions ``[:-1]`` at targets ``tokens[1:]`` (``get_logprobs``), ``calculate_grpo_loss`` with the run's
   ``--grpo-*`` arguments (and the bin's ``seq_starts`` / ``seq_lengths`` when packed), then Σ(loss · mask) over the
   same step's valid tokens (``--calculate-per-token-loss``) — and its gradient;
3. **Megatron-LM in float64**: the same on the logits cast to float64 (the reference: the loss as Megatron-LM
   defines it, without rounding).

The result (objectives, relative differences, gradients' max differences relative to the reference's largest
entry) is logged and written to ``parity.json``; ``passed`` is mp_grpo against (3) within ``PARITY_RTOL`` on the
objective and on the gradient. Needs TP = CP = 1 (the logits of every vocabulary id and position on one rank).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mp_grpo.integrations.megatron_rl import GRPOForwardStep, RLMicroBatch

PARITY_RTOL = 1e-5
"""mp_grpo (fp32 logits, fp32 kernels) against Megatron-LM's loss in float64: fp32 rounding of a log-softmax over
32 ids and of sums over a micro-batch's few hundred tokens stays near 1e-6; 1e-5 leaves a factor 10. With bf16
logits Megatron-LM's own path (a bf16 log_softmax) differs from the reference by ~1e-2: reported, not checked."""


def megatron_lm_share(calculate_grpo_loss, args: Any, mb: RLMicroBatch, logprobs: torch.Tensor,
                      valid_tokens: float) -> torch.Tensor:
    """Megatron-LM's share of the step objective for one micro-batch from its log-probs ``[B, S-1]`` (step 2)."""
    dtype = logprobs.dtype
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    loss, *_ = calculate_grpo_loss(
        current_logprobs=logprobs, old_logprobs=cast(mb.old_logprobs), ref_logprobs=cast(mb.ref_logprobs),
        advantages=cast(mb.advantages), clamp_eps_lower=args.grpo_clamp_eps_lower,
        clamp_eps_upper=args.grpo_clamp_eps_upper, kl_beta=args.grpo_kl_beta,
        entropy_weight=args.grpo_entropy_term_weight,
        inference_logprobs=cast(mb.inference_logprobs) if args.rl_inference_logprobs_is_correction else None,
        is_truncation_coef=args.rl_importance_sampling_truncation_coef,
        seq_starts=list(mb.seq_starts) if mb.packed else None, seq_lengths=list(mb.seq_lengths) if mb.packed else None)
    return (loss * mb.loss_mask.to(dtype)).sum() / valid_tokens


def compare(step: GRPOForwardStep, fns: dict, args: Any, mb: RLMicroBatch, x, batch, logits: torch.Tensor) -> dict:
    """Steps 1–3 on ``logits`` ``[B, S, V]`` (all ids, all positions); ``fns``: Megatron-LM's
    ``selective_log_softmax`` and ``calculate_grpo_loss``."""
    valid = float(batch.valid_tokens)

    def theirs(z: torch.Tensor) -> torch.Tensor:
        lp = fns["selective_log_softmax"](z[:, :-1], mb.tokens[:, 1:])
        return megatron_lm_share(fns["calculate_grpo_loss"], args, mb, lp, valid)

    results = {}
    for name, dtype in (("mp_grpo", logits.dtype), ("megatron_lm", logits.dtype), ("megatron_lm_float64", torch.float64)):
        z = logits.detach().to(dtype).clone().requires_grad_()
        value = step.loss_on_logits(z, x, batch)[0] if name == "mp_grpo" else theirs(z)
        (grad,) = torch.autograd.grad(value, z)
        results[name] = (value.detach().double(), grad.double())
    ref, ref_grad = results["megatron_lm_float64"]
    scale = float(ref_grad.abs().max()) or 1.0
    out: dict = {"logits_dtype": str(logits.dtype).replace("torch.", ""), "valid_tokens_of_the_step": valid,
                 "tokens": list(mb.tokens.shape), "packed": mb.packed, "rtol": PARITY_RTOL}
    for name in ("mp_grpo", "megatron_lm"):
        value, grad = results[name]
        out[name] = {"objective_share": float(value), "objective_rel_diff": float((value - ref).abs() / ref.abs().clamp_min(1e-30)),
                     "grad_max_diff_rel": float((grad - ref_grad).abs().max()) / scale}
    out["megatron_lm_float64"] = {"objective_share": float(ref), "grad_abs_max": scale}
    mine = out["mp_grpo"]
    out["passed"] = mine["objective_rel_diff"] <= PARITY_RTOL and mine["grad_max_diff_rel"] <= PARITY_RTOL
    return out


class ParityCheckedForwardStep(GRPOForwardStep):
    """``GRPOForwardStep`` with the parity check on the first micro-batch it computes a loss for (module docstring);
    ``parity_path``: where the result is written (rank 0)."""

    parity_path: Path | None = None
    parity: dict | None = None

    def loss_func(self, x, batch, scaling, logits):
        if self.parity is None:
            self.parity = self._check(x, batch, logits)
        return super().loss_func(x, batch, scaling, logits)

    def _check(self, x, batch, logits) -> dict:
        from megatron.rl.rl_utils import calculate_grpo_loss, selective_log_softmax
        from megatron.training import get_args

        groups = self.groups
        if groups.tp_size != 1 or groups.cp_size != 1:
            result = {"skipped": f"needs TP = CP = 1, got TP = {groups.tp_size}, CP = {groups.cp_size}"}
        else:
            stored = self._step
            index = next(i for i, y in enumerate(stored.inputs) if y is x)
            fns = {"selective_log_softmax": selective_log_softmax, "calculate_grpo_loss": calculate_grpo_loss}
            result = compare(self, fns, get_args(), stored.micro_batches[index], x, batch, logits)
            result["iteration"], result["micro_batch"] = stored.step, index
        print(f"[mp_grpo parity] {json.dumps(result)}", flush=True)
        if self.parity_path is not None and torch.distributed.get_rank() == 0:
            self.parity_path.write_text(json.dumps(result, indent=1))
        return result
