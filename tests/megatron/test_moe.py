"""Mixture of experts through MegatronGRPO: the aux / z-loss scale rule, the step's MoE metrics, routing replay.

Each case runs under torchrun (gloo) with megatron-core's real ``parallel_state``, its ``MoELayer`` (local
spec: ``TopKRouter``, ``SequentialMLP`` experts, allgather dispatcher; aux loss and z-loss on) inside the CPU
stand-in model, ``schedules.forward_step`` / ``backward_step`` and ``finalize_model_grads``
(``mp_grpo/train/cpu_schedule.py``). The reference is layout-free, float64 for the router losses:

    J + Σ_mb (T_mb / Σ T) · (c_aux · LB(logits_mb) + c_z · Z(logits_mb))

(J: the GRPO objective of the whole batch in one call; T_mb: the micro-batch's routed positions; LB, Z:
``tests/reference.py``) — the rule of ``mp_grpo.megatron.moe``. Every layout (M = 4 on one rank, DP = 2,
CP = 2), both loss contracts and padded / packed micro-batches must give its gradient, so the aux scale does
not depend on the split or on the trained-token count. Without the rule (``num_tokens`` = trained tokens),
the per-token contract's aux gradient is larger by (routed / trained tokens) and the test fails.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from mp_grpo.config.job import SequenceFormat
from mp_grpo.megatron import MegatronGRPO, ParallelGroups, prepare_micro_batch
from tests.distributed import torchrun, worker_main
from tests.megatron import helpers as H
from tests.reference import router_z_loss_reference, switch_load_balancing_reference
from tests.tolerances import assert_close

EXPERTS, TOPK = 4, 2
AUX_COEFF, Z_COEFF = 0.1, 0.01  # large, so that the router losses' share of the gradient is visible
NUM_MICROBATCHES = 4  # over the whole step (all DP ranks)
MICRO_BATCH_SIZE = 2
STEP = 2


def _config(per_token: bool, *, aux: bool = True, cp: int = 1, replay: bool = False):
    from mp_grpo.train.cpu_model import cpu_model_config

    return cpu_model_config(hidden_size=H.HIDDEN, context_parallel_size=cp, calculate_per_token_loss=per_token,
                            num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_aux_loss_coeff=AUX_COEFF if aux else 0.0,
                            moe_z_loss_coeff=Z_COEFF if aux else None, moe_enable_routing_replay=replay)


def _weights():
    from mp_grpo.train.cpu_model import random_full_weights

    return random_full_weights(_config(False), vocab_size=H.VOCAB, max_sequence_length=H.MAX_LEN, seed=7)


def _model(config, solo_tp):
    from mp_grpo.train.cpu_model import CpuGPTStandIn

    model = CpuGPTStandIn(config, vocab_size=H.VOCAB, max_sequence_length=H.MAX_LEN, tp_group=solo_tp)
    model.load_full_weights(_weights())
    return model


def _micro_batch(rollouts, i: int, fmt: str, cp_group=None):
    rows = rollouts.select(slice(i * MICRO_BATCH_SIZE, (i + 1) * MICRO_BATCH_SIZE))
    seq_len = H.MAX_LEN if fmt == "padded" else None  # padded: every micro-batch routes the same number of tokens
    return prepare_micro_batch(rows, sequence_format=SequenceFormat(fmt), cp_group=cp_group, seq_len=seq_len)


def _router_inputs(model):
    """Capture the router's input of every forward (the hidden states, on the autograd graph)."""
    seen: list[torch.Tensor] = []
    handle = model.moe.router.register_forward_hook(lambda module, args, output: seen.append(args[0]))
    return seen, handle


