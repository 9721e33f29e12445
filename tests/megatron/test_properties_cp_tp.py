"""Property-based test of the Megatron adapter under CP = 2 × TP = 2 (4 ranks under torchrun / gloo,
tests/distributed.py, megatron-core's ``parallel_state``): random valid configs and steps (tests/loss/strategies.py)
on both loss backends, the step's rows as token-aligned :class:`~mp_grpo.megatron.Rollouts` cut into one or two
micro-batches by :func:`~mp_grpo.megatron.prepare_micro_batch` — THD (packed, each segment padded to a multiple of
2·CP and cut into Megatron's 2·CP load-balanced chunks) or padded rows —, logits drawn per token (the model's
output; megatron-core's GPTModel needs CUDA, and the adapter only reads the logits) and cut as the model's output
is: this rank's CP positions and TP vocabulary shard. Each micro-batch goes through ``MegatronGRPO.loss_func`` and
megatron-core's own ``schedules.forward_step_calc_loss`` (its ×CP / M or per-token contract), then backward;
DDP's and ``finalize_model_grads``' division (by DP·CP, or by the summed token count with
``calculate_per_token_loss``) is applied to the logits' gradients as they apply it to the parameters'.

The CP×TP ranks' gradients, gathered into the whole ``[B, W, V]`` logits (every entry held by exactly one rank),
the loss (their shares, unscaled) and the metrics reduced over DP×CP equal one call on one process
(``vocab_parallel_logprobs`` then GRPOLoss on the whole padded step; float32: 1e-5 relative to the loss's magnitude)
and the float64 reference of the logits (tests/loss/properties.py ``logits_reference``).

As in tests/loss/test_properties_cp.py every rank runs the same hypothesis test from the same seed (the same
draws), each example's verdict is agreed over the group before it is raised, and the seed is fixed under the
``ci`` profile, drawn at random otherwise and printed: rerun with ``MP_GRPO_CP_SEED=<seed>`` (and the same profile).
"""

from __future__ import annotations

import datetime
import json
import os
import random
import sys
import traceback
from functools import partial

import torch
import torch.distributed as dist

from tests.distributed import torchrun

CP = 2
TP = 2
SEED_ENV = "MP_GRPO_CP_SEED"
WEIGHT = 0.25
"""Examples relative to the profile (ci: 5, soak: 250): each runs 4 ranks of interpreted kernels."""
IGNORED_METRICS = ("cov/selected_frac", "sampling_filter/outside_tokens")
"""Metrics the one call does not report (the adapter's sampling-filter count) or that are per call."""
EPS32 = torch.finfo(torch.float32).eps
METRIC_ROUNDING = 16.0
"""Multiples of eps32 times the largest logit range a metric may differ by between the adapter and the one call."""


def test_megatron_cp_tp_matches_one_call() -> None:
    from tests.hypothesis_profiles import profile_name, torchrun_timeout

    seed = os.environ.get(SEED_ENV)
    seed = int(seed) if seed is not None else (0 if profile_name() == "ci" else random.randrange(2**32))
    print(f"Megatron CP×TP property: hypothesis seed {seed} (reproduce with {SEED_ENV}={seed})")
    torchrun(__file__, "case_megatron_cp_tp", nproc=CP * TP, timeout=torchrun_timeout(590), seed=seed)


# ----------------------------------------------------------------------------------------------- worker
_GROUPS = None
"""This rank's ParallelGroups (set by the case)."""


def _agree(problem: str | None) -> None:
    """Raise on every rank when ``problem`` is set on any."""
    failed = torch.tensor([0.0 if problem is None else 1.0])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        raise AssertionError(problem or "the example failed on another rank")


def _rollouts(step, logits_inputs: dict, tokens: torch.Tensor, lengths: torch.Tensor):
    """The step as token-aligned Rollouts: entry [b, s + 1] of every loss field is the step's logit-aligned [b, s]
    (the logit at position s predicts token s + 1; token 0 is a prompt token, never trained)."""
    from mp_grpo.megatron import Rollouts

    B, W = step.data["loss_mask"].shape

    def token_aligned(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.new_zeros(B, 1), x], dim=1)

    adv = logits_inputs["advantages"]
    return Rollouts(tokens=tokens, lengths=lengths, loss_mask=token_aligned(step.data["loss_mask"]),
                    advantages=adv if adv.dim() == 1 else token_aligned(adv),
                    **{k: token_aligned(logits_inputs[k]) if k in logits_inputs else None
                       for k in ("rollout_logprobs", "old_logprobs", "ref_logprobs")})


