"""Pipeline parallelism on CPU (gloo, 2 stages): every stage runs the documented loop and decides alike.

Megatron's p2p needs CUDA, so the stages here exchange no activations: each stage builds its micro-batches
and GlobalBatch as the documented loop does, and only the last stage has the old / rollout log-probs and
entropies (from its own forward-only pass) and the metric dicts (Megatron calls the loss only there). The
step-level decisions must be the last stage's on every stage, and ``reduce_metrics`` must return the last
stage's values everywhere. The whole PP = 2 step through ``forward_backward_func`` is the GPU test
tests/gpu/test_megatron_pipeline.py (2 GPUs).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mp_grpo.config import load_config
from mp_grpo.loss import GlobalBatch
from mp_grpo.megatron import MegatronGRPO, ParallelGroups, Rollouts, prepare_micro_batch
from tests.distributed import torchrun, worker_main
from tests.megatron import helpers as H

STEP_LEVEL = H.LOSS_CONFIGS["step_level"][:-1] + ["mismatch.skip_threshold=0.001"]  # a step the monitor skips


def case_two_stages() -> None:
    stage = dist.get_rank()
    groups = ParallelGroups(pp=dist.group.WORLD)  # DP = CP = TP = 1 on each stage
    config = load_config(None, STEP_LEVEL)
    grpo = MegatronGRPO(config, temperature=1.0, calculate_per_token_loss=False, groups=groups)
    rollouts = H.make_rollouts(4, seed=9)
    last = stage == 1
    if not last:  # the first stage has no old / rollout log-probs: the loss never runs there
        rollouts = Rollouts(tokens=rollouts.tokens, lengths=rollouts.lengths, loss_mask=rollouts.loss_mask,
                            advantages=rollouts.advantages)
    micro = [prepare_micro_batch(rollouts.select(slice(i, i + 2))) for i in (0, 2)]
    gen = torch.Generator().manual_seed(3)
    entropies = [torch.rand(mb.targets.shape, generator=gen) * 3 for mb in micro] if last else None
    batch = grpo.global_batch(micro, step=0, entropies=entropies)

    # --- the decisions are the last stage's, on every stage ---
    decided = torch.stack([batch.weight_mean, batch.mismatch_k3, batch.entropy_threshold.to(torch.float64),
                           batch.skip.to(torch.float64), batch.m2po_threshold])
    both = [torch.empty_like(decided) for _ in range(2)]
    dist.all_gather(both, decided)
    torch.testing.assert_close(both[0], both[1], rtol=0, atol=0)
    assert batch.skip_step() is True
    if last:  # and they are those of the step computed without pipeline parallelism
        alone = GlobalBatch.from_rollouts(
            config, [mb.loss_mask for mb in micro], old_logprobs=[mb.old_logprobs for mb in micro],
            rollout_logprobs=[mb.rollout_logprobs for mb in micro], entropies=entropies, layouts=[mb.sequences for mb in micro],
            advantages=[mb.advantages for mb in micro])
        torch.testing.assert_close(batch.weight_mean, alone.weight_mean)
        torch.testing.assert_close(batch.mismatch_k3, alone.mismatch_k3)
        torch.testing.assert_close(batch.entropy_threshold, alone.entropy_threshold.to(torch.float64))
        assert torch.isfinite(alone.m2po_threshold) and torch.equal(batch.m2po_threshold, alone.m2po_threshold)

    # --- metrics: the last stage's values on every stage, no raise on the first ---
    losses = []
    if last:
        losses = [{"loss": torch.tensor([1.5 + i, 0.5], dtype=torch.float64),
                   "x/max": torch.tensor(float(i), dtype=torch.float64)} for i in range(2)]
    metrics = grpo.reduce_metrics(losses)
    assert metrics == {"loss": pytest.approx(4.0), "x/max": 1.0}, metrics


def test_two_pipeline_stages_decide_alike_and_report_the_last_stages_metrics() -> None:
    torchrun(__file__, "case_two_stages", nproc=2)


if __name__ == "__main__":
    worker_main({"case_two_stages": case_two_stages})