def _reference(rollouts, fmt: str, solo_tp):
    """(∇ of the rule's objective by parameter, the step's MoE metrics), on one process, float64 router losses."""
    from mp_grpo.loss.grpo_loss import GRPOLoss
    from mp_grpo.ops import vocab_parallel_logprobs

    model = _model(_config(False, aux=False), solo_tp)  # Megatron's own router losses off: the reference adds them
    config = H.loss_config("ppo_token_tis")
    whole = prepare_micro_batch(rollouts)
    logprobs, entropy = vocab_parallel_logprobs(model(whole.input_ids, whole.position_ids), whole.targets,
                                                temperature=H.TEMPERATURE, with_entropy=True)
    objective, _ = GRPOLoss(config)(logprobs, whole.old_logprobs, whole.advantages, whole.loss_mask,
                                    rollout_logprobs=whole.rollout_logprobs, ref_logprobs=whole.ref_logprobs,
                                    entropy=entropy, layout=whole.sequences)
    seen, handle = _router_inputs(model)
    weight = model.moe.router.weight
    logits = []
    for i in range(NUM_MICROBATCHES):
        mb = _micro_batch(rollouts, i, fmt)
        model(mb.input_ids, mb.position_ids)
        hidden = seen[-1]
        logits.append(torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]).double(), weight.double()))
    handle.remove()
    routed = [lg.shape[0] for lg in logits]
    router = sum(t / sum(routed) * (AUX_COEFF * switch_load_balancing_reference(lg, TOPK) + Z_COEFF * router_z_loss_reference(lg))
                 for t, lg in zip(routed, logits))
    (objective.double() + router).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    # the step's metrics: every routed token of the step at once
    step_logits = torch.cat(logits).detach()
    chosen = step_logits.topk(TOPK, dim=-1).indices.reshape(-1)
    load = torch.bincount(chosen, minlength=EXPERTS).double()
    relative = load / load.mean()
    metrics = {
        "moe/load_balancing_loss": float(switch_load_balancing_reference(step_logits, TOPK)),
        "moe/z_loss": float(router_z_loss_reference(step_logits)),
        "moe/expert_load_max": float(relative.max()),
        "moe/expert_load_min": float(relative.min()),
        "moe/expert_load_cv": float(load.std(unbiased=False) / load.mean()),
    }
    return grads, metrics, float(router.detach())


def _run(groups, rollouts, fmt: str, per_token: bool, *, rule: bool = True):
    """One step of this rank's micro-batches through megatron-core's schedule functions; (metrics, grads)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

    from mp_grpo.train.cpu_ddp import CpuDistributedDataParallel
    from mp_grpo.train.cpu_schedule import forward_backward_cpu

    config = _config(per_token, cp=groups.cp_size)
    config.finalize_model_grads_func = finalize_model_grads
    model = _model(config, groups.tp)
    ddp = CpuDistributedDataParallel(config, DistributedDataParallelConfig(), model, dp_cp_group=groups.dp_cp)
    m = NUM_MICROBATCHES // groups.dp_size
    first = ps.get_data_parallel_rank() * m
    micro = [_micro_batch(rollouts, first + i, fmt, cp_group=groups.cp) for i in range(m)]
    grpo = MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=H.TEMPERATURE, num_microbatches=m,
                        calculate_per_token_loss=per_token, groups=groups)
    batch = grpo.global_batch(micro, step=STEP)
    step = grpo.forward_step_func(batch, step=STEP)
    if not rule:  # what the adapter did before the rule: report the trained tokens
        def step(data_iterator, model, _inner=step):
            output, loss_func = _inner(data_iterator, model)
            loss_func.keywords["routed"] = None
            return output, loss_func
    losses = forward_backward_cpu(forward_step_func=step, data_iterator=iter(micro), model=ddp,
                                  num_microbatches=m, groups=groups)
    return grpo.reduce_metrics(losses), H.full_grads(model)


# ---------------------------------------------------------------------------------------------- workers
def case_rule(cp: int) -> None:
    """The rule's gradient and the step's MoE metrics in this layout (DP = world / cp), both contracts."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(context_parallel_size=cp)
    try:
        groups = ParallelGroups.from_parallel_state()
        solo = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
        rollouts = H.make_rollouts(NUM_MICROBATCHES * MICRO_BATCH_SIZE, seed=31)
        formats = ["padded"] if cp > 1 else ["padded", "packed"]  # packed + CP pads segments: other routed tokens
        for fmt in formats:
            ref_grads, ref_metrics, router_loss = _reference(rollouts, fmt, solo)
            assert router_loss > 0.05, f"the router losses must weigh in the gradient, got {router_loss}"
            contracts = [True, False] if fmt == "padded" else [True]  # False: Megatron's 1/(M·DP), equal sizes only
            for per_token in contracts:
                where = f"[{fmt}, per_token={per_token}, cp={cp}, dp={groups.dp_size}]"
                metrics, grads = _run(groups, rollouts, fmt, per_token)
                for name, g in ref_grads.items():
                    assert_close(grads[name], g, torch.float32, msg=f"grad of {name} {where}")
                for key, value in ref_metrics.items():
                    assert math.isclose(metrics[key], value, rel_tol=1e-5, abs_tol=1e-6), f"{key}: {metrics[key]} vs {value} {where}"
    finally:
        ps.destroy_model_parallel()


