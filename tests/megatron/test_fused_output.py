"""The fused output path (mp_grpo/megatron/fused_output.py, ``MegatronGRPO(output_path=OutputPath.FUSED)``).

Under torchrun (gloo) with megatron-core's real ``parallel_state`` — TP = 2 (2 ranks) and TP = 2 × DP = 2
(4 ranks) — one step through megatron-core's ``forward_step`` / ``backward_step`` / ``finalize_model_grads``
(``forward_backward_cpu``) on the CPU stand-in for GPTModel, once reading its logits and once its final
hidden states and output weight: the reduced losses, the no-grad (old-log-prob) pass and every parameter
gradient (embedding, hidden block, output weight; gathered over TP) must be equal within fp32 tolerance.
Variants: padded / packed, ``calculate_per_token_loss`` on / off, DDP averaging on / off, tied embedding and
output weights (the weight GPTModel passes to its output layer), Megatron DDP's fp32 ``main_grad`` buffers
with the output layer's gradient-accumulation fusion on and off (the fused op writes ``main_grad`` itself in
both), and bf16
through ``Float16Module`` (which upcasts the hidden states to fp32; bf16 tolerance on relative L2 errors).

Sequence parallelism is not run here: megatron-core's sequence-parallel mappings allocate CUDA buffers.
``tests/gpu/test_megatron_fused_output.py`` and the sequence-parallel case of ``tests/gpu/test_megatron_gpt.py``
cover it on GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from mp_grpo.config.job import OutputPath, SequenceFormat
from mp_grpo.megatron import MegatronGRPO, ParallelGroups, prepare_micro_batch
from mp_grpo.megatron.fused_output import OutputWeight
from tests.distributed import torchrun, worker_main
from tests.megatron import helpers as H
from tests.tolerances import assert_close, tolerance

NUM_MICROBATCHES = 2
MICRO_BATCH_SIZE = 2
TINY_NORM = 1e-30
"""Floor of a gradient's norm in a relative L2 error (every parameter of the stand-in gets a gradient)."""


@dataclass(frozen=True)
class Variant:
    fmt: str
    per_token: bool
    avg: bool
    loss: str
    tied: bool = False
    """share_embeddings_and_output_weights."""
    main_grad: bool = False
    """Megatron DDP's fp32 main_grad buffers (the fused op writes main_grad itself: mp_grpo/megatron/main_grad.py)."""
    fusion: bool = False
    """The fused run turns on the output layer's gradient-accumulation fusion (with main_grad)."""
    bf16: bool = False
    """Float16Module (bf16), called with its default fp32_output=True."""


VARIANTS = [
    Variant("padded", False, False, "ppo_token_tis"),
    Variant("packed", True, False, "sequence_level", tied=True),
    Variant("padded", False, True, "step_level", main_grad=True, fusion=True),
    Variant("padded", True, False, "sequence_level", main_grad=True, fusion=True, bf16=True),
    # Tied embeddings x main_grad without the layer's fusion x the loss in forward (ppo_token_tis is token-separable).
    Variant("packed", False, False, "ppo_token_tis", tied=True, main_grad=True),
]


# ---------------------------------------------------------------------------------------------- workers
def _gathered_grads(model) -> dict[str, torch.Tensor]:
    """Unsharded fp32 gradients (``main_grad`` where DDP keeps them there), vocab shards all-gathered over TP."""
    group = model.word_embeddings.tp_group
    out = {}
    for name, param in model.named_parameters():
        grad = param.main_grad if hasattr(param, "main_grad") else param.grad
        grad = grad.float()
        if getattr(param, "tensor_model_parallel", False) and group.size() > 1:
            parts = [torch.empty_like(grad) for _ in range(group.size())]
            dist.all_gather(parts, grad.contiguous(), group=group)
            grad = torch.cat(parts)
        out[name] = grad
    return out