def _adapter_step(cfg, backend, rollouts, logits, split, temperature, per_token, vocab):
    """This rank's share of the step through MegatronGRPO and megatron-core's loss scaling: (the loss, unscaled,
    summed over this rank's micro-batches; its logits gradients scattered into the whole [B·(W+1) + 1, V] (the last
    row: padding positions, must stay 0); which entries it holds; the metric dicts)."""
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss

    from mp_grpo.loss import GRPOLoss
    from mp_grpo.megatron import MegatronGRPO, prepare_micro_batch
    from mp_grpo.train.cpu_model import cpu_model_config

    groups = _GROUPS
    B, S, V = logits.shape
    v_local = V // TP
    cols = slice(_tp_rank() * v_local, (_tp_rank() + 1) * v_local)
    micro = []
    for mb_def in split:
        rows = torch.tensor(mb_def["rows"])
        mb = prepare_micro_batch(rollouts.select(rows), sequence_format=mb_def["format"], cp_group=groups.cp)
        index = torch.arange(B * S).view(B, S)[rows]
        local_index = mb.layout.input_field(index, -1)  # this rank's positions as flat [B·S] indices, -1: padding
        local_logits = mb.layout.input_field(logits[rows], 0.0)[..., cols].contiguous()
        micro.append((mb, local_index, local_logits))
    M = len(micro)
    grpo = MegatronGRPO(cfg, temperature=temperature, calculate_per_token_loss=per_token, num_microbatches=M,
                        groups=groups, vocab_size=vocab)
    grpo.loss = GRPOLoss(cfg, backend=backend)  # the drawn backend (the adapter's AUTO takes the torch path on CPU)
    entropies = None
    if cfg.entropy.top_quantile < 1.0:  # the "old-log-prob pass" of a real step
        with torch.no_grad():
            entropies = [grpo.token_logprobs(x, mb)[1] for mb, _, x in micro]
    batch = grpo.global_batch([mb for mb, _, _ in micro], step=1, entropies=entropies)
    config = cpu_model_config(hidden_size=16, tensor_model_parallel_size=TP, context_parallel_size=CP,
                              calculate_per_token_loss=per_token)
    store: list = []
    outputs, num_tokens = [], torch.zeros((), dtype=torch.int)
    grads = torch.zeros(B * S + 1, V, dtype=torch.float64)
    held = torch.zeros(B * S + 1, V, dtype=torch.float64)
    leaves = []
    for mb, local_index, local_logits in micro:
        x = local_logits.clone().requires_grad_()
        out, n = forward_step_calc_loss(torch.nn.Module(), x, partial(grpo.loss_func, mb, batch), config, None,
                                        False, M, store, cp_group_size=CP, is_last_stage=True)
        out.backward()
        outputs.append(out.detach().double())
        num_tokens = num_tokens + n
        leaves.append((x, local_index))
    # --- DDP over DP×CP / finalize_model_grads: the division Megatron applies to every gradient ---
    if per_token:
        total = num_tokens.clone()
        dist.all_reduce(total, group=groups.dp_cp)
        divisor = float(max(int(total), 1))  # finalize_model_grads skips the division when N = 0
    else:
        divisor = float(groups.dp_cp_size)  # average over DP×CP (DP·CP)
    for x, local_index in leaves:
        flat = local_index.reshape(-1).clone()
        flat[flat < 0] = B * S
        g = x.grad.reshape(-1, v_local).double() / divisor
        grads[:, cols].index_add_(0, flat, g)
        held[:, cols].index_add_(0, flat, torch.ones_like(g))
    loss = sum(outputs) / divisor if outputs else torch.zeros((), dtype=torch.float64)
    return loss, grads, held, store


def _tp_rank() -> int:
    return dist.get_rank(_GROUPS.tp)