def case_without_rule() -> None:
    """Control: reporting the trained tokens (the adapter before the rule) misses the reference's router gradient."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    try:
        groups = ParallelGroups.from_parallel_state()
        rollouts = H.make_rollouts(NUM_MICROBATCHES * MICRO_BATCH_SIZE, seed=31)
        ref_grads, _, _ = _reference(rollouts, "padded", groups.tp)
        _, grads = _run(groups, rollouts, "padded", True, rule=False)
        ref, got = ref_grads["moe.router.weight"], grads["moe.router.weight"]
        print(f"without the rule: router weight gradient rel. L2 error {float((got - ref).norm() / ref.norm()):.3f}")
        with pytest.raises(AssertionError):
            assert_close(grads["moe.router.weight"], ref_grads["moe.router.weight"], torch.float32)
        _, grads = _run(groups, rollouts, "padded", True)
        assert_close(grads["moe.router.weight"], ref_grads["moe.router.weight"], torch.float32)
    finally:
        ps.destroy_model_parallel()


def case_routing_replay() -> None:
    """Recorded top-k indices (a RECORD pass) replayed in the training step and in forward_logprobs: the routers
    dispatch exactly them although the router weights changed; the replay state is cleared after each."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from mp_grpo.megatron.forward_only import forward_logprobs
    from mp_grpo.train.cpu_schedule import forward_backward_cpu

    ps.initialize_model_parallel()
    RouterReplay.clear_global_router_replay_instances()
    try:
        groups = ParallelGroups.from_parallel_state()
        rollouts = H.make_rollouts(MICRO_BATCH_SIZE, seed=41)
        mb = _micro_batch(rollouts, 0, "packed")
        model = _model(_config(False, replay=True), groups.tp)
        (layer,) = RouterReplay.global_router_replay_instances
        # --- record the routing of the current weights ---
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
        with torch.no_grad():
            model(mb.input_ids, mb.position_ids)
        recorded = [r.clone() for r in RouterReplay.get_recorded_data()]
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
        # --- other router weights: without replay the routing changes ---
        with torch.no_grad():
            model.moe.router.weight.copy_(torch.randn(model.moe.router.weight.shape, generator=torch.Generator().manual_seed(5)))
        maps: list[torch.Tensor] = []
        model.moe.router.register_forward_hook(lambda module, args, output: maps.append(output[1].clone()))
        with torch.no_grad():
            model(mb.input_ids, mb.position_ids)
        expected = torch.zeros_like(maps[-1]).scatter(1, recorded[0], True)
        assert not torch.equal(maps[-1], expected), "the new weights must route differently for the test to see replay"
        # --- the training step replays ---
        replayed = mb.with_routing(recorded)
        grpo = MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=H.TEMPERATURE, num_microbatches=1,
                            calculate_per_token_loss=False, groups=groups)
        batch = grpo.global_batch([replayed], step=0)
        model.no_sync = lambda: torch.enable_grad()  # one process, no DDP: the schedule's no_sync is a no-op
        losses = forward_backward_cpu(forward_step_func=grpo.forward_step_func(batch, step=0),
                                      data_iterator=iter([replayed]), model=model, num_microbatches=1, groups=groups)
        assert torch.equal(maps[-1], expected), "the training step did not dispatch the recorded routing"
        metrics = grpo.reduce_metrics(losses)
        load = expected.sum(0).double()
        assert math.isclose(metrics["moe/expert_load_max"], float((load / load.mean()).max()), rel_tol=1e-9)
        assert layer.target_topk_idx is None and layer.router_replay_action is None and not layer.replay_backward_list
        # --- the forward-only pass replays too ---
        forward_logprobs(grpo, _cpu_forward_backward(groups), model, [replayed])
        assert torch.equal(maps[-1], expected), "forward_logprobs did not dispatch the recorded routing"
        assert layer.target_topk_idx is None and layer.router_replay_action is None
    finally:
        RouterReplay.clear_global_router_replay_instances()
        ps.destroy_model_parallel()


