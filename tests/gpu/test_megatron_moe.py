"""Mixture of experts on GPUs: a local-spec MoE GPTModel through MegatronGRPO at EP = 2 (two GPUs) and
EP = 2 × DP = 2 (four) gives the one-GPU gradients; the routers' aux / z-loss scale rule and routing replay hold
on GPUs as on CPU (``tests/megatron/test_moe.py``).

Needs megatron-core ≥ 0.17 or Transformer Engine — 0.16's router calls TE's GEMM on CUDA, ≥ 0.17's falls back to
``torch.mm`` without TE — and skips with the reason otherwise (each case also without its GPUs)::

    PYTHONPATH=<site of megatron-core 0.19, or of TE> NCCL_NVLS_ENABLE=0 python -m pytest tests/gpu/test_megatron_moe.py -v -s

The model: megatron-core's GPTModel with the local layer spec for experts (``TopKRouter``, ``SequentialMLP``
experts), 2 layers, both MoE, hidden 64, 4 experts of FFN 128, top-2, load-balancing loss coefficient 0.1 and
z-loss coefficient 0.01 (large, so that the router losses weigh in the gradient), no biases, fp32, no dropout.
The step: 8 sequences padded to 64 positions (every micro-batch routes the same number of tokens); micro-batch i
holds rows 2i and 2i + 1, four micro-batches over the whole step. Each case is a fresh ``torchrun`` (NCCL).

1. ``case_reference`` (1 GPU, M = 4; ``test_moe_router_loss_rule_one_gpu``):
   a. the rule (``mp_grpo.megatron.moe``), for both loss contracts: the gradient with the router losses on equals
      the same step's with them off plus the float64 gradient of
      Σ_mb (T_mb / Σ T) · Σ_layers (c_aux · LB(logits) + c_z · Z(logits)), the router logits recomputed from each
      router's input (LB, Z: ``tests/reference.py``); the step's MoE metrics equal their float64 values;
   b. every variant's reference: the weights, the gradients (DDP's fp32 ``main_grad``), the loss, the MoE metrics.
2. ``case_layout``: ``ep2`` (2 GPUs: EP = 2 and DP = 2, two micro-batches per rank, each rank two experts of a
   layer) and ``ep2_dp2`` (4 GPUs: EP = 2 and DP = 4 — expert data parallelism 2 —, one micro-batch per rank):
   the same weights (local expert i on EP rank e is global expert 2e + i), logits and fused output paths. The
   gradients, the experts' gathered over EP, equal the reference's (relative L2 within the fp32 tolerance, every
   parameter), and so do the reduced loss and the MoE metrics.
3. ``case_routing_replay`` (2 GPUs, EP = 2): top-k indices recorded (a ``RouterReplay`` RECORD pass) with one set
   of router weights and replayed after the weights changed are what every router dispatches, in the training
   step and in ``forward_logprobs``; ``moe/expert_load_max`` is the replayed routing's; the replay state is
   clear after each.

Variants (``calculate_per_token_loss``, ``average_in_collective``, token dispatcher): (False, False, allgather),
(False, True, alltoall), (True, False, alltoall), (True, False, allgather). Tensor parallelism is not a layout
here: megatron-core's MoELayer refuses training at TP > 1 without sequence parallelism, which the local spec's
LayerNorm refuses (it needs Transformer Engine's layer spec).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the worker processes run this file as a script

from tests.gpu.launch import init_nccl, torchrun, worker_main  # noqa: E402

NUM_SEQUENCES = 8
MICRO_BATCH_SIZE = 2
NUM_MICROBATCHES = NUM_SEQUENCES // MICRO_BATCH_SIZE
"""Over the whole step (all DP ranks)."""
VOCAB = 512
SEQ_LEN = 64
HIDDEN = 64
FFN = 128
EXPERTS, TOPK = 4, 2
AUX_COEFF, Z_COEFF = 0.1, 0.01
TEMPERATURE = 0.8
LOSS_OVERRIDES = ["rollout_correction.weight_level=token", "rollout_correction.weight_max=2.0"]
# (calculate_per_token_loss, average_in_collective, token dispatcher)
VARIANTS = [(False, False, "allgather"), (False, True, "alltoall"), (True, False, "alltoall"), (True, False, "allgather")]
OUTPUT_PATHS = ["logits", "fused"]
LAYOUTS = {
    # name: expert-parallel size, GPUs (DP = GPUs; expert DP = GPUs / EP)
    "ep2": dict(ep=2, gpus=2),
    "ep2_dp2": dict(ep=2, gpus=4),
}
ROUTER_TORCH_FALLBACK = (0, 17)
"""megatron-core version from which the router's gating GEMM runs without Transformer Engine on CUDA (before it, the
router needs TE)."""
EXPERT_PREFIX = ".mlp.experts.local_experts."
METRIC_RTOL = 1e-5
"""MoE metrics: fp32 sums of the same routing in another order (float64 references: the router logits' rounding)."""
TINY_NORM = 1e-30
"""Floor of a reference gradient's norm in the relative error."""
MIN_ROUTER_SHARE = 0.05
"""The router losses' value in the rule check must be at least this, so that their gradient is visible."""


def _megatron_core_version() -> tuple[int, int] | None:
    try:
        from mp_grpo.megatron.moe import megatron_core_version
    except ImportError:
        return None
    try:
        return megatron_core_version()
    except ImportError:
        return None


def _skip_reason(gpus: int) -> str | None:
    version = _megatron_core_version()
    if version is None:
        return "needs megatron-core"
    from mp_grpo.megatron.gpt import have_transformer_engine

    if version < ROUTER_TORCH_FALLBACK and not have_transformer_engine():
        return (f"megatron-core {version[0]}.{version[1]} without Transformer Engine: its MoE router runs TE's GEMM on "
                "CUDA (te_general_gemm), and transformer_engine does not import; ≥ 0.17 falls back to torch.mm — put "
                "TE or megatron-core ≥ 0.17 on PYTHONPATH")
    if not torch.cuda.is_available() or torch.cuda.device_count() < gpus:
        return f"needs {gpus} CUDA GPUs"
    return None


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    reason = _skip_reason(1)
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("moe_reference")
    print(torchrun(__file__, "case_reference", 1, out_dir=str(out)))
    return out


@pytest.mark.gpu
def test_moe_router_loss_rule_one_gpu(reference_dir: Path) -> None:
    """``case_reference`` on one GPU: the router losses' scale rule against its float64 gradient, every variant's
    reference saved (the fixture runs it; a failure fails here)."""
    assert (reference_dir / "weights.pt").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_moe_layout_equals_one_gpu(layout: str, reference_dir: Path) -> None:
    reason = _skip_reason(LAYOUTS[layout]["gpus"])
    if reason:
        pytest.skip(f"{layout}: {reason}")
    print(torchrun(__file__, "case_layout", LAYOUTS[layout]["gpus"], out_dir=str(reference_dir), layout=layout))


@pytest.mark.gpu
def test_moe_routing_replay_reaches_the_routers() -> None:
    reason = _skip_reason(2)
    if reason:
        pytest.skip(reason)
    print(torchrun(__file__, "case_routing_replay", 2))


# ------------------------------------------------------------------------------------------------ workers
def _rollouts():
    from mp_grpo.config.job import RolloutConfig
    from mp_grpo.megatron.rollouts import Rollouts
    from mp_grpo.train.synthetic import synthesize_rollouts

    cfg = RolloutConfig(group_size=4, prompt_min_length=4, prompt_max_length=12, completion_min_length=4,
                        completion_max_length=40, tool_mask_fraction=0.2, mismatch_std=0.1)
    r = synthesize_rollouts(cfg, num_sequences=NUM_SEQUENCES, vocab_size=VOCAB, seed=3).rollouts
    gen = torch.Generator().manual_seed(4)
    rollout = -torch.rand(r.tokens.shape, generator=gen) * 6.0 - 2.0  # independent of the model: weights ≠ 1
    return Rollouts(tokens=r.tokens, lengths=r.lengths, loss_mask=r.loss_mask, advantages=r.advantages,
                    rollout_logprobs=rollout)


def _micro_batches(indices) -> list:
    """The micro-batches of the given global indices (micro-batch i: rows 2i, 2i + 1), padded to SEQ_LEN, on the GPU."""
    from mp_grpo.megatron import prepare_micro_batch

    rollouts = _rollouts()
    return [prepare_micro_batch(rollouts.select(slice(i * MICRO_BATCH_SIZE, (i + 1) * MICRO_BATCH_SIZE)),
                                seq_len=SEQ_LEN).to("cuda") for i in indices]


def _this_ranks_micro_batches() -> list:
    from megatron.core import parallel_state as ps

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    m = NUM_MICROBATCHES // dp
    return _micro_batches(range(rank * m, (rank + 1) * m))


def _config(per_token: bool, dispatcher: str, *, router_losses: bool = True, replay: bool = False):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN,
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=FFN,
        moe_aux_loss_coeff=AUX_COEFF if router_losses else 0.0, moe_z_loss_coeff=Z_COEFF if router_losses else None,
        moe_token_dispatcher_type=dispatcher, moe_enable_routing_replay=replay,
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(), calculate_per_token_loss=per_token,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32,
    )


