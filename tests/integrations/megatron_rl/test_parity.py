"""GRPOForwardStep's loss against Megatron-LM's ``calculate_grpo_loss`` (from its source; skipped without it), float64.

Megatron-LM's step objective with ``--calculate-per-token-loss``: Σ over the step's micro-batches of
Σ(loss · loss_mask), divided by the step's Σ loss_mask (``train_rl.py::loss_func`` returns the pair, Megatron's
``finalize_model_grads`` divides by the global token count). ``GRPOForwardStep.from_args`` (Megatron-LM's loss:
its clip, unclamped k3 KL, truncated IS weight and −p·log p entropy term) gives the same value and gradient. The
run's arguments come from Megatron-LM's own parser (``ARGV_CASES``: its defaults; clip 0.2 / 0.28, β 0.05, entropy
weight 0.01, IS truncated at 1.5; untruncated IS without KL).
"""

from __future__ import annotations

import pytest
import torch

from mp_grpo.integrations.megatron_rl import EntropyTerm, GRPOForwardStep
from mp_grpo.megatron.groups import ParallelGroups
from tests.integrations.megatron_rl.helpers import (ARGV_CASES, calculate_grpo_loss_or_skip, megatron_lm_args, packed_bin,
                                                    unpacked)
from tests.tolerances import assert_close

def _theirs(fn, args, mbs, currents):
    """Megatron-LM's step objective and d/dlogprobs of each micro-batch."""
    num, den, leaves = 0.0, 0.0, []
    for mb, lp in zip(mbs, currents):
        x = lp.clone().requires_grad_()
        leaves.append(x)
        loss, *_ = fn(current_logprobs=x, old_logprobs=mb.old_logprobs, ref_logprobs=mb.ref_logprobs,
                      advantages=mb.advantages, clamp_eps_lower=args.grpo_clamp_eps_lower,
                      clamp_eps_upper=args.grpo_clamp_eps_upper, kl_beta=args.grpo_kl_beta,
                      entropy_weight=args.grpo_entropy_term_weight,
                      inference_logprobs=mb.inference_logprobs if args.rl_inference_logprobs_is_correction else None,
                      is_truncation_coef=args.rl_importance_sampling_truncation_coef,
                      seq_starts=list(mb.seq_starts) if mb.packed else None,
                      seq_lengths=list(mb.seq_lengths) if mb.packed else None)
        num = num + (loss * mb.loss_mask).sum()
        den = den + mb.loss_mask.sum()
    objective = num / den
    objective.backward()
    return objective.detach(), [x.grad for x in leaves]


def _ours(args, mbs, currents):
    step = GRPOForwardStep.from_args(args, groups=ParallelGroups())
    assert step.entropy_term == EntropyTerm.SAMPLED_TOKEN
    stored = step.pre_step(mbs, step=0)
    total, grads = 0.0, []
    for lp, x in zip(currents, stored.inputs):
        leaf = lp.clone().requires_grad_()
        at_logits = torch.cat([leaf, leaf.new_zeros(leaf.shape[0], 1)], dim=1).reshape(x.mask.shape)  # position S-1: no target
        share, _ = step.loss_on_logprobs(at_logits, x, stored.batch)
        share.backward()
        total, grads = total + share.detach(), grads + [leaf.grad]
    return total, grads


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("case", list(ARGV_CASES))
def test_matches_calculate_grpo_loss(case: str, layout: str) -> None:
    fn = calculate_grpo_loss_or_skip()
    args = megatron_lm_args(case)
    if layout == "padded":
        pairs = [unpacked(1, 3, 11, far=case == "is_untruncated_no_kl"), unpacked(2, 2, 11)]
    else:
        pairs = [packed_bin(3, [5, 7, 4], 4, 24), packed_bin(4, [9, 3], 1, 16)]
    mbs, currents = [p[0] for p in pairs], [p[1] for p in pairs]
    want, want_grads = _theirs(fn, args, mbs, currents)
    got, got_grads = _ours(args, mbs, currents)
    assert torch.isfinite(want) and want != 0
    assert_close(got, want, torch.float64, f"{case} {layout} objective")
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        assert_close(g, w, torch.float64, f"{case} {layout} d/dlogprobs [{i}]")