def _step(groups, rollouts, weights, v: Variant, path: OutputPath):
    """One step on ``path``: (reduced metrics, no-grad log-probs and entropies per micro-batch, gradients)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    from mp_grpo.loss.metrics import reduce_metrics
    from mp_grpo.train.cpu_ddp import CpuDistributedDataParallel
    from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config
    from mp_grpo.train.cpu_schedule import forward_backward_cpu

    config = cpu_model_config(hidden_size=H.HIDDEN, tensor_model_parallel_size=groups.tp_size,
                              calculate_per_token_loss=v.per_token)
    config.finalize_model_grads_func = finalize_model_grads
    model = CpuGPTStandIn(config, vocab_size=H.VOCAB, max_sequence_length=H.MAX_LEN, tp_group=groups.tp,
                          share_embeddings_and_output_weights=v.tied)
    model.load_full_weights(weights)
    if v.tied:  # as GPTModel does for a weight shared by the embedding and the output layer
        model.word_embeddings.weight.zero_out_wgrad = True
    module = model
    if v.bf16:
        config.bf16 = True
        module = Float16Module(config, model)
    if v.fusion and path == OutputPath.FUSED:
        # megatron-core lets ColumnParallelLinear turn this on only with apex's CUDA weight-gradient kernel,
        # which its own (logits-path) backward then calls; the fused op accumulates into main_grad itself.
        model.output_layer.gradient_accumulation_fusion = True
    ddp = CpuDistributedDataParallel(config, DistributedDataParallelConfig(average_in_collective=v.avg), module,
                                     dp_cp_group=groups.dp_cp, main_grad=v.main_grad)
    first = ps.get_data_parallel_rank() * NUM_MICROBATCHES * MICRO_BATCH_SIZE
    micro = [
        prepare_micro_batch(rollouts.select(slice(first + i * MICRO_BATCH_SIZE, first + (i + 1) * MICRO_BATCH_SIZE)),
                            sequence_format=SequenceFormat(v.fmt))
        for i in range(NUM_MICROBATCHES)
    ]
    grpo = MegatronGRPO(H.loss_config(v.loss), temperature=H.TEMPERATURE, num_microbatches=NUM_MICROBATCHES,
                        calculate_per_token_loss=v.per_token, groups=groups, output_path=path)
    with torch.no_grad():  # the old-log-prob pass of a real step (entropies for top-entropy selection)
        passes = [grpo.model_logprobs(ddp, mb) for mb in micro]
    batch = grpo.global_batch(micro, step=1, entropies=[entropy for _, entropy in passes])
    losses = forward_backward_cpu(forward_step_func=grpo.forward_step_func(batch, step=1), data_iterator=iter(micro),
                                  model=ddp, num_microbatches=NUM_MICROBATCHES, groups=groups)
    if v.main_grad and path == OutputPath.FUSED:
        weight = model.word_embeddings.weight if v.tied else model.output_layer.weight
        assert weight.grad_added_to_main_grad and weight.grad is None, "the fused op did not write main_grad itself"
    return reduce_metrics(losses, groups.dp_cp), passes, _gathered_grads(model)


def _relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm().clamp(min=TINY_NORM))


def case_fused_equals_logits(tp: int) -> None:
    """Every VARIANT: the fused path gives the logits path's loss, no-grad log-probs and gradients."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        groups = ParallelGroups.from_parallel_state()
        rollouts = H.make_rollouts(groups.dp_size * NUM_MICROBATCHES * MICRO_BATCH_SIZE, seed=21)
        weights = H.full_weights(seed=8)
        for v in VARIANTS:
            where = f"[{v}, tp={tp}, dp={groups.dp_size}]"
            ref_metrics, ref_passes, ref_grads = _step(groups, rollouts, weights, v, OutputPath.LOGITS)
            metrics, passes, grads = _step(groups, rollouts, weights, v, OutputPath.FUSED)
            dtype = torch.bfloat16 if v.bf16 else torch.float32
            rtol = tolerance(dtype)["rtol"]
            assert math.isclose(metrics["loss"], ref_metrics["loss"], rel_tol=rtol, abs_tol=tolerance(dtype)["atol"]), \
                f"loss {metrics['loss']} vs logits path {ref_metrics['loss']} {where}"
            for i, ((lp, ent), (ref_lp, ref_ent)) in enumerate(zip(passes, ref_passes)):
                assert_close(lp, ref_lp, dtype, msg=f"no-grad log-probs of micro-batch {i} {where}")
                assert_close(ent, ref_ent, dtype, msg=f"no-grad entropy of micro-batch {i} {where}")
            assert sorted(grads) == sorted(ref_grads)
            for name, ref in ref_grads.items():
                if v.bf16:
                    err = _relative_l2(grads[name], ref)
                    assert err <= rtol, f"grad of {name}: relative L2 error {err:.2e} > {rtol} {where}"
                else:
                    assert_close(grads[name], ref, torch.float32, msg=f"grad of {name} {where}")
        if groups.dp_size == 1:
            _check_errors(groups, rollouts, weights)
    finally:
        ps.destroy_model_parallel()


