"""The rollout's sampling filter through MegatronGRPO (``MicroBatch.with_sampling_filter``), TP = 2 under torchrun (gloo).

One step through megatron-core's ``forward_step`` / ``backward_step`` / ``finalize_model_grads`` on the CPU
stand-in for GPTModel, with per-request ``top_k`` / ``top_p`` (one value per sequence, as vLLM's
``SamplingParams``): padded and packed layouts, the logits path and the fused output path (the loss in forward
for a token-separable config, the per-token fused op otherwise) must give the same loss, metrics — the count of
trained tokens outside the kept set among them — and gradients; and the filter must change them. The synthetic
tokens are not sampled from the model, so some targets lie outside the kept set: unchecked they get
log-prob -inf and no gradient (counted), checked the step raises naming the target.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed import torchrun, worker_main
from tests.megatron import helpers as H
from tests.tolerances import assert_close, tolerance

NUM_MICROBATCHES = 2
MICRO_BATCH_SIZE = 2


def _step(groups, rollouts, weights, *, fmt: str, path, loss: str, filtered: bool, check_inputs: bool = False):
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

    from mp_grpo.config.job import SequenceFormat
    from mp_grpo.loss.metrics import reduce_metrics
    from mp_grpo.megatron import MegatronGRPO, prepare_micro_batch
    from mp_grpo.train.cpu_ddp import CpuDistributedDataParallel
    from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config
    from mp_grpo.train.cpu_schedule import forward_backward_cpu
    from tests.megatron.test_fused_output import _gathered_grads

    config = cpu_model_config(hidden_size=H.HIDDEN, tensor_model_parallel_size=groups.tp_size,
                              calculate_per_token_loss=False)
    config.finalize_model_grads_func = finalize_model_grads
    model = CpuGPTStandIn(config, vocab_size=H.VOCAB, max_sequence_length=H.MAX_LEN, tp_group=groups.tp)
    model.load_full_weights(weights)
    ddp = CpuDistributedDataParallel(config, DistributedDataParallelConfig(), model, dp_cp_group=groups.dp_cp)
    micro = []
    for i in range(NUM_MICROBATCHES):
        rows = slice(i * MICRO_BATCH_SIZE, (i + 1) * MICRO_BATCH_SIZE)
        mb = prepare_micro_batch(rollouts.select(rows), sequence_format=SequenceFormat(fmt))
        if filtered:  # per request: top_k 0 (off) / 6, top_p 0.9 / 1.0 (off)
            top_k = torch.tensor([0, 6, 6, 12])[rows]
            top_p = torch.tensor([0.9, 1.0, 0.8, 0.95])[rows]
            mb = mb.with_sampling_filter(top_k=top_k, top_p=top_p, min_p=0.01)
        micro.append(mb)
    grpo = MegatronGRPO(H.loss_config(loss), temperature=H.TEMPERATURE, num_microbatches=NUM_MICROBATCHES,
                        calculate_per_token_loss=False, groups=groups, output_path=path, check_inputs=check_inputs)
    with torch.no_grad():
        passes = [grpo.model_logprobs(ddp, mb) for mb in micro]
    batch = grpo.global_batch(micro, step=1, entropies=[entropy for _, entropy in passes])
    losses = forward_backward_cpu(forward_step_func=grpo.forward_step_func(batch, step=1), data_iterator=iter(micro),
                                  model=ddp, num_microbatches=NUM_MICROBATCHES, groups=groups)
    return reduce_metrics(losses, groups.dp_cp), _gathered_grads(model)


def case_filter_layouts_and_paths(tp: int) -> None:
    from megatron.core import parallel_state as ps

    from mp_grpo.config.job import OutputPath
    from mp_grpo.megatron import ParallelGroups

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        groups = ParallelGroups.from_parallel_state()
        rollouts = H.make_rollouts(NUM_MICROBATCHES * MICRO_BATCH_SIZE, seed=31)
        weights = H.full_weights(seed=12)
        for loss in ("ppo_token_tis", "sequence_level"):
            runs = {(fmt, path): _step(groups, rollouts, weights, fmt=fmt, path=path, loss=loss, filtered=True)
                    for fmt in ("padded", "packed") for path in (OutputPath.LOGITS, OutputPath.FUSED)}
            ref_metrics, ref_grads = runs[("padded", OutputPath.LOGITS)]
            outside = ref_metrics["sampling_filter/outside_tokens"]
            assert outside > 0 and outside == int(outside), f"expected some targets outside the filter, got {outside}"
            assert math.isfinite(ref_metrics["loss"])
            for (fmt, path), (metrics, grads) in runs.items():
                where = f"[{loss}, {fmt}, {path}, tp={tp}]"
                assert metrics["sampling_filter/outside_tokens"] == outside, where
                assert math.isclose(metrics["loss"], ref_metrics["loss"], rel_tol=tolerance(torch.float32)["rtol"],
                                    abs_tol=tolerance(torch.float32)["atol"]), f"loss {where}"
                for name, ref in ref_grads.items():
                    assert torch.isfinite(grads[name]).all(), f"grad of {name} {where}"
                    assert_close(grads[name], ref, torch.float32, msg=f"grad of {name} {where}")
            plain_metrics, plain_grads = _step(groups, rollouts, weights, fmt="padded", path=OutputPath.LOGITS,
                                               loss=loss, filtered=False)
            assert plain_metrics["sampling_filter/outside_tokens"] == 0
            assert not torch.allclose(plain_grads["output_layer.weight"], ref_grads["output_layer.weight"])
        # Checked (the default): the step raises, naming the target.
        try:
            _step(groups, rollouts, weights, fmt="padded", path=OutputPath.LOGITS, loss="ppo_token_tis",
                  filtered=True, check_inputs=True)
        except ValueError as err:
            assert "outside the sampling_filter's kept set" in str(err)
        else:
            raise AssertionError("a target outside the filter did not raise with check_inputs=True")
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("tp", [2])
def test_sampling_filter_through_megatron_grpo(tp: int) -> None:
    torchrun(__file__, "case_filter_layouts_and_paths", nproc=tp, tp=tp)


def test_with_sampling_filter_lays_out_per_request_values() -> None:
    """Per-sequence values become per-position tensors of the targets' shape (padded and packed), positions
    without a target get the value that keeps everything, and bad shapes name the argument."""
    from mp_grpo.config.job import SequenceFormat
    from mp_grpo.megatron import prepare_micro_batch

    rollouts = H.make_rollouts(4, seed=4)
    per_request = torch.tensor([3, 0, 7, 5])
    for fmt in ("padded", "packed"):
        mb = prepare_micro_batch(rollouts, sequence_format=SequenceFormat(fmt))
        out = mb.with_sampling_filter(top_k=per_request, top_p=0.9)
        k = out.sampling_filter.top_k
        assert k.shape == mb.targets.shape and out.sampling_filter.top_p == 0.9
        # Each sequence's positions carry its value: the same per-position field, laid out like the targets.
        expected = mb.layout.target_field(per_request.unsqueeze(1).expand(4, int(rollouts.lengths.max())), 0)
        assert torch.equal(k, expected)
        trained = mb.targets != -100
        if fmt == "padded":
            for row, value in enumerate(per_request.tolist()):
                assert (k[row][trained[row]] == value).all()
        with pytest.raises(ValueError, match="top_p has 2 values but the micro-batch holds 4 sequences"):
            mb.with_sampling_filter(top_p=torch.tensor([0.5, 0.9]))
        with pytest.raises(ValueError, match=r"sampling_filter.top_p has values outside \(0.0, 1.0\]"):
            mb.with_sampling_filter(top_p=torch.tensor([0.5, 0.0, 1.0, 0.7]))

if __name__ == "__main__":
    worker_main({name: fn for name, fn in globals().items() if name.startswith("case_")})