def _build(per_token: bool, avg: bool, dispatcher: str, *, router_losses: bool = True, replay: bool = False):
    """DDP-wrapped MoE GPTModel on this GPU (megatron-core's hooks set) and the GPTModel itself."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    config = _config(per_token, dispatcher, router_losses=router_losses, replay=replay)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False),
                   vocab_size=VOCAB, max_sequence_length=SEQ_LEN, parallel_output=True,
                   share_embeddings_and_output_weights=False, position_embedding_type="learned_absolute").cuda()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, average_in_collective=avg), gpt)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return ddp, gpt


def _global_name(local: str, ep_rank: int | None = None) -> str:
    """A parameter's name in the one-GPU model: local expert i of EP rank e is global expert e · (E / EP) + i."""
    from megatron.core import parallel_state as ps

    if EXPERT_PREFIX not in local:
        return local
    head, tail = local.split(EXPERT_PREFIX)
    index, rest = tail.split(".", 1)
    ep_rank = ps.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
    per_rank = EXPERTS // ps.get_expert_model_parallel_world_size()
    return f"{head}{EXPERT_PREFIX}{ep_rank * per_rank + int(index)}.{rest}"


def _load(gpt: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for local, p in gpt.named_parameters():
            p.copy_(weights[_global_name(local)].to(p.device))


def _full_grads(gpt: torch.nn.Module) -> dict[str, torch.Tensor]:
    """DDP's fp32 ``main_grad`` by global name; the experts' gathered over the EP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size()
    out = {}
    for local, p in gpt.named_parameters():
        g = p.main_grad.float().contiguous()
        if EXPERT_PREFIX in local and ep > 1:
            parts = [torch.empty_like(g) for _ in range(ep)]
            dist.all_gather(parts, g, group=ps.get_expert_model_parallel_group())
            out.update({_global_name(local, e): part.cpu() for e, part in enumerate(parts)})
        else:
            out[local] = g.cpu()
    return out


def _step(per_token: bool, avg: bool, dispatcher: str, output_path: str, weights, *, router_losses: bool = True):
    """One ``forward_backward_func`` over this rank's micro-batches through MegatronGRPO; (DDP, GPTModel, metrics,
    micro-batches)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mp_grpo.config import load_config
    from mp_grpo.config.job import OutputPath
    from mp_grpo.megatron import MegatronGRPO

    ddp, gpt = _build(per_token, avg, dispatcher, router_losses=router_losses)
    _load(gpt, weights)
    micro = _this_ranks_micro_batches()
    grpo = MegatronGRPO(load_config(None, LOSS_OVERRIDES), temperature=TEMPERATURE, num_microbatches=len(micro),
                        calculate_per_token_loss=per_token, output_path=OutputPath(output_path))
    batch = grpo.global_batch(micro, step=0)
    ddp.zero_grad_buffer()
    losses = get_forward_backward_func()(
        forward_step_func=grpo.forward_step_func(batch, step=0), data_iterator=iter(micro), model=ddp,
        num_microbatches=len(micro), seq_length=SEQ_LEN, micro_batch_size=MICRO_BATCH_SIZE, forward_only=False)
    return ddp, gpt, grpo.reduce_metrics(losses), micro


