"""forward_logprobs (mp_grpo/megatron/forward_only.py): the forward-only log-prob pass through the schedule.

2 gloo ranks. ``case_tp``: TP = 2 with the CPU stand-in under Megatron DDP and megatron-core's own
``forward_step`` (``mp_grpo.train.cpu_schedule`` with ``forward_only=True``), padded and packed, logits
and fused output paths, the output layer on the loss rows alone (``OutputRows.LOSS``; on every row, ``ALL``, for
each path once):
equal to :meth:`MegatronGRPO.model_logprobs` and to the float64 reference on the unsharded logits (at the loss rows;
0 elsewhere with ``LOSS``, the entropy of every position with ``ALL``); with the rollout's sampling filter (top-k and top-p) on the micro-batches, equal to the
float64 reference of the filtered distribution (the kept sets exactly). ``case_pp``: a PP group of 2 whose
first stage gets nothing from the schedule (as on a non-last stage) receives the last stage's log-probs.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from mp_grpo.config.job import OutputPath, OutputRows, SequenceFormat
from mp_grpo.megatron import MegatronGRPO, ParallelGroups, prepare_micro_batch
from mp_grpo.megatron.forward_only import forward_logprobs
from tests.distributed import torchrun, worker_main
from tests.megatron import helpers as H
from tests.reference import filtered_logprobs_reference, logprobs_reference
from tests.tolerances import assert_close


FILTER_TOP_K, FILTER_TOP_P = 24, 0.9
"""The sampling filter of the filtered pass (top-k, then top-p, vLLM's convention; V = 64)."""
FILTERED_CASES = ((SequenceFormat.PADDED, OutputPath.LOGITS), (SequenceFormat.PACKED, OutputPath.FUSED))
"""The (format, path) pairs the filtered pass runs on: each format and each path once (the Triton interpreter's
threshold search is slow; the formats × paths grid with a filter is tests/megatron/test_sampling_filter.py's)."""


def case_tp() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig

    from mp_grpo.train.cpu_ddp import CpuDistributedDataParallel
    from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config
    from mp_grpo.train.cpu_schedule import forward_backward_cpu

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        groups = ParallelGroups.from_parallel_state()
        solo = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
        weights = H.full_weights(seed=3)
        rollouts = H.make_rollouts(6, seed=21)
        config = cpu_model_config(hidden_size=H.HIDDEN, tensor_model_parallel_size=2)
        model = CpuGPTStandIn(config, vocab_size=H.VOCAB, max_sequence_length=H.MAX_LEN, tp_group=groups.tp)
        model.load_full_weights(weights)
        ddp = CpuDistributedDataParallel(config, DistributedDataParallelConfig(), model, dp_cp_group=groups.dp_cp)
        full = CpuGPTStandIn(cpu_model_config(hidden_size=H.HIDDEN), vocab_size=H.VOCAB, max_sequence_length=H.MAX_LEN,
                             tp_group=solo)
        full.load_full_weights(weights)

        def fbf(**kwargs):
            kwargs.pop("seq_length"), kwargs.pop("micro_batch_size")
            return forward_backward_cpu(groups=groups, **kwargs)

        grid = [(fmt, path, OutputRows.LOSS) for fmt, path in itertools.product(SequenceFormat, OutputPath)]
        for fmt, path, rows in grid + [(SequenceFormat.PADDED, OutputPath.FUSED, OutputRows.ALL),
                                       (SequenceFormat.PACKED, OutputPath.LOGITS, OutputRows.ALL)]:
            where = f"[{fmt.value}, {path.value}, rows {rows.value}]"
            micro = [prepare_micro_batch(rollouts.select(slice(i, i + 2)), sequence_format=fmt) for i in (0, 2, 4)]
            grpo = MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=H.TEMPERATURE, num_microbatches=3,
                                calculate_per_token_loss=False, groups=groups, output_path=path, output_rows=rows)
            out = forward_logprobs(grpo, fbf, ddp, micro)
            assert len(out.logprobs) == 3 and len(out.entropy) == 3
            for mb, lp, ent in zip(micro, out.logprobs, out.entropy):
                assert not lp.requires_grad
                with torch.no_grad():
                    direct, direct_ent = grpo.model_logprobs(model, mb)
                    ref_lp, ref_ent = logprobs_reference(full(mb.input_ids, mb.position_ids), mb.targets,
                                                         temperature=H.TEMPERATURE)
                if rows == OutputRows.LOSS:  # the output layer ran on the loss rows: 0 elsewhere
                    ref_ent = torch.where(mb.loss_mask, ref_ent, torch.zeros_like(ref_ent))
                assert torch.equal(lp, direct), f"forward_logprobs differs from model_logprobs {where}"
                assert torch.equal(ent, direct_ent), f"entropy differs from model_logprobs {where}"
                assert_close(lp, ref_lp, torch.float32, msg=f"log-probs vs float64 {where}")
                assert_close(ent, ref_ent, torch.float32, msg=f"entropy vs float64 {where}")
                assert torch.all(torch.where(mb.loss_mask, torch.zeros_like(lp), lp) == 0), f"untrained positions {where}"
            if (fmt, path) not in FILTERED_CASES or rows == OutputRows.ALL:
                continue
            # The rollout's sampling filter replayed (what the learning loop's old-log-prob pass does): the
            # log-probs of the filtered distribution; a synthetic target outside it gets -inf (checks off).
            filtered = [mb.with_sampling_filter(top_k=FILTER_TOP_K, top_p=FILTER_TOP_P) for mb in micro]
            grpo_f = MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=H.TEMPERATURE, num_microbatches=3,
                                  calculate_per_token_loss=False, groups=groups, output_path=path, check_inputs=False)
            out_f = forward_logprobs(grpo_f, fbf, ddp, filtered)
            outside = 0
            for mb, lp, ent in zip(filtered, out_f.logprobs, out_f.entropy):
                with torch.no_grad():
                    ref_lp, ref_ent = filtered_logprobs_reference(full(mb.input_ids, mb.position_ids), mb.targets,
                                                                  top_k=FILTER_TOP_K, top_p=FILTER_TOP_P,
                                                                  temperature=H.TEMPERATURE)
                assert torch.equal(torch.isneginf(lp), torch.isneginf(ref_lp)), f"kept sets differ {where}"
                finite = torch.isfinite(ref_lp)
                assert_close(lp[finite], ref_lp[finite], torch.float32, msg=f"filtered log-probs vs float64 {where}")
                ref_ent = torch.where(mb.loss_mask, ref_ent, torch.zeros_like(ref_ent))  # OutputRows.LOSS
                assert_close(ent, ref_ent, torch.float32, msg=f"filtered entropy vs float64 {where}")
                outside += int(torch.isneginf(lp).sum())
            assert 0 < outside < sum(int(mb.loss_mask.sum()) for mb in micro), f"filter keeps all or nothing {where}"
    finally:
        ps.destroy_model_parallel()


