"""MegatronGRPO through Megatron's loss contract: every parallel layout gives the one-process gradient.

Each case runs 4 ranks under torchrun (gloo) — TP=2×DP=2, CP=2×DP=2, TP=2×CP=2 — with megatron-core's
real ``parallel_state``, tensor-parallel layers (the CPU stand-in for GPTModel), ``schedules.forward_step`` /
``backward_step`` and ``finalize_model_grads`` (see ``mp_grpo/train/cpu_schedule.py``). For every variant — padded or
packed, ``calculate_per_token_loss`` on or off, DDP averaging in the collective or summing — the
parameter gradients after one step must equal the gradient of the whole batch computed in one call
on one process (``tests/megatron/helpers.reference``), and the reduced loss must equal that call's loss.
"""

from __future__ import annotations

import inspect

import math

import pytest
import torch
import torch.distributed as dist

from mp_grpo.config.job import SequenceFormat
from mp_grpo.loss.global_batch import StaleGlobalBatchError
from mp_grpo.megatron import MegatronGRPO, ParallelGroups, Rollouts, prepare_micro_batch
from tests.distributed import torchrun, worker_main
from tests.megatron import helpers as H
from tests.tolerances import assert_close

# (sequence format, calculate_per_token_loss, average_in_collective, loss config)
VARIANTS = [
    ("padded", False, False, "ppo_token_tis"),
    ("padded", False, True, "sequence_level"),
    ("padded", True, False, "sequence_level"),
    ("packed", False, False, "sequence_level"),
    ("packed", True, False, "ppo_token_tis"),
    ("padded", False, False, "step_level"),
]
NUM_MICROBATCHES = 2
MICRO_BATCH_SIZE = 2


# ---------------------------------------------------------------------------------------------- workers
def _parallel_step(groups, rollouts, weights, fmt, per_token, avg, config_name):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

    from mp_grpo.train.cpu_ddp import CpuDistributedDataParallel
    from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config
    from mp_grpo.train.cpu_schedule import forward_backward_cpu
    from mp_grpo.loss.metrics import reduce_metrics

    config = cpu_model_config(hidden_size=H.HIDDEN, tensor_model_parallel_size=groups.tp_size,
                              context_parallel_size=groups.cp_size, calculate_per_token_loss=per_token)
    config.finalize_model_grads_func = finalize_model_grads
    model = CpuGPTStandIn(config, vocab_size=H.VOCAB, max_sequence_length=H.MAX_LEN, tp_group=groups.tp)
    model.load_full_weights(weights)
    ddp = CpuDistributedDataParallel(config, DistributedDataParallelConfig(average_in_collective=avg), model,
                                     dp_cp_group=groups.dp_cp)
    # This DP rank's M micro-batches: contiguous rows of the global batch.
    dp_rank = ps.get_data_parallel_rank()
    rows = NUM_MICROBATCHES * MICRO_BATCH_SIZE
    micro = [
        prepare_micro_batch(rollouts.select(slice(dp_rank * rows + i * MICRO_BATCH_SIZE, dp_rank * rows + (i + 1) * MICRO_BATCH_SIZE)),
                            sequence_format=SequenceFormat(fmt), cp_group=groups.cp)
        for i in range(NUM_MICROBATCHES)
    ]
    loss_config = H.loss_config(config_name)
    grpo = MegatronGRPO(loss_config, temperature=H.TEMPERATURE, num_microbatches=NUM_MICROBATCHES,
                        calculate_per_token_loss=per_token, groups=groups)
    entropies = None
    if loss_config.entropy.top_quantile < 1.0:  # the "old-log-prob pass" of a real step
        with torch.no_grad():
            entropies = [grpo.token_logprobs(model(mb.input_ids, mb.position_ids), mb)[1] for mb in micro]
    batch = grpo.global_batch(micro, step=3, entropies=entropies)
    losses = forward_backward_cpu(forward_step_func=grpo.forward_step_func(batch, step=3), data_iterator=iter(micro),
                                  model=ddp, num_microbatches=NUM_MICROBATCHES, groups=groups)
    return reduce_metrics(losses, groups.dp_cp), H.full_grads(model)