def megatron_cp_tp_example(data) -> None:
    """One drawn example; raises AssertionError on every rank when it fails on any. (Its name is the property's
    in the soak statistics, tests/property_stats.py.)"""
    from hypothesis import assume, event, note
    from hypothesis import strategies as st

    from mp_grpo import vocab_parallel_logprobs
    from mp_grpo.config.job import SequenceFormat
    from mp_grpo.loss import GRPOLoss, LossBackend, reduce_metrics
    from tests.loss import properties as P
    from tests.loss.strategies import loss_configs, steps

    backend = data.draw(st.sampled_from([LossBackend.TORCH, LossBackend.TRITON]))
    cfg_dict = data.draw(loss_configs("torch" if backend == LossBackend.TORCH else "triton"))
    # What the adapter does not pass: a step's adaptive entropy coefficient and positive-example flags.
    cfg_dict["entropy"] = {k: v for k, v in cfg_dict["entropy"].items() if k not in ("adaptive", "coef_min", "coef_max")}
    cfg_dict["nll"]["positive_coef"] = 0.0
    if cfg_dict["trust_region"]["mode"].startswith("topk"):  # nor the engine's top-K log-probs (docs/loss.md)
        cfg_dict["trust_region"] = {"mode": "none"}
    note(f"backend {backend.value}, config: {cfg_dict}")
    step = data.draw(steps(cfg_dict, max_rows=4, max_len=7, low_precision=False))
    note(f"step: {step!r}")
    cfg = step.cfg
    B, W = step.data["loss_mask"].shape
    vocab = 2 * data.draw(st.integers(1, 6))  # a multiple of TP
    scale = data.draw(st.sampled_from([1.0, 5.0, 30.0]))
    temperature = data.draw(st.sampled_from([1.0, 1.0, 0.7, 2.0]))
    logits_dtype = data.draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16]))
    per_token = data.draw(st.booleans())
    lengths = torch.tensor([data.draw(st.integers(step.needed_width(b) + 1, W + 1)) for b in range(B)])
    order = data.draw(st.permutations(range(B)))
    cut = data.draw(st.integers(1, B))
    formats = [SequenceFormat.PACKED, SequenceFormat.PACKED, SequenceFormat.PADDED]
    split = [{"rows": rows, "format": data.draw(st.sampled_from(formats))} for rows in (order[:cut], order[cut:]) if rows]
    note(f"vocab {vocab}, logits scale {scale} {logits_dtype}, temperature {temperature}, per-token loss {per_token}, "
         f"lengths {lengths.tolist()}, split {split}")
    event("backend", backend.value)
    event("format", "+".join(sorted({mb["format"].value for mb in split})))
    event("logits", str(logits_dtype).removeprefix("torch."))
    gen = torch.Generator().manual_seed(step.notes["seed"])
    # token-aligned logits [B, W + 1, V] (the model's output at position s predicts token s + 1) and tokens
    logits = (torch.randn(B, W + 1, vocab, generator=gen) * scale).to(logits_dtype)
    tokens = torch.randint(0, vocab, (B, W + 1), generator=gen)
    mask = step.data["loss_mask"]
    target = torch.where(mask, tokens[:, 1:], -100)
    inputs = P.inputs_around_logits(step, logits[:, :W], target, temperature, data.draw(P.logit_spreads(cfg)), gen)
    step_level = (cfg.rollout_correction.normalize_weights or cfg.mismatch.skip_threshold is not None
                  or cfg.m2po.bound is not None)
    # A step-level decision reads the old log-probs before the step (the adapter asks for them): on-policy, a real
    # step recomputes them; here the draw is left out.
    assume(not (step_level and "old_logprobs" not in inputs))
    # the trust region reads the kernel's float32 log-probs: a divergence within their rounding of δ is a knife edge
    assume(cfg.trust_region.mode.value == "none" or not P.trust_region_at_a_bound(
        cfg, vocab_parallel_logprobs(logits[:, :W], target, temperature=temperature), inputs["rollout_logprobs"], mask,
        torch.finfo(torch.float32).eps))
    ref = P.logits_reference(cfg, logits[:, :W], target, inputs, mask, temperature, 1.0)
    assume(ref.representable)

    problem = None
    try:
        # --- one call on one process: the log-prob op on the whole padded step, then GRPOLoss ---
        x1 = logits[:, :W].clone().requires_grad_()
        lp1, ent1 = vocab_parallel_logprobs(x1, target, with_entropy=True, temperature=temperature)
        loss1, metrics1 = GRPOLoss(cfg, backend=backend)(
            lp1, inputs.get("old_logprobs"), inputs["advantages"], mask, rollout_logprobs=inputs.get("rollout_logprobs"),
            ref_logprobs=inputs.get("ref_logprobs"), entropy=ent1)
        loss1.backward()
        single = reduce_metrics([metrics1])
        # --- the adapter on this rank's CP positions and TP shard ---
        rollouts = _rollouts(step, inputs, tokens, lengths)
        share, grads, held, store = _adapter_step(cfg, backend, rollouts, logits, split, temperature, per_token, vocab)
    except Exception:  # noqa: BLE001 — agreed over the group below, then raised
        problem = traceback.format_exc()
    _agree(problem)
    world = dist.group.WORLD
    dist.all_reduce(share, group=world)
    share = share / TP  # every TP rank reports the same loss
    dist.all_reduce(grads, group=world)
    dist.all_reduce(held, group=world)
    reduced = reduce_metrics(store, _GROUPS.dp_cp)
    try:
        numel = B * (W + 1)
        assert bool((grads[numel] == 0).all()), "a logits gradient at a padding position"
        assert bool((held[:numel] <= 1).all()), "a logits entry on two ranks"
        full = grads[:numel].view(B, W + 1, vocab)
        assert bool((full[:, W] == 0).all()), "a gradient at the last position (it predicts no token)"
        got = full[:, :W]
        rtol = P.RTOL_SPLIT[torch.float32]
        P.assert_loss_close(share, loss1.detach(), ref.size, torch.float32, "CP×TP adapter vs one call", rtol=rtol)
        P.assert_loss_close(share, ref.loss, ref.size, torch.float32, "CP×TP adapter vs reference")
        P.assert_grad_close(got, x1.grad, ref.grad_mask, logits_dtype, "CP×TP adapter vs one call d/dlogits",
                            rtol=max(rtol, P._rtol(logits_dtype)), atol=ref.grad_atol)
        P.assert_grad_close(got, ref.grad, ref.grad_mask, logits_dtype, "CP×TP adapter d/dlogits vs reference",
                            rtol=max(P._rtol(logits_dtype), 1e-4), atol=ref.grad_atol)
        # The two sides' log-probs and entropies are float32 results of different reductions (TP = 2 merges two
        # shards' statistics): they differ by ~eps32 · (the logits' range + |log π|), which a metric carries
        # however small it is (a near-deterministic row's entropy, 3e-4, is lse − E[z] of two ~100-size terms).
        z = logits[:, :W].double() / temperature
        rounding = METRIC_ROUNDING * EPS32 * float(((z.amax(-1) - z.amin(-1)) + z.abs().amax(-1))[mask].max()
                                                   if mask.any() else 0.0)
        scales = {k: (v, abs(v) + rounding / rtol) for k, v in single.items()}
        P.assert_metrics_close(reduced, single, torch.float32, "CP×TP adapter vs one call", rtol=rtol,
                               ignore=IGNORED_METRICS, scales=scales)
    except AssertionError:
        problem = traceback.format_exc()
    _agree(problem)


def case_megatron_cp_tp(seed: int) -> None:
    from hypothesis import given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st
    from megatron.core import parallel_state as ps

    from mp_grpo.megatron import ParallelGroups
    from tests.hypothesis_profiles import examples, load_profile

    global _GROUPS
    load_profile()
    ps.initialize_model_parallel(tensor_model_parallel_size=TP, context_parallel_size=CP)
    try:
        _GROUPS = ParallelGroups.from_parallel_state()
        # Every rank draws the same examples: the same seed, no example database, no derandomization by test name.
        runner = settings(max_examples=examples(WEIGHT), derandomize=False, database=None)(
            hypothesis_seed(seed)(given(data=st.data())(megatron_cp_tp_example)))
        runner()
    finally:
        ps.destroy_model_parallel()


if __name__ == "__main__":
    case, kwargs = sys.argv[1], json.loads(sys.argv[2])
    # A rank that fails alone must not leave its peers waiting for the default 30 minutes.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    try:
        {"case_megatron_cp_tp": case_megatron_cp_tp}[case](**kwargs)
    finally:
        dist.destroy_process_group()