def _routers(gpt: torch.nn.Module) -> list[torch.nn.Module]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in gpt.modules() if isinstance(m, TopKRouter)]


def _add_router_loss_gradient(gpt: torch.nn.Module, micro: list) -> tuple[float, dict[str, float]]:
    """The rule's router term Σ_mb (T_mb / Σ T) Σ_layers (c_aux · LB + c_z · Z) in float64 from each router's input,
    its gradient added into DDP's ``main_grad`` (its hooks add ``.grad``); returns the term's value and the step's
    MoE metrics from the same logits (``MoEStats``' definitions)."""
    from tests.reference import router_z_loss_reference, switch_load_balancing_reference

    routers = _routers(gpt)
    index = {id(r): k for k, r in enumerate(routers)}
    seen: list[tuple[int, torch.Tensor]] = []
    handles = [r.register_forward_hook(lambda module, args, output: seen.append((index[id(module)], args[0])))
               for r in routers]
    total = sum(mb.input_ids.numel() for mb in micro)
    term = torch.zeros((), dtype=torch.float64)
    logits_by_layer: list[list[torch.Tensor]] = [[] for _ in routers]
    for mb in micro:
        seen.clear()
        gpt(mb.input_ids, mb.position_ids, None)  # the output is not used: only the router term has a gradient
        assert sorted(k for k, _ in seen) == list(range(len(routers))), "every router must run once per forward"
        for k, hidden in seen:
            logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]).double(),
                                                routers[k].weight.double()).cpu()
            term = term + logits.shape[0] / total * (AUX_COEFF * switch_load_balancing_reference(logits, TOPK)
                                                     + Z_COEFF * router_z_loss_reference(logits))
            logits_by_layer[k].append(logits.detach())
    for h in handles:
        h.remove()
    term.backward()
    step = [torch.cat(lg) for lg in logits_by_layer]
    loads = torch.stack([torch.bincount(lg.topk(TOPK, dim=-1).indices.reshape(-1), minlength=EXPERTS).double()
                         for lg in step])
    relative = loads / loads.mean(-1, keepdim=True)
    metrics = {
        "moe/load_balancing_loss": float(torch.stack([switch_load_balancing_reference(lg, TOPK) for lg in step]).mean()),
        "moe/z_loss": float(torch.stack([router_z_loss_reference(lg) for lg in step]).mean()),
        "moe/expert_load_max": float(relative.max()),
        "moe/expert_load_min": float(relative.min()),
        "moe/expert_load_cv": float((loads.std(-1, unbiased=False) / loads.mean(-1)).mean()),
    }
    return float(term.detach()), metrics


