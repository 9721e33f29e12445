"""``MegatronGRPO(logit_dtype=...)``: the logits' precision on both output paths, in the forward-only pass and the step.

2 gloo ranks, TP = 2, the CPU stand-in for GPTModel in bf16 (Megatron's ``Float16Module`` dtype) with its output
weight scaled to a trained model's logit range (row maxima 10–40). Against float64 logits of the same bf16 hidden
states and output weight: the forward-only pass (``forward_logprobs``, the old / reference policy's log-probs)
with ``LogitDtype.FP32`` is within ``CPU_FP32_MAX_ABS`` on both paths (padded and packed), with ``BF16`` it is
not; a training step's loss on the fused path (the loss in forward: ``fused_linear_loss``) equals the logits path's
at fp32 logits (and differs from it by the bf16 rounding at bf16), and its gradients are finite. A model output
layer the logits path does not compute itself is refused with fp32, naming ``logit_dtype``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mp_grpo.config.job import OutputPath, OutputRows, SequenceFormat
from mp_grpo.config.precision import LogitDtype
from mp_grpo.megatron import MegatronGRPO, ParallelGroups, prepare_micro_batch
from mp_grpo.megatron.forward_only import forward_logprobs
from tests.distributed import torchrun, worker_main
from tests.logit_precision import CPU_BF16_MIN_MAX_ABS, CPU_FP32_MAX_ABS
from tests.megatron import helpers as H
from tests.reference import logprobs_reference


def test_logit_dtype_on_both_paths() -> None:
    torchrun(__file__, "case_logit_dtype", nproc=2)


def case_logit_dtype() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig

    from mp_grpo.train.cpu_ddp import CpuDistributedDataParallel
    from mp_grpo.train.cpu_schedule import forward_backward_cpu

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        groups = ParallelGroups.from_parallel_state()
        model = H.trained_scale_stand_in(groups.tp, tensor_model_parallel_size=2)
        ddp = CpuDistributedDataParallel(model.config, DistributedDataParallelConfig(), model, dp_cp_group=groups.dp_cp)
        rollouts = H.make_rollouts(4, seed=5)
        full_weight = _gathered(model.output_layer.weight.detach(), groups.tp)

        def fbf(**kwargs):
            kwargs.pop("seq_length"), kwargs.pop("micro_batch_size")
            return forward_backward_cpu(groups=groups, **kwargs)

        def grpo(path: OutputPath, logit_dtype: LogitDtype, rows: OutputRows = OutputRows.LOSS) -> MegatronGRPO:
            return MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=1.0, num_microbatches=2,
                                calculate_per_token_loss=False, groups=groups, output_path=path, logit_dtype=logit_dtype,
                                output_rows=rows)

        for fmt in SequenceFormat:
            micro = [prepare_micro_batch(rollouts.select(slice(i, i + 2)), sequence_format=fmt) for i in (0, 2)]
            # --- the reference: float64 logits of the bf16 hidden states (the fused path's model output) ---
            refs = []
            for mb in micro:
                with torch.no_grad():
                    hidden, _ = grpo(OutputPath.FUSED, LogitDtype.BF16, OutputRows.ALL).call_model(model, mb)
                    logits = hidden.double() @ full_weight.double().T
                row_max = logits.max(-1).values
                assert 10.0 < float(row_max.median()) < 40.0, f"logit scale {float(row_max.median())}: not a trained model's"
                refs.append(logprobs_reference(logits, mb.targets))
            # --- the forward-only pass on both paths and both settings ---
            for path in OutputPath:
                for logit_dtype in LogitDtype:
                    out = forward_logprobs(grpo(path, logit_dtype), fbf, ddp, micro)
                    lp_err = max(float((lp.double() - r[0]).abs().max()) for lp, r in zip(out.logprobs, refs))
                    # at the loss rows (the output layer computes no other: OutputRows.LOSS)
                    ent_err = max(float((e.double() - r[1])[mb.loss_mask].abs().max()) for e, r, mb in zip(out.entropy, refs, micro))
                    where = f"[{fmt.value}, {path.value}, {logit_dtype.value}]"
                    if logit_dtype is LogitDtype.FP32:
                        assert lp_err <= CPU_FP32_MAX_ABS and ent_err <= CPU_FP32_MAX_ABS, \
                            f"{where}: max |Δ| log-prob {lp_err:.3g}, entropy {ent_err:.3g} > {CPU_FP32_MAX_ABS:g}"
                    else:
                        assert max(lp_err, ent_err) > CPU_BF16_MIN_MAX_ABS, f"{where}: as exact as fp32"
        # --- a training step: the fused path's loss in forward equals the logits path's at fp32 logits ---
        micro = [prepare_micro_batch(rollouts.select(slice(i, i + 2))) for i in (0, 2)]
        losses = {}
        for logit_dtype in LogitDtype:
            for path in OutputPath:
                g = grpo(path, logit_dtype)
                batch = g.global_batch(micro, step=0)
                ddp.zero_grad_buffer()
                out = forward_backward_cpu(groups=groups, forward_step_func=g.forward_step_func(batch, step=0),
                                           data_iterator=iter(micro), model=ddp, num_microbatches=2)
                ddp.finish_grad_sync()
                losses[path, logit_dtype] = sum(float(d["loss"].sum()) for d in out)
                for name, p in model.named_parameters():
                    grad = getattr(p, "main_grad", p.grad)
                    assert grad is not None and bool(torch.isfinite(grad).all()), f"{name}: no or a non-finite gradient"
        fp32_gap = abs(losses[OutputPath.FUSED, LogitDtype.FP32] - losses[OutputPath.LOGITS, LogitDtype.FP32])
        assert fp32_gap <= 1e-5 * (1 + abs(losses[OutputPath.LOGITS, LogitDtype.FP32])), f"fused vs logits at fp32: {losses}"
        _refused_where_the_layer_is_not_computed_here(groups, model, micro[0])
    finally:
        ps.destroy_model_parallel()


def _refused_where_the_layer_is_not_computed_here(groups, model, mb) -> None:
    import pytest

    grpo = MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=1.0, calculate_per_token_loss=False, groups=groups,
                        logit_dtype=LogitDtype.FP32)
    model.output_layer.gather_output = True  # a layer the logits path runs as it is
    try:
        with pytest.raises(ValueError, match="logit_dtype=fp32: the model's output layer"):
            grpo.call_model(model, mb)
    finally:
        model.output_layer.gather_output = False


def _gathered(shard: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts)


if __name__ == "__main__":
    worker_main({"case_logit_dtype": case_logit_dtype})
