"""call_for_logits (mp_grpo/megatron/logits_output.py): the logits path's batch-major output layer.

Under torchrun (gloo) with megatron-core's ``parallel_state``, TP = 1 and TP = 2, on the CPU stand-in for GPTModel
(its output layer is megatron-core's ``ColumnParallelLinear`` and it returns ``logits.transpose(0, 1).contiguous()``
as GPTModel does): the logits and every parameter gradient through a random upstream gradient equal those of
the model's own output layer — untied and tied embeddings, Megatron DDP's fp32 ``main_grad`` with the output
layer's gradient-accumulation fusion on and off (written by the layer itself in both, except for a tied weight
without ``zero_out_wgrad``, whose gradient must reach DDP's hook) — and neither forward nor backward copies a ``[tokens, V_local]`` tensor (counted
with a dispatch mode; the model's own layer makes three such copies, so the count can fail). Then
``MegatronGRPO``'s logits-path step (its ``call_model`` goes through ``call_for_logits``, its loss writes the
logits' gradient in place) gives the gradients of the same loss on the model's own output layer. Output layers
it does not reproduce run as they are.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mp_grpo.megatron import MegatronGRPO, ParallelGroups, prepare_micro_batch
from mp_grpo.megatron.logits_output import call_for_logits, reproducible
from tests.distributed import torchrun, worker_main
from tests.megatron import helpers as H
from tests.tolerances import assert_close

_COPIES = {"clone", "copy_", "_to_copy", "_reshape_copy"}


class _LogitCopies(TorchDispatchMode):
    """Counts copies whose result has at least ``numel`` elements (the logits' size)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in _COPIES and isinstance(out, torch.Tensor) and out.numel() >= self.numel:
            self.count += 1
        return out


def _model(groups, weights, *, tied: bool, main_grad: bool, zero_out_wgrad: bool = True):
    from megatron.core.distributed import DistributedDataParallelConfig

    from mp_grpo.train.cpu_ddp import CpuDistributedDataParallel
    from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config

    config = cpu_model_config(hidden_size=H.HIDDEN, tensor_model_parallel_size=groups.tp_size)
    model = CpuGPTStandIn(config, vocab_size=H.VOCAB, max_sequence_length=H.MAX_LEN, tp_group=groups.tp,
                          share_embeddings_and_output_weights=tied)
    model.load_full_weights(weights)
    if tied and zero_out_wgrad:
        model.word_embeddings.weight.zero_out_wgrad = True  # as GPTModel does
    ddp = CpuDistributedDataParallel(config, DistributedDataParallelConfig(), model, dp_cp_group=groups.dp_cp,
                                     main_grad=main_grad)
    return model, ddp


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: (p.main_grad if hasattr(p, "main_grad") else p.grad).clone() for name, p in model.named_parameters()}


def case_equals_the_model_layer(tp: int) -> None:
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        groups = ParallelGroups.from_parallel_state()
        weights = H.full_weights(seed=5)
        mb = prepare_micro_batch(H.make_rollouts(4, seed=6).select(slice(0, 3)))
        b, s = mb.input_ids.shape
        v_local = H.VOCAB // tp
        gen = torch.Generator().manual_seed(7)
        upstream = torch.randn(b, s, v_local, generator=gen)
        # (tied, main_grad, the layer's gradient-accumulation fusion, zero_out_wgrad on a tied weight)
        cases = [(False, False, False, True), (True, False, False, True)]
        cases += [(tied, True, fusion, True) for tied in (False, True) for fusion in (False, True)]
        cases += [(True, True, False, False)]  # a tied weight DDP's hook would drop the embedding gradient of
        for tied, main_grad, fusion, zero_out_wgrad in cases:
            where = f"[tp={tp}, tied={tied}, main_grad={main_grad}, fusion={fusion}, zero_out_wgrad={zero_out_wgrad}]"
            results = []
            for ours in (False, True):
                model, ddp = _model(groups, weights, tied=tied, main_grad=main_grad, zero_out_wgrad=zero_out_wgrad)
                if ours:
                    model.output_layer.gradient_accumulation_fusion = fusion
                counter = _LogitCopies(b * s * v_local)
                with counter:
                    call = call_for_logits if ours else (lambda m, *a: m(*a))
                    logits = call(ddp, mb.input_ids, mb.position_ids, None)
                    logits.backward(upstream)
                ddp.finish_grad_sync()
                if main_grad and ours:
                    # into main_grad itself (mp_grpo/megatron/main_grad.py): under fusion, and under DDP unless a
                    # tied weight lacks zero_out_wgrad (its gradient then goes through autograd and DDP's hook)
                    weight = model.word_embeddings.weight if tied else model.output_layer.weight
                    expected = fusion or not tied or zero_out_wgrad
                    assert weight.grad_added_to_main_grad == expected, \
                        f"main_grad written by the layer: {weight.grad_added_to_main_grad}, expected {expected} {where}"
                results.append((logits.detach(), _grads(model), counter.count))
            (ref_logits, ref_grads, ref_copies), (logits, grads, copies) = results
            assert logits.is_contiguous() and logits.shape == (b, s, v_local)
            assert_close(logits, ref_logits, torch.float32, msg=f"logits {where}")
            for name, ref in ref_grads.items():
                assert_close(grads[name], ref, torch.float32, msg=f"grad of {name} {where}")
            assert copies == 0, f"{copies} [tokens, V_local] copies with the batch-major layer {where}"
            assert ref_copies >= 2, f"the model's own layer made {ref_copies} logits copies (expected ≥ 2) {where}"
        _grpo_step_equals_the_model_layer(groups, weights)
    finally:
        ps.destroy_model_parallel()