class _Head(torch.nn.Module):
    """A model that calls its output layer ``calls`` times (GPTModel: once)."""

    def __init__(self, output_layer: torch.nn.Module, calls: int) -> None:
        super().__init__()
        self.output_layer = output_layer
        self.calls = calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.calls):
            x, _ = self.output_layer(x)
        return x


def _check_errors(groups, rollouts, weights) -> None:
    """What the fused path refuses, with errors that say why; the output layer's forward is always restored."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config
    from mp_grpo.megatron.fused_output import call_for_hidden_states

    config = cpu_model_config(hidden_size=H.HIDDEN, tensor_model_parallel_size=groups.tp_size)
    x = torch.randn(3, 2, H.HIDDEN)

    def layer(bias: bool) -> ColumnParallelLinear:
        return ColumnParallelLinear(H.HIDDEN, H.VOCAB, config=config, init_method=torch.nn.init.normal_, bias=bias,
                                    gather_output=False, tp_group=groups.tp)

    with pytest.raises(ValueError, match="bias"):
        call_for_hidden_states(_Head(layer(bias=True), calls=1), x)
    twice = _Head(layer(bias=False), calls=2)
    with pytest.raises(RuntimeError, match="more than once"):
        call_for_hidden_states(twice, x)
    assert "forward" not in twice.output_layer.__dict__, "the output layer's forward was not restored"
    assert twice.output_layer(x)[0].shape == (3, 2, H.VOCAB // groups.tp_size)  # logits again
    with pytest.raises(RuntimeError, match="never called its output layer"):
        call_for_hidden_states(_Head(layer(bias=False), calls=0), x)
    with pytest.raises(TypeError, match="ColumnParallelLinear"):
        call_for_hidden_states(_Head(torch.nn.Linear(H.HIDDEN, H.VOCAB), calls=0), x)
    deferred = _Head(layer(bias=False), calls=1)
    deferred.output_layer.config.defer_embedding_wgrad_compute = True
    with pytest.raises(ValueError, match="defer_embedding_wgrad_compute"):
        call_for_hidden_states(deferred, x)

    # An unsharded model with a TP group of 2: its weight holds the whole vocabulary, the adapter names the group.
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    unsharded = CpuGPTStandIn(cpu_model_config(hidden_size=H.HIDDEN), vocab_size=H.VOCAB, max_sequence_length=H.MAX_LEN,
                              tp_group=solo)
    unsharded.load_full_weights(weights)
    grpo = MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=1.0, num_microbatches=1,
                        calculate_per_token_loss=False, groups=groups, output_path=OutputPath.FUSED)
    mb = prepare_micro_batch(rollouts.select(slice(0, 2)))
    with pytest.raises(ValueError, match="tp_group"):
        grpo.model_logprobs(unsharded, mb)


# ---------------------------------------------------------------------------------------------- pytest
@pytest.mark.parametrize("tp,nproc", [(2, 2), (2, 4)], ids=["tp2", "tp2_dp2"])
def test_fused_output_equals_logits_path(tp: int, nproc: int) -> None:
    torchrun(__file__, "case_fused_equals_logits", nproc=nproc, tp=tp)


def _grpo(path: OutputPath) -> MegatronGRPO:
    return MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=H.TEMPERATURE, num_microbatches=1,
                        calculate_per_token_loss=False, groups=ParallelGroups(), vocab_size=H.VOCAB,
                        output_path=path)


def test_token_logprobs_of_hidden_states_equal_those_of_logits() -> None:
    """One process, no model: the fused path's log-probs and gradients are those of ``hidden @ weightᵀ``;
    fp32 hidden states with a bf16 weight (Float16Module's upcast) are cast back exactly."""
    mb = prepare_micro_batch(H.make_rollouts(2, seed=9))
    gen = torch.Generator().manual_seed(10)
    hidden = torch.randn(*mb.targets.shape, H.HIDDEN, generator=gen)
    weight = torch.randn(H.VOCAB, H.HIDDEN, generator=gen) * H.HIDDEN**-0.5
    g_lp, g_ent = torch.randn(mb.targets.shape, generator=gen), torch.randn(mb.targets.shape, generator=gen)
    results = []
    for path in (OutputPath.LOGITS, OutputPath.FUSED):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if path == OutputPath.FUSED:
            lp, ent = _grpo(path).token_logprobs(h, mb, output_weight=OutputWeight(w, accumulate_into_main_grad=False))
        else:
            lp, ent = _grpo(path).token_logprobs(h @ w.t(), mb)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        results.append((lp, ent, h.grad, w.grad))
    for name, actual, expected in zip(("logprobs", "entropy", "grad hidden", "grad weight"), results[1], results[0]):
        assert_close(actual, expected, torch.float32, msg=name)

    bf16_weight = weight.to(torch.bfloat16)
    upcast, _ = _grpo(OutputPath.FUSED).token_logprobs(hidden.to(torch.bfloat16).float(), mb,
                                                       output_weight=OutputWeight(bf16_weight, False))
    native, _ = _grpo(OutputPath.FUSED).token_logprobs(hidden.to(torch.bfloat16), mb,
                                                       output_weight=OutputWeight(bf16_weight, False))
    assert torch.equal(upcast, native)


@pytest.mark.parametrize("loss", ["ppo_token_tis", "sequence_level"])
def test_loss_func_with_the_loss_in_forward_equals_logits_path(loss: str) -> None:
    """One process, no model: ``loss_func`` on the fused path (the loss in forward for a token-separable config,
    the per-token op otherwise) returns the logits path's loss and metrics, and the same gradients."""
    from mp_grpo.megatron.fused_output import loss_in_forward

    mb = prepare_micro_batch(H.make_rollouts(4, seed=19))
    assert loss_in_forward(H.loss_config(loss), mb.sequences) == (loss == "ppo_token_tis")
    gen = torch.Generator().manual_seed(20)
    hidden = torch.randn(*mb.targets.shape, H.HIDDEN, generator=gen)
    weight = torch.randn(H.VOCAB, H.HIDDEN, generator=gen) * H.HIDDEN**-0.5
    results = []
    for path in (OutputPath.LOGITS, OutputPath.FUSED):
        grpo = MegatronGRPO(H.loss_config(loss), temperature=H.TEMPERATURE, num_microbatches=1,
                            calculate_per_token_loss=False, groups=ParallelGroups(), vocab_size=H.VOCAB,
                            output_path=path)
        batch = grpo.global_batch([mb], step=3)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if path == OutputPath.FUSED:
            out = grpo.loss_func(mb, batch, h, output_weight=OutputWeight(w, accumulate_into_main_grad=False))
        else:
            out = grpo.loss_func(mb, batch, h @ w.t())
        out[0].backward(torch.tensor(0.37))  # Megatron's upstream gradient (loss scaling)
        results.append((out[0], out[1]["loss"], h.grad, w.grad))
    for name, actual, expected in zip(("loss", "metrics loss", "grad hidden", "grad weight"), results[1], results[0]):
        assert_close(actual, expected, torch.float32, msg=f"{name} ({loss})")


def test_fused_path_errors_name_the_argument() -> None:
    mb = prepare_micro_batch(H.make_rollouts(2, seed=12))
    hidden = torch.zeros(*mb.targets.shape, H.HIDDEN)
    weight = OutputWeight(torch.zeros(H.VOCAB, H.HIDDEN), accumulate_into_main_grad=False)
    with pytest.raises(TypeError, match="output_path must be an OutputPath"):
        _grpo("fused")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="output_weight"):
        _grpo(OutputPath.FUSED).token_logprobs(hidden, mb)
    with pytest.raises(ValueError, match="output_weight is only used with output_path=OutputPath.FUSED"):
        _grpo(OutputPath.LOGITS).token_logprobs(torch.zeros(*mb.targets.shape, H.VOCAB), mb, output_weight=weight)
    with pytest.raises(ValueError, match="final hidden states"):
        _grpo(OutputPath.FUSED).token_logprobs(hidden.transpose(0, 1), mb, output_weight=weight)
    with pytest.raises(ValueError, match="tp_group"):
        half = OutputWeight(torch.zeros(H.VOCAB // 2, H.HIDDEN), accumulate_into_main_grad=False)
        _grpo(OutputPath.FUSED).token_logprobs(hidden, mb, output_weight=half)
    with pytest.raises(ValueError, match="weight shape"):
        narrow = OutputWeight(torch.zeros(H.VOCAB, H.HIDDEN - 1), accumulate_into_main_grad=False)
        _grpo(OutputPath.FUSED).token_logprobs(hidden, mb, output_weight=narrow)


if __name__ == "__main__":
    worker_main({"case_fused_equals_logits": case_fused_equals_logits})