def _cpu_forward_backward(groups):
    from mp_grpo.train.cpu_schedule import forward_backward_cpu

    def run(*, forward_step_func, data_iterator, model, num_microbatches, forward_only, **_):
        return forward_backward_cpu(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                                    num_microbatches=num_microbatches, groups=groups, forward_only=forward_only)

    return run


# ---------------------------------------------------------------------------------------------- pytest
@pytest.mark.parametrize("nproc,cp", [(1, 1), (2, 1), (2, 2)], ids=["m4", "dp2", "cp2"])
def test_router_losses_follow_the_rule_in_every_layout(nproc: int, cp: int) -> None:
    torchrun(__file__, "case_rule", nproc=nproc, cp=cp)


def test_trained_token_count_misses_the_rule() -> None:
    torchrun(__file__, "case_without_rule", nproc=1)


def test_routing_replay_reaches_the_routers() -> None:
    torchrun(__file__, "case_routing_replay", nproc=1)


def test_moe_config_checks() -> None:
    """Per-token loss + MoE: the combinations the rule cannot cover are refused with the reason."""
    from types import SimpleNamespace

    from mp_grpo.megatron.moe import check_moe_config

    config = SimpleNamespace(num_moe_experts=4, sequence_parallel=False, moe_router_load_balancing_type="aux_loss",
                             moe_aux_loss_coeff=0.1, moe_grad_scale_func=None)
    check_moe_config(config, ParallelGroups(), calculate_per_token_loss=True)
    config.moe_grad_scale_func = lambda: torch.ones(1)
    with pytest.raises(ValueError, match="moe_grad_scale_func"):
        check_moe_config(config, ParallelGroups(), calculate_per_token_loss=True)
    check_moe_config(config, ParallelGroups(), calculate_per_token_loss=False)  # no account: nothing to conflict
    config.moe_grad_scale_func = None
    config.moe_router_load_balancing_type, config.moe_aux_loss_coeff = ["aux_loss", "seq_aux_loss"], [0.1, 0.1]
    from mp_grpo.megatron.moe import ROUTER_COUNTS_WHOLE_MICRO_BATCH, megatron_core_version

    if megatron_core_version() < ROUTER_COUNTS_WHOLE_MICRO_BATCH:
        with pytest.raises(ValueError, match="seq_aux_loss"):
            check_moe_config(config, ParallelGroups(), calculate_per_token_loss=True)


if __name__ == "__main__":
    worker_main({"case_rule": case_rule, "case_without_rule": case_without_rule, "case_routing_replay": case_routing_replay})