def case_pp() -> None:
    """Rank 1 is the last stage: its values reach rank 0, whose schedule returns nothing."""
    pp = dist.new_group([0, 1])
    last = dist.get_rank() == 1
    grpo = MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=1.0, num_microbatches=2,
                        calculate_per_token_loss=False, groups=ParallelGroups(pp=pp))
    rollouts = H.make_rollouts(4, seed=4)
    micro = [prepare_micro_batch(rollouts.select(slice(i, i + 2))) for i in (0, 2)]
    expected = [torch.randn(mb.targets.shape, generator=torch.Generator().manual_seed(i)) for i, mb in enumerate(micro)]

    def fbf(*, forward_only, **_):
        assert forward_only
        if not last:
            return []  # a non-last stage: Megatron's schedule collects nothing there
        return [{"logprobs": e, "entropy": e.abs()} for e in expected]

    for broadcast in (True, False):
        out = forward_logprobs(grpo, fbf, torch.nn.Identity(), micro, broadcast=broadcast)
        if broadcast or last:
            assert all(torch.equal(a, b) for a, b in zip(out.logprobs, expected))
            assert all(torch.equal(a, b.abs()) for a, b in zip(out.entropy, expected))
        else:
            assert out.logprobs is None and out.entropy is None


def test_forward_logprobs_tp2() -> None:
    torchrun(__file__, "case_tp", nproc=2)


def test_forward_logprobs_pp_broadcast() -> None:
    torchrun(__file__, "case_pp", nproc=2)


def test_empty_micro_batches_rejected() -> None:
    import pytest

    grpo = MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=1.0, num_microbatches=1,
                        calculate_per_token_loss=False, groups=ParallelGroups())
    with pytest.raises(ValueError, match="micro_batches"):
        forward_logprobs(grpo, lambda **_: [], torch.nn.Identity(), [])


if __name__ == "__main__":
    worker_main({"case_tp": case_tp, "case_pp": case_pp})