def case_layouts(tp: int, cp: int) -> None:
    """Every VARIANT under TP = tp, CP = cp, DP = world / (tp·cp) equals the one-process reference."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    try:
        groups = ParallelGroups.from_parallel_state()
        solo = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
        num_sequences = groups.dp_size * NUM_MICROBATCHES * MICRO_BATCH_SIZE
        rollouts = H.make_rollouts(num_sequences, seed=11)
        weights = H.full_weights()
        for fmt, per_token, avg, name in VARIANTS:
            where = f"[{fmt}, per_token={per_token}, average_in_collective={avg}, {name}, tp={tp}, cp={cp}]"
            ref_loss, ref_grads = H.reference(H.loss_config(name), rollouts, weights, solo)
            metrics, grads = _parallel_step(groups, rollouts, weights, fmt, per_token, avg, name)
            assert math.isclose(metrics["loss"], ref_loss, rel_tol=2e-5, abs_tol=1e-6), f"loss {metrics['loss']} vs {ref_loss} {where}"
            for pname, g in ref_grads.items():
                assert_close(grads[pname], g, torch.float32, msg=f"grad of {pname} {where}")
        if tp > 1:
            _check_tp_mismatch(groups, rollouts, weights, solo)
        if cp > 1:
            _check_cp_split_matches_megatron(groups, rollouts)
    finally:
        ps.destroy_model_parallel()


def _check_tp_mismatch(groups, rollouts, weights, solo) -> None:
    """Logits of an unsharded model used with a TP group of 2: the adapter names the TP group."""
    from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config

    model = CpuGPTStandIn(cpu_model_config(hidden_size=H.HIDDEN), vocab_size=H.VOCAB, max_sequence_length=H.MAX_LEN, tp_group=solo)
    model.load_full_weights(weights)
    mb = prepare_micro_batch(rollouts.select(slice(0, 2)))
    grpo = MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=1.0, num_microbatches=1,
                        calculate_per_token_loss=False, groups=groups, vocab_size=H.VOCAB)
    batch = grpo.global_batch([mb], step=0)
    with pytest.raises(ValueError, match="tp_group"):
        grpo.loss_func(mb, batch, model(mb.input_ids, mb.position_ids))


def _check_cp_split_matches_megatron(groups, rollouts) -> None:
    """The padded CP split equals megatron-core's get_batch_on_this_cp_rank of the shifted labels."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    r = rollouts.select(slice(0, 4))
    mb = prepare_micro_batch(r, cp_group=groups.cp)
    s, n = mb.layout.row_len, min(mb.layout.row_len, r.seq_len)
    tokens = torch.zeros(r.num_sequences, s, dtype=torch.int64)
    tokens[:, :n] = r.tokens[:, :n]
    trained = torch.zeros(r.num_sequences, s, dtype=torch.bool)
    trained[:, :n] = r.loss_mask[:, :n]
    labels = torch.cat([tokens[:, 1:], torch.zeros(r.num_sequences, 1, dtype=torch.int64)], dim=1)
    mask = torch.cat([trained[:, 1:], torch.zeros(r.num_sequences, 1, dtype=torch.bool)], dim=1)
    batch = {"tokens": tokens, "labels": labels, "loss_mask": mask}
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:  # megatron-core 0.19
        split = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=groups.cp)
    else:
        split = get_batch_on_this_cp_rank(batch, cp_group=groups.cp)
    assert torch.equal(mb.input_ids, split["tokens"])
    assert torch.equal(mb.loss_mask, split["loss_mask"])
    assert torch.equal(mb.targets[mb.loss_mask], split["labels"][split["loss_mask"]])


# ---------------------------------------------------------------------------------------------- pytest
@pytest.mark.parametrize("tp,cp", [(2, 1), (1, 2), (2, 2)], ids=["tp2_dp2", "cp2_dp2", "tp2_cp2"])
def test_layouts_equal_one_process(tp: int, cp: int) -> None:
    torchrun(__file__, "case_layouts", nproc=4, tp=tp, cp=cp)


def test_stale_global_batch_is_rejected() -> None:
    rollouts = H.make_rollouts(4, seed=3)
    grpo = MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=1.0, num_microbatches=1,
                        calculate_per_token_loss=False, groups=ParallelGroups())
    mb = prepare_micro_batch(rollouts.select(slice(0, 2)))
    batch = grpo.global_batch([mb], step=5)
    with pytest.raises(StaleGlobalBatchError, match="step 5"):
        grpo.forward_step_func(batch, step=6)
    other = prepare_micro_batch(rollouts.select(slice(0, 3)))
    logits = torch.zeros(*other.targets.shape, H.VOCAB)
    with pytest.raises(StaleGlobalBatchError, match="another step"):
        grpo.loss_func(other, batch, logits)


def test_model_output_of_wrong_shape_is_rejected() -> None:
    rollouts = H.make_rollouts(2, seed=4)
    grpo = MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=1.0, num_microbatches=1,
                        calculate_per_token_loss=False, groups=ParallelGroups(), vocab_size=H.VOCAB)
    mb = prepare_micro_batch(rollouts)
    batch = grpo.global_batch([mb], step=0)
    b, s = mb.targets.shape
    with pytest.raises(ValueError, match="vocab-parallel logits"):
        grpo.loss_func(mb, batch, torch.zeros(s, b, H.VOCAB))  # Megatron's [S, B, V] instead of GPTModel's [B, S, V]
    with pytest.raises(ValueError, match="tp_group"):
        grpo.loss_func(mb, batch, torch.zeros(b, s, H.VOCAB // 2))


def test_step_level_config_needs_old_logprobs_before_the_step() -> None:
    rollouts = H.make_rollouts(2, seed=6)
    on_policy = Rollouts(tokens=rollouts.tokens, lengths=rollouts.lengths, loss_mask=rollouts.loss_mask,
                         advantages=rollouts.advantages, rollout_logprobs=rollouts.rollout_logprobs)
    grpo = MegatronGRPO(H.loss_config("step_level"), temperature=1.0, num_microbatches=1,
                        calculate_per_token_loss=False, groups=ParallelGroups())
    with pytest.raises(ValueError, match=r"micro_batches\[0\].old_logprobs is None"):
        grpo.global_batch([prepare_micro_batch(on_policy)], step=0)


def test_wrong_number_of_micro_batches_is_rejected() -> None:
    rollouts = H.make_rollouts(4, seed=5)
    grpo = MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=1.0, num_microbatches=2,
                        calculate_per_token_loss=False, groups=ParallelGroups())
    with pytest.raises(ValueError, match="num_microbatches"):
        grpo.global_batch([prepare_micro_batch(rollouts)], step=0)


if __name__ == "__main__":
    worker_main({"case_layouts": case_layouts})
