"""MegatronGRPO refuses misuse that would otherwise give a silently wrong gradient, and runs dynamic batching.

One process, no parallelism (``ParallelGroups()``), the CPU stand-in for GPTModel and megatron-core's own
``schedules.forward_step`` / ``backward_step`` (``forward_backward_cpu``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist

from mp_grpo.loss.global_batch import StaleGlobalBatchError
from mp_grpo.megatron import MegatronGRPO, ParallelGroups, prepare_micro_batch
from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config
from mp_grpo.train.cpu_schedule import forward_backward_cpu
from tests.megatron import helpers as H
from tests.tolerances import assert_close


@pytest.fixture(scope="module", autouse=True)
def _one_process_group(tmp_path_factory):
    """A world of one gloo rank: megatron-core's tensor-parallel layers want a TP group object."""
    if dist.is_initialized():
        yield
        return
    store = f"file://{tmp_path_factory.mktemp('dist') / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model(**config) -> CpuGPTStandIn:
    model = CpuGPTStandIn(cpu_model_config(hidden_size=H.HIDDEN, **config), vocab_size=H.VOCAB,
                          max_sequence_length=H.MAX_LEN, tp_group=dist.group.WORLD)
    model.load_full_weights(H.full_weights())
    model.no_sync = contextlib.nullcontext  # no DDP in one process: forward_backward_cpu's no_sync is a no-op
    return model


def _grpo(config_name: str = "ppo_token_tis", **kwargs) -> MegatronGRPO:
    kwargs.setdefault("calculate_per_token_loss", False)
    return MegatronGRPO(H.loss_config(config_name), temperature=H.TEMPERATURE, groups=ParallelGroups(), **kwargs)


def test_micro_batch_of_the_same_shape_from_another_step_is_rejected() -> None:
    """Fixed-length padding (as pipeline parallelism needs) gives every step the same shapes: identity decides."""
    grpo = _grpo(num_microbatches=1)
    old = prepare_micro_batch(H.make_rollouts(2, seed=1), seq_len=H.MAX_LEN)
    new = prepare_micro_batch(H.make_rollouts(2, seed=2), seq_len=H.MAX_LEN)
    assert new.loss_mask.shape == old.loss_mask.shape
    stale = grpo.global_batch([old], step=4)
    model = _model()
    with pytest.raises(StaleGlobalBatchError, match="another tensor"):
        forward_backward_cpu(forward_step_func=grpo.forward_step_func(stale, step=4), data_iterator=iter([new]),
                             model=model, num_microbatches=1, groups=grpo.groups)
    copied = dataclasses.replace(new, loss_mask=new.loss_mask.clone())
    with pytest.raises(StaleGlobalBatchError, match="another tensor"):
        grpo.loss_func(copied, stale, model(copied.input_ids, copied.position_ids))


@pytest.mark.parametrize("adapter_flag", [False, True])
def test_calculate_per_token_loss_must_agree_with_the_model_config(adapter_flag: bool) -> None:
    grpo = _grpo(num_microbatches=1, calculate_per_token_loss=adapter_flag)
    mb = prepare_micro_batch(H.make_rollouts(2, seed=3))
    batch = grpo.global_batch([mb], step=0)
    step = grpo.forward_step_func(batch, step=0)
    with pytest.raises(ValueError, match="calculate_per_token_loss"):
        step(iter([mb]), _model(calculate_per_token_loss=not adapter_flag))
    with pytest.raises(TypeError, match="calculate_per_token_loss"):
        _grpo(calculate_per_token_loss=None)


