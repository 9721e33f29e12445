"""MegatronGRPO's output layer on the loss rows alone (``OutputRows.LOSS``, mp_grpo/megatron/output_rows.py) against
every row (``OutputRows.ALL``).

Under torchrun (gloo) with megatron-core's real ``parallel_state`` — TP = 2 and CP = 2 (2 ranks each) — one step
through megatron-core's ``forward_step`` / ``backward_step`` / ``finalize_model_grads`` (``forward_backward_cpu``) on
the CPU stand-in for GPTModel, once on every row and once on the loss rows: the reduced loss and every metric, the
forward-only pass's log-probs at the loss tokens (0 elsewhere on both) and its entropy there (0 elsewhere with
``LOSS``), and every parameter gradient (gathered over TP) must be equal within the tolerance of the dtype. The
model output of the ``LOSS`` run is checked to be the loss rows' alone (``[1, K, ...]``), so that the comparison is
one of two different computations. Variants: both output paths (the fused path's loss in forward and its per-token
op), padded and packed, GRPOLoss's torch and Triton backends, a token-level, a sequence-level and a step-level loss,
bf16 through ``Float16Module`` with bf16 and with fp32 logits.

One process: the rollout's sampling filter (a per-sequence top-k) cut to the rows; a micro-batch without a loss token on both paths (no row computed, a zero share and gradient); a trained
position outside ``mb.loss_rows`` (a loss mask replaced by a larger one) is an error naming ``loss_rows``; the
setting's type; an output of the loss rows under ``OutputRows.ALL`` is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

from mp_grpo.config.job import OutputPath, OutputRows, SequenceFormat
from mp_grpo.config.precision import LogitDtype
from mp_grpo.loss.grpo_loss import GRPOLoss, LossBackend
from mp_grpo.megatron import MegatronGRPO, ParallelGroups, prepare_micro_batch
from mp_grpo.megatron.fused_output import OutputWeight
from tests.distributed import torchrun, worker_main
from tests.megatron import helpers as H
from tests.tolerances import assert_close, tolerance

NUM_MICROBATCHES = 2
MICRO_BATCH_SIZE = 3


@dataclass(frozen=True)
class Variant:
    fmt: str
    path: OutputPath
    loss: str
    backend: LossBackend
    bf16: bool = False
    """Float16Module (bf16 parameters), called with fp32_output=False."""
    logit_dtype: LogitDtype = LogitDtype.BF16


VARIANTS = {
    "tp": [
        Variant("padded", OutputPath.LOGITS, "ppo_token_tis", LossBackend.TORCH),
        Variant("packed", OutputPath.FUSED, "ppo_token_tis", LossBackend.TRITON),  # the loss in forward
        Variant("padded", OutputPath.FUSED, "sequence_level", LossBackend.TORCH),  # the per-token op
        Variant("packed", OutputPath.LOGITS, "ppo_token_tis", LossBackend.TORCH, bf16=True),
        Variant("padded", OutputPath.FUSED, "ppo_token_tis", LossBackend.TORCH, bf16=True, logit_dtype=LogitDtype.FP32),
    ],
    "cp": [
        Variant("packed", OutputPath.FUSED, "ppo_token_tis", LossBackend.TRITON),  # the per-token op under CP
        Variant("padded", OutputPath.LOGITS, "sequence_level", LossBackend.TORCH),
        Variant("packed", OutputPath.LOGITS, "step_level", LossBackend.TORCH),
    ],
}
"""(The rollout's sampling filter on the rows: :func:`test_sampling_filter_cut_to_the_rows`, one process — the
threshold search under Triton's interpreter is too slow for a step at two ranks.)"""


def _step(groups, rollouts, weights, v: Variant, rows: OutputRows):
    """One step: (reduced metrics, no-grad log-probs and entropies per micro-batch, gradients, model output shapes)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    from mp_grpo.loss.metrics import reduce_metrics
    from mp_grpo.train.cpu_ddp import CpuDistributedDataParallel
    from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config
    from mp_grpo.train.cpu_schedule import forward_backward_cpu

    config = cpu_model_config(hidden_size=H.HIDDEN, tensor_model_parallel_size=groups.tp_size,
                              context_parallel_size=groups.cp_size)
    config.finalize_model_grads_func = finalize_model_grads
    model = CpuGPTStandIn(config, vocab_size=H.VOCAB, max_sequence_length=H.MAX_LEN, tp_group=groups.tp)
    model.load_full_weights(weights)
    module, kwargs = model, {}
    if v.bf16:
        config.bf16 = True
        module, kwargs = Float16Module(config, model), {"fp32_output": False}
    ddp = CpuDistributedDataParallel(config, DistributedDataParallelConfig(), module, dp_cp_group=groups.dp_cp,
                                     main_grad=v.bf16)
    first = ps.get_data_parallel_rank() * NUM_MICROBATCHES * MICRO_BATCH_SIZE
    micro = [prepare_micro_batch(rollouts.select(slice(first + i * MICRO_BATCH_SIZE, first + (i + 1) * MICRO_BATCH_SIZE)),
                                 sequence_format=SequenceFormat(v.fmt), cp_group=groups.cp)
             for i in range(NUM_MICROBATCHES)]
    grpo = MegatronGRPO(H.loss_config(v.loss), temperature=H.TEMPERATURE, num_microbatches=NUM_MICROBATCHES,
                        calculate_per_token_loss=False, groups=groups, output_path=v.path, output_rows=rows,
                        logit_dtype=v.logit_dtype)
    grpo.loss = GRPOLoss(grpo.config, backend=v.backend)
    with torch.no_grad():  # the old-log-prob pass of a real step (entropies for top-entropy selection)
        shapes = [tuple(grpo.call_model(ddp, mb, model_kwargs=kwargs)[0].shape[:-1]) for mb in micro]
        passes = [grpo.model_logprobs(ddp, mb, model_kwargs=kwargs) for mb in micro]
    batch = grpo.global_batch(micro, step=1, entropies=[entropy for _, entropy in passes])
    losses = forward_backward_cpu(forward_step_func=grpo.forward_step_func(batch, step=1, model_kwargs=kwargs),
                                  data_iterator=iter(micro), model=ddp, num_microbatches=NUM_MICROBATCHES,
                                  groups=groups)
    return reduce_metrics(losses, groups.dp_cp), passes, H.full_grads(model), micro, shapes


def _relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm().clamp(min=1e-30))


def case_rows_equal_every_row(layout: str) -> None:
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2 if layout == "tp" else 1,
                                 context_parallel_size=2 if layout == "cp" else 1)
    try:
        groups = ParallelGroups.from_parallel_state()
        rollouts = H.make_rollouts(groups.dp_size * NUM_MICROBATCHES * MICRO_BATCH_SIZE, seed=31)
        weights = H.full_weights(seed=12)
        for v in VARIANTS[layout]:
            where = f"[{v}, {layout}]"
            ref_metrics, ref_passes, ref_grads, micro, ref_shapes = _step(groups, rollouts, weights, v, OutputRows.ALL)
            metrics, passes, grads, _, shapes = _step(groups, rollouts, weights, v, OutputRows.LOSS)
            # the LOSS run's model computed the loss rows alone
            assert ref_shapes == [tuple(mb.targets.shape) for mb in micro], where
            assert shapes == [(1, int(mb.loss_mask.sum())) for mb in micro], f"{shapes} {where}"
            assert any(s[1] < math.prod(r) for s, r in zip(shapes, ref_shapes)), f"no row was skipped {where}"
            dtype = torch.bfloat16 if v.bf16 and v.logit_dtype is LogitDtype.BF16 else torch.float32
            tol = tolerance(dtype)
            assert sorted(metrics) == sorted(ref_metrics), where
            for key, ref in ref_metrics.items():
                assert math.isclose(metrics[key], ref, rel_tol=tol["rtol"], abs_tol=tol["atol"]), \
                    f"metric {key}: {metrics[key]} vs every row's {ref} {where}"
            for i, (mb, (lp, ent), (ref_lp, ref_ent)) in enumerate(zip(micro, passes, ref_passes)):
                mask = mb.loss_mask
                assert_close(lp, ref_lp, dtype, msg=f"no-grad log-probs of micro-batch {i} {where}")
                assert_close(ent[mask], ref_ent[mask], dtype, msg=f"no-grad entropy at the loss tokens {i} {where}")
                assert not ent[~mask].any(), f"entropy outside the loss rows {i} {where}"
            assert sorted(grads) == sorted(ref_grads)
            for name, ref in ref_grads.items():
                if v.bf16:
                    err = _relative_l2(grads[name], ref)
                    assert err <= tolerance(torch.bfloat16)["rtol"], f"grad of {name}: relative L2 {err:.2e} {where}"
                else:
                    assert_close(grads[name], ref, torch.float32, msg=f"grad of {name} {where}")
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("layout", ["tp", "cp"], ids=["tp2", "cp2"])
def test_loss_rows_equal_every_row(layout: str) -> None:
    torchrun(__file__, "case_rows_equal_every_row", nproc=2, layout=layout)


def _grpo(rows: OutputRows = OutputRows.LOSS, path: OutputPath = OutputPath.FUSED) -> MegatronGRPO:
    return MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=H.TEMPERATURE, num_microbatches=1,
                        calculate_per_token_loss=False, groups=ParallelGroups(), vocab_size=H.VOCAB,
                        output_path=path, output_rows=rows)


def test_a_trained_position_outside_the_rows_is_an_error() -> None:
    mb = prepare_micro_batch(H.make_rollouts(2, seed=9))
    larger = replace(mb, loss_mask=mb.loss_mask | (mb.targets != -100) | torch.ones_like(mb.loss_mask))
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(*mb.targets.shape, H.HIDDEN, generator=gen)
    weight = OutputWeight(torch.randn(H.VOCAB, H.HIDDEN, generator=gen), accumulate_into_main_grad=False)
    with pytest.raises(ValueError, match="loss_rows"):
        _grpo().token_logprobs(hidden, larger, output_weight=weight)
    lp, _ = _grpo(OutputRows.ALL).token_logprobs(hidden, larger, output_weight=weight)  # every row: no such error
    assert lp.shape == mb.targets.shape
    remade = replace(larger, loss_rows=None)  # the rows made again from the new mask
    assert remade.loss_rows.numel() == mb.targets.numel()


def test_sampling_filter_cut_to_the_rows() -> None:
    """A per-sequence top-k (a per-row tensor of the micro-batch) on the loss rows (the fused path, whose op cuts its
    per-row values as the logits path's does): the log-probs (their kept sets exactly) and the entropy at the loss
    tokens equal every row's, from the same hidden states."""
    path = OutputPath.FUSED
    mb = prepare_micro_batch(H.make_rollouts(2, seed=8)).with_sampling_filter(top_k=torch.tensor([7, 20]))
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(*mb.targets.shape, H.HIDDEN, generator=gen)
    weight = torch.randn(H.VOCAB, H.HIDDEN, generator=gen) * H.HIDDEN**-0.5
    out = {}
    for rows in OutputRows:
        grpo = MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=H.TEMPERATURE, num_microbatches=1,
                            calculate_per_token_loss=False, groups=ParallelGroups(), vocab_size=H.VOCAB,
                            output_path=path, output_rows=rows, check_inputs=False)
        out[rows] = grpo.token_logprobs(hidden, mb, output_weight=OutputWeight(weight, False))
    (lp, ent), (ref_lp, ref_ent) = out[OutputRows.LOSS], out[OutputRows.ALL]
    mask = mb.loss_mask
    assert torch.equal(torch.isneginf(lp), torch.isneginf(ref_lp)) and bool(torch.isneginf(lp).any()), "kept sets"
    finite = torch.isfinite(ref_lp)
    assert_close(lp[finite], ref_lp[finite], torch.float32, msg="filtered log-probs")
    assert_close(ent[mask], ref_ent[mask], torch.float32, msg="filtered entropy at the loss tokens")


@pytest.mark.parametrize("path", list(OutputPath))
def test_a_micro_batch_without_loss_rows(path: OutputPath) -> None:
    """No trained token (K = 0): the output of no row, log-probs and entropy 0, a zero gradient, a zero share."""
    r = H.make_rollouts(2, seed=6)
    mb = prepare_micro_batch(replace(r, loss_mask=torch.zeros_like(r.loss_mask)))
    assert mb.loss_rows.numel() == 0
    grpo = _grpo(OutputRows.LOSS, path)
    x = torch.zeros(1, 0, H.HIDDEN if path == OutputPath.FUSED else H.VOCAB, requires_grad=True)
    weight = OutputWeight(torch.randn(H.VOCAB, H.HIDDEN, requires_grad=True), False) if path == OutputPath.FUSED else None
    lp, ent = grpo.token_logprobs(x, mb, output_weight=weight)
    assert lp.shape == ent.shape == mb.targets.shape and not lp.any() and not ent.any()
    loss, metrics = grpo.loss_func(mb, grpo.global_batch([mb], step=0), x, output_weight=weight)
    loss.backward()
    assert float(loss.detach()) == 0.0 and x.grad.shape == x.shape
    if weight is not None:
        assert not weight.weight.grad.any()


def test_bad_settings_and_outputs() -> None:
    mb = prepare_micro_batch(H.make_rollouts(2, seed=4))
    k = int(mb.loss_mask.sum())
    with pytest.raises(TypeError, match="output_rows must be an OutputRows"):
        _grpo("loss")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"model output must be vocab-parallel logits \[2, \d+, V_local\] \("):
        _grpo(OutputRows.ALL, OutputPath.LOGITS).token_logprobs(torch.zeros(1, k, H.VOCAB), mb)
    with pytest.raises(ValueError, match=rf"or \[1, {k}, V_local\]"):
        _grpo(OutputRows.LOSS, OutputPath.LOGITS).token_logprobs(torch.zeros(1, k + 1, H.VOCAB), mb)
    with pytest.raises(ValueError, match="loss_rows must be a"):
        replace(mb, loss_rows=mb.loss_rows.to(torch.int32))


if __name__ == "__main__":
    worker_main({"case_rows_equal_every_row": case_rows_equal_every_row})