def _grpo_step_equals_the_model_layer(groups, weights) -> None:
    """MegatronGRPO's logits path (call_model → call_for_logits, in-place logits gradient) vs its loss on the
    model's own output layer (the logits kept, a new gradient buffer): the same gradients."""
    from mp_grpo.train.cpu_schedule import forward_backward_cpu

    micro = [prepare_micro_batch(H.make_rollouts(4, seed=11).select(slice(i, i + 2))) for i in (0, 2)]
    grads = []
    for ours in (False, True):
        model, ddp = _model(groups, weights, tied=True, main_grad=True)
        grpo = MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=H.TEMPERATURE, num_microbatches=2,
                            calculate_per_token_loss=False, groups=groups)
        batch = grpo.global_batch(micro, step=0)
        if ours:
            step_func = grpo.forward_step_func(batch, step=0)
        else:
            def step_func(data_iterator, step_model):
                mb = next(data_iterator)
                return step_model(mb.input_ids, mb.position_ids, None), lambda output: grpo.loss_func(mb, batch, output)
        forward_backward_cpu(forward_step_func=step_func, data_iterator=iter(micro), model=ddp, num_microbatches=2,
                             groups=groups)
        grads.append(_grads(model))
    for name, ref in grads[0].items():
        assert_close(grads[1][name], ref, torch.float32, msg=f"MegatronGRPO logits path, grad of {name}")


class _Head(torch.nn.Module):
    def __init__(self, output_layer: torch.nn.Module, calls: int = 1) -> None:
        super().__init__()
        self.output_layer = output_layer
        self.calls = calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.calls):
            x, _ = self.output_layer(x)
        return x


def case_unreproducible_layers_run_as_they_are() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from mp_grpo.train.cpu_model import cpu_model_config

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        groups = ParallelGroups.from_parallel_state()
        config = cpu_model_config(hidden_size=H.HIDDEN)
        x = torch.randn(3, 2, H.HIDDEN)

        def layer(**kwargs) -> ColumnParallelLinear:
            return ColumnParallelLinear(H.HIDDEN, H.VOCAB, config=config, init_method=torch.nn.init.normal_,
                                        tp_group=groups.tp, **{"bias": False, "gather_output": False, **kwargs})

        assert reproducible(layer())
        for kwargs in ({"bias": True}, {"gather_output": True}, {"disable_grad_reduce": True}):
            head = _Head(layer(**kwargs))
            assert not reproducible(head.output_layer), kwargs
            torch.testing.assert_close(call_for_logits(head, x), head(x))  # the layer's own forward ran
        plain = _Head(torch.nn.Linear(H.HIDDEN, H.VOCAB))
        plain.output_layer.forward = lambda inp: (torch.nn.functional.linear(inp, plain.output_layer.weight), None)
        assert not reproducible(plain.output_layer)
        square = ColumnParallelLinear(H.VOCAB, H.VOCAB, config=config, init_method=torch.nn.init.normal_, bias=False,
                                      gather_output=False, tp_group=groups.tp)
        twice = _Head(square, calls=2)  # multi-token prediction calls the output layer again
        with pytest.raises(RuntimeError, match="more than once"):
            call_for_logits(twice, torch.randn(3, 2, H.VOCAB))
        assert "forward" not in twice.output_layer.__dict__, "the output layer's forward was not restored"
        assert call_for_logits(torch.nn.Identity(), x) is x  # no output layer (not the last stage): as it is
    finally:
        ps.destroy_model_parallel()


# ---------------------------------------------------------------------------------------------- pytest
@pytest.mark.parametrize("tp", [1, 2])
def test_batch_major_logits_equal_the_model_layer(tp: int) -> None:
    torchrun(__file__, "case_equals_the_model_layer", nproc=tp, tp=tp)


def test_unreproducible_layers_run_as_they_are() -> None:
    torchrun(__file__, "case_unreproducible_layers_run_as_they_are", nproc=1)


if __name__ == "__main__":
    worker_main({"case_equals_the_model_layer": case_equals_the_model_layer,
                 "case_unreproducible_layers_run_as_they_are": case_unreproducible_layers_run_as_they_are})