def test_schedule_arguments_and_mtp_are_refused_with_the_reason() -> None:
    grpo = _grpo(num_microbatches=1)
    mb = prepare_micro_batch(H.make_rollouts(2, seed=3))
    step = grpo.forward_step_func(grpo.global_batch([mb], step=0), step=0)
    model = _model()
    with pytest.raises(NotImplementedError, match="num_microbatches_with_partial_activation_checkpoints"):
        step(iter([mb]), model, True)
    with pytest.raises(NotImplementedError, match="overlap_moe_expert_parallel_comm"):
        step(iter([mb]), model, return_schedule_plan=True)
    output, loss_func = step(iter([mb]), model, None)  # what the schedule passes without partial checkpoints
    assert isinstance(loss_func(output)[0], torch.Tensor)
    model.config.mtp_num_layers = 1
    with pytest.raises(ValueError, match="mtp_num_layers"):
        grpo.forward_step_func(grpo.global_batch([mb], step=1), step=1)(iter([mb]), model)


@pytest.mark.parametrize("per_token", [False, True])
def test_dynamic_number_of_micro_batches(per_token: bool) -> None:
    """num_microbatches=None: each step's M comes from its GlobalBatch; every step's gradient is the reference."""
    grpo = _grpo(calculate_per_token_loss=per_token)
    solo = dist.group.WORLD
    for step, sizes in enumerate([(2,), (1, 2, 1)]):
        rollouts = H.make_rollouts(sum(sizes), seed=20 + step)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        micro = [prepare_micro_batch(rollouts.select(slice(s, s + n))) for s, n in zip(starts, sizes)]
        model = _model(calculate_per_token_loss=per_token)
        batch = grpo.global_batch(micro, step=step)
        forward_backward_cpu(forward_step_func=grpo.forward_step_func(batch, step=step), data_iterator=iter(micro),
                             model=model, num_microbatches=len(micro), groups=grpo.groups)
        grads = {n: p.grad for n, p in model.named_parameters()}
        if per_token:  # finalize_model_grads divides by the step's token count; no finalize without DDP here
            grads = {n: g / batch.valid_tokens.to(g.dtype) for n, g in grads.items()}
        _, ref = H.reference(H.loss_config("ppo_token_tis"), rollouts, H.full_weights(), solo)
        for name, g in ref.items():
            assert_close(grads[name], g, torch.float32, msg=f"step {step} M={len(micro)} grad of {name}")


def test_moe_padding_mask_with_per_token_loss_is_refused() -> None:
    """The routed-token account (mp_grpo.megatron.moe) counts every position; a padding mask would make the routers
    count fewer: refused with the reason. (The aux-scale rule itself: tests/megatron/test_moe.py.)"""
    grpo = _grpo(num_microbatches=1, calculate_per_token_loss=True)
    mb = prepare_micro_batch(H.make_rollouts(2, seed=3))
    model = _model(calculate_per_token_loss=True)
    model.config.num_moe_experts, model.config.moe_aux_loss_coeff = 4, 1e-2
    step = grpo.forward_step_func(grpo.global_batch([mb], step=0), step=0,
                                  model_kwargs={"padding_mask": torch.ones_like(mb.input_ids, dtype=torch.bool)})
    with pytest.raises(ValueError, match="padding_mask"):
        step(iter([mb]), model)


def test_routing_replay_hook() -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    grpo = _grpo(num_microbatches=1)
    routing = [torch.randint(0, 4, (10, 2)) for _ in range(2)]
    mb = prepare_micro_batch(H.make_rollouts(2, seed=3)).with_routing(routing)
    model = _model()
    step = grpo.forward_step_func(grpo.global_batch([mb], step=0), step=0)
    with pytest.raises(ValueError, match="moe_enable_routing_replay"):
        step(iter([mb]), model)
    model.config.moe_enable_routing_replay = True
    RouterReplay.clear_global_router_replay_instances()
    layers = [RouterReplay(), RouterReplay()]
    try:
        step(iter([mb]), model)
        assert all(layer.target_topk_idx is r for layer, r in zip(layers, routing))
        assert all(layer.router_replay_action == RouterReplayAction.REPLAY_FORWARD for layer in layers)
    finally:
        RouterReplay.clear_global_router_replay_instances()
    with pytest.raises(ValueError, match=r"routing\[0\]"):
        mb.with_routing([torch.zeros(3)])