def _relative_errors(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    assert set(grads) == set(ref), f"parameters differ: {sorted(set(grads) ^ set(ref))}"
    return {n: float((g - ref[n]).norm() / ref[n].norm().clamp(min=TINY_NORM)) for n, g in grads.items()}


def _moe_metrics(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("moe/")}


def _metric_failures(metrics: dict[str, float], ref: dict[str, float], where: str) -> list[str]:
    if set(metrics) != set(ref):
        return [f"MoE metrics {sorted(metrics)} vs reference {sorted(ref)} [{where}]"]
    return [f"{k}: {metrics[k]:.8g} vs reference {ref[k]:.8g} [{where}]" for k in ref
            if not math.isclose(metrics[k], ref[k], rel_tol=METRIC_RTOL, abs_tol=METRIC_RTOL)]


def case_reference(out_dir: str) -> None:
    from megatron.core import parallel_state as ps

    from tests.tolerances import tolerance

    init_nccl()
    ps.initialize_model_parallel()
    out = Path(out_dir)
    rtol = tolerance(torch.float32)["rtol"]
    _, gpt = _build(False, False, "allgather")
    weights = {n: p.detach().float().cpu().clone() for n, p in gpt.named_parameters()}
    torch.save(weights, out / "weights.pt")
    failures = []
    # --- a. the rule: router losses on = off + the float64 router term, both contracts ---
    for per_token in (False, True):
        _, on, metrics_on, _ = _step(per_token, False, "allgather", "logits", weights)
        grads_on = _full_grads(on)
        _, off, _, micro = _step(per_token, False, "allgather", "logits", weights, router_losses=False)
        term, expected_metrics = _add_router_loss_gradient(off, micro)
        assert term > MIN_ROUTER_SHARE, f"the router losses must weigh in the gradient, got {term}"
        errors = _relative_errors(grads_on, _full_grads(off))
        where = f"rule, per_token={per_token}"
        failures += [f"grad {n}: relative L2 error {e:.2e} > {rtol:.1e} [{where}]" for n, e in errors.items()
                     if not e <= rtol]
        failures += _metric_failures(_moe_metrics(metrics_on), expected_metrics, where)
        worst = max(errors, key=errors.get)
        print(f"{where}: router term {term:.4f}; worst relative L2 error {errors[worst]:.2e} ({worst}); "
              f"router weight {max(v for n, v in errors.items() if '.router.' in n):.2e}")
    # --- b. every variant's reference (M = 4 on one GPU) ---
    for per_token, avg, dispatcher in VARIANTS:
        _, gpt, metrics, _ = _step(per_token, avg, dispatcher, "logits", weights)
        torch.save({"grads": _full_grads(gpt), "loss": metrics["loss"], "moe": _moe_metrics(metrics)},
                   out / f"ref_{per_token}_{avg}_{dispatcher}.pt")
        print(f"reference per_token={per_token} avg={avg} {dispatcher}: loss {metrics['loss']:.6f}, "
              f"{json.dumps({k: round(v, 6) for k, v in _moe_metrics(metrics).items()})}")
    ps.destroy_model_parallel()
    assert not failures, "\n".join(failures)


def case_layout(out_dir: str, layout: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from tests.tolerances import tolerance

    init_nccl()
    ps.initialize_model_parallel(expert_model_parallel_size=LAYOUTS[layout]["ep"])
    out = Path(out_dir)
    weights = torch.load(out / "weights.pt")
    rtol = tolerance(torch.float32)["rtol"]
    failures = []
    for output_path in OUTPUT_PATHS:
        for per_token, avg, dispatcher in VARIANTS:
            ref = torch.load(out / f"ref_{per_token}_{avg}_{dispatcher}.pt")
            _, gpt, metrics, _ = _step(per_token, avg, dispatcher, output_path, weights)
            where = (f"{layout} (EP = {ps.get_expert_model_parallel_world_size()}, DP = "
                     f"{ps.get_data_parallel_world_size()}) {output_path} per_token={per_token} avg={avg} {dispatcher}")
            errors = _relative_errors(_full_grads(gpt), ref["grads"])
            failures += [f"grad {n}: relative L2 error {e:.2e} > {rtol:.1e} [{where}]" for n, e in errors.items()
                         if not e <= rtol]
            if not abs(metrics["loss"] - ref["loss"]) <= rtol * abs(ref["loss"]):
                failures.append(f"loss {metrics['loss']:.6f} vs reference {ref['loss']:.6f} [{where}]")
            failures += _metric_failures(_moe_metrics(metrics), ref["moe"], where)
            if dist.get_rank() == 0:
                worst = max(errors, key=errors.get)
                experts = max(e for n, e in errors.items() if EXPERT_PREFIX in n)
                print(f"{where}: loss {metrics['loss']:.6f} (reference {ref['loss']:.6f}); worst relative L2 error "
                      f"{errors[worst]:.2e} ({worst}), experts {experts:.2e}")
    ps.destroy_model_parallel()
    assert not failures, "\n".join(failures)


def case_routing_replay() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from mp_grpo.config import load_config
    from mp_grpo.megatron import MegatronGRPO
    from mp_grpo.megatron.forward_only import forward_logprobs

    init_nccl()
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    RouterReplay.clear_global_router_replay_instances()
    try:
        ddp, gpt = _build(False, False, "alltoall", replay=True)
        layers = list(RouterReplay.global_router_replay_instances)
        assert len(layers) == 2, f"one RouterReplay per MoE layer, got {len(layers)}"
        (mb,) = _micro_batches([ps.get_data_parallel_rank()])

        def cleared() -> bool:
            return all(r.target_topk_idx is None and r.router_replay_action is None and not r.replay_backward_list
                       for r in layers)

        # --- record the routing of the current weights ---
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
        with torch.no_grad():
            gpt(mb.input_ids, mb.position_ids, None)
        recorded = [r.clone() for r in RouterReplay.get_recorded_data()]
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
        # --- other router weights: without replay the routing changes ---
        routers = _routers(gpt)
        gen = torch.Generator().manual_seed(5)  # the same on every rank: the routers are replicated over DP
        with torch.no_grad():
            for r in routers:
                r.weight.copy_(torch.randn(r.weight.shape, generator=gen).to(r.weight.device))
        maps: dict[int, torch.Tensor] = {}
        for k, r in enumerate(routers):
            r.register_forward_hook(lambda module, args, output, k=k: maps.__setitem__(k, output[1].clone()))
        with torch.no_grad():
            gpt(mb.input_ids, mb.position_ids, None)
        expected = [torch.zeros_like(maps[k]).scatter(1, recorded[k].to(maps[k].device), True) for k in range(len(routers))]
        assert any(not torch.equal(maps[k], expected[k]) for k in maps), \
            "the new router weights must route differently for the test to see replay"
        # --- the training step replays ---
        replayed = mb.with_routing(recorded)
        grpo = MegatronGRPO(load_config(None, LOSS_OVERRIDES), temperature=TEMPERATURE, num_microbatches=1,
                            calculate_per_token_loss=False)
        batch = grpo.global_batch([replayed], step=0)
        maps.clear()
        ddp.zero_grad_buffer()
        losses = get_forward_backward_func()(
            forward_step_func=grpo.forward_step_func(batch, step=0), data_iterator=iter([replayed]), model=ddp,
            num_microbatches=1, seq_length=SEQ_LEN, micro_batch_size=MICRO_BATCH_SIZE, forward_only=False)
        for k in range(len(routers)):
            assert torch.equal(maps[k], expected[k]), f"the training step did not dispatch the recorded routing (layer {k})"
        metrics = grpo.reduce_metrics(losses)
        load = torch.stack([e.sum(0) for e in expected]).double()
        dist.all_reduce(load, group=ps.get_data_parallel_group())  # the step's load: every DP rank's tokens
        want = float((load / load.mean(-1, keepdim=True)).max())
        assert math.isclose(metrics["moe/expert_load_max"], want, rel_tol=1e-9), (metrics["moe/expert_load_max"], want)
        assert cleared(), "the replay state must be clear after reduce_metrics"
        # --- the forward-only pass replays too ---
        maps.clear()
        forward_logprobs(grpo, get_forward_backward_func(), ddp, [replayed], seq_length=SEQ_LEN,
                         micro_batch_size=MICRO_BATCH_SIZE)
        for k in range(len(routers)):
            assert torch.equal(maps[k], expected[k]), f"forward_logprobs did not dispatch the recorded routing (layer {k})"
        assert cleared(), "the replay state must be clear after forward_logprobs"
        if dist.get_rank() == 0:
            print(f"routing replay at EP = 2: {len(layers)} layers, {expected[0].shape[0]} tokens a rank, recorded routing "
                  f"dispatched in the training step and in forward_logprobs; expert_load_max {want:.4f}")
    finally:
        RouterReplay.clear_global_router_replay_instances()
        ps.destroy_model_parallel()


if __name__ == "__main__":
    worker_main({"case_reference": case_reference, "case_layout": case_layout,
                 "case_routing_replay": case_routing_replay})
