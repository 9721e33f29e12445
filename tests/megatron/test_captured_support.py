"""The rollout engine's captured support and top-K ids through MegatronGRPO (``MicroBatch.with_captured_support``,
``with_rollout_top_k``): the per-token CSR moved to the logit that predicts each token, laid out and cut by context
parallelism as every token field, and the step's loss and gradients over the support.

On one process: each local position's ids (and the engine's top-K log-probs) are those of the token it predicts,
padded and packed — checked against ``TokenLayout.target_field`` of the same lists as a dense ``[B, S, V]`` field.
Under torchrun, CP = 2 (gloo, megatron-core's ``parallel_state``, the CPU stand-in for GPTModel): the same on each
CP rank's positions; one step through ``forward_step`` / ``backward_step`` with the support, logits and fused output
paths, equal to the one-process loss and gradients of the whole batch over the support; the trainer's log-probs at
the engine's top-K ids as ``loss_func`` takes them, against the float64 log-softmax over each position's support.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import pytest
import torch

from mp_grpo.config import load_config
from mp_grpo.ops.token_ids import TokenIds
from tests.distributed import torchrun, worker_main
from tests.megatron import helpers as H
from tests.tolerances import assert_close

TOP_K = 3
TOP_K_TRUST_REGION = ["trust_region.mode=topk_tv", "trust_region.direction=symmetric", "trust_region.delta_high=0.2"]
"""The loss's top-K TV trust region: what reads the trainer's log-probs at the engine's top-K ids."""


def top_k_config(name: str):
    """The helpers' loss config ``name`` with the top-K TV trust region."""
    return load_config(None, H.LOSS_CONFIGS[name] + TOP_K_TRUST_REGION)


def engine_lists(rollouts, seed: int = 0):
    """Per rollout token (row-major over [B, S]): a support holding the token (empty outside its sequence and for a
    few tokens), its top-K ids (the support's first K; for a token without a support K ids of the whole vocabulary,
    the token among them; none outside its sequence) and made-up engine log-probs at them."""
    from mp_grpo import CapturedSupport, TokenIds

    gen = torch.Generator().manual_seed(seed)
    b, s = rollouts.tokens.shape
    supports, top_ids = [], []
    for i in range(b):
        for j in range(s):
            if j >= int(rollouts.lengths[i]):
                supports.append([])
                top_ids.append([])
                continue
            if torch.rand((), generator=gen) < 0.15:
                supports.append([])
                others = [v for v in torch.randperm(H.VOCAB, generator=gen).tolist() if v != int(rollouts.tokens[i, j])]
                top_ids.append(sorted([int(rollouts.tokens[i, j])] + others[:TOP_K - 1], reverse=True))
                continue
            size = int(torch.randint(1, H.VOCAB // 3, (), generator=gen))
            ids = set(torch.randperm(H.VOCAB, generator=gen)[:size].tolist()) | {int(rollouts.tokens[i, j])}
            supports.append(sorted(ids))
            top_ids.append(sorted(ids, reverse=True)[:TOP_K])
    top = TokenIds.from_lists(top_ids)
    return CapturedSupport.from_lists(supports), top, -torch.rand(top.nnz, generator=gen) * 3


def dense(indptr: torch.Tensor, ids: torch.Tensor, shape, values: torch.Tensor | None = None) -> torch.Tensor:
    """A CSR as a dense ``shape + [V]`` field: True (or the value) at each token's ids, False (NaN) elsewhere."""
    rows = indptr.numel() - 1
    if values is not None:
        out = torch.full((rows, H.VOCAB), float("nan"))
    else:
        out = torch.zeros(rows, H.VOCAB, dtype=torch.bool)
    for r in range(rows):
        lo, hi = int(indptr[r]), int(indptr[r + 1])
        out[r, ids[lo:hi]] = values[lo:hi] if values is not None else True
    return out.reshape(*shape, H.VOCAB)


def check_layout(mb, rollouts, support, top, top_logprobs) -> None:
    """The micro-batch's local CSRs equal ``target_field`` of the rollout-token lists as dense fields."""
    shape = tuple(rollouts.tokens.shape)
    want = mb.layout.target_field(dense(support.indptr, support.ids, shape), False)
    got = dense(mb.captured_support.indptr, mb.captured_support.ids, mb.targets.shape)
    assert torch.equal(got, want), "captured support laid out wrongly"
    want = mb.layout.target_field(dense(top.indptr, top.ids, shape, top_logprobs), float("nan"))
    local = mb.rollout_top_k
    got = dense(local.ids.indptr, local.ids.ids, mb.targets.shape, local.logprobs)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    # every trained target lies in its support
    keep = dense(mb.captured_support.indptr, mb.captured_support.ids, mb.targets.shape).reshape(-1, H.VOCAB)
    t = mb.targets.reshape(-1)
    assert all(bool(keep[i, t[i]]) for i in range(t.numel()) if t[i] != -100 and keep[i].any())


@pytest.mark.parametrize("fmt", ["padded", "packed"])
def test_lists_follow_the_layout(fmt: str) -> None:
    from mp_grpo.config.job import SequenceFormat
    from mp_grpo.megatron import prepare_micro_batch

    rollouts = H.make_rollouts(4, seed=3)
    support, top, top_logprobs = engine_lists(rollouts)
    mb = prepare_micro_batch(rollouts, sequence_format=SequenceFormat(fmt))
    mb = mb.with_captured_support(support).with_rollout_top_k(top, top_logprobs)
    check_layout(mb, rollouts, support, top, top_logprobs)
    moved = mb.to("cpu")
    assert torch.equal(moved.captured_support.ids, mb.captured_support.ids)
    with pytest.raises(ValueError, match=r"captured_support.indptr has 6 entries: a CSR over the micro-batch's 4"):
        mb.with_captured_support(type(support).from_lists([[1]] * 5))
    with pytest.raises(ValueError, match=r"rollout_top_k.logprobs must be a float tensor aligned with the ids"):
        mb.with_rollout_top_k(top, top_logprobs[:-1])
    with pytest.raises(ValueError, match="captured_support and sampling_filter: pass one"):
        mb.with_sampling_filter(top_k=3)


def _reference(config, rollouts, weights, support, solo, top=None):
    """(J, ∇J) of the whole batch in one call on one process, each token over its support; with ``top`` the loss's
    top-K divergence from the engine's top-K and the trainer's log-probs at the same ids."""
    from mp_grpo import vocab_parallel_logprobs_with_top_k
    from mp_grpo.loss import GRPOLoss, TopKLogprobs
    from mp_grpo.megatron import prepare_micro_batch
    from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config

    model = CpuGPTStandIn(cpu_model_config(hidden_size=H.HIDDEN), vocab_size=H.VOCAB, max_sequence_length=H.MAX_LEN,
                          tp_group=solo)
    model.load_full_weights(weights)
    mb = prepare_micro_batch(rollouts).with_captured_support(support)
    mb = mb if top is None else mb.with_rollout_top_k(*top)
    logits = model(mb.input_ids, mb.position_ids)
    ids = mb.rollout_top_k.ids if top is not None else TokenIds.from_lists([[]] * mb.targets.numel())
    logprobs, entropy, trainer = vocab_parallel_logprobs_with_top_k(
        logits, mb.targets, ids, temperature=H.TEMPERATURE, with_entropy=True, captured_support=mb.captured_support)
    topk = None if top is None else TopKLogprobs(ids.indptr, mb.rollout_top_k.logprobs, trainer)
    loss, _ = GRPOLoss(config)(logprobs, mb.old_logprobs, mb.advantages, mb.loss_mask,
                               rollout_logprobs=mb.rollout_logprobs, ref_logprobs=mb.ref_logprobs, entropy=entropy,
                               layout=mb.sequences, topk_logprobs=topk)
    loss.backward()
    return float(loss), {name: p.grad.clone() for name, p in model.named_parameters()}


def _step(groups, rollouts, weights, support, fmt, path, loss_config, top=None):
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

    from mp_grpo.config.job import SequenceFormat
    from mp_grpo.loss.metrics import reduce_metrics
    from mp_grpo.megatron import MegatronGRPO, prepare_micro_batch
    from mp_grpo.train.cpu_ddp import CpuDistributedDataParallel
    from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config
    from mp_grpo.train.cpu_schedule import forward_backward_cpu

    config = cpu_model_config(hidden_size=H.HIDDEN, context_parallel_size=groups.cp_size,
                              calculate_per_token_loss=False)
    config.finalize_model_grads_func = finalize_model_grads
    import torch.distributed as dist

    # megatron-core's layers want a group object: one process's world when there is no TP group
    model = CpuGPTStandIn(config, vocab_size=H.VOCAB, max_sequence_length=H.MAX_LEN,
                          tp_group=groups.tp or dist.group.WORLD)
    model.load_full_weights(weights)
    ddp = CpuDistributedDataParallel(config, DistributedDataParallelConfig(), model, dp_cp_group=groups.dp_cp)
    mb = prepare_micro_batch(rollouts, sequence_format=SequenceFormat(fmt), cp_group=groups.cp)
    mb = mb.with_captured_support(support)
    if top is not None:
        mb = mb.with_rollout_top_k(*top)
    grpo = MegatronGRPO(loss_config, temperature=H.TEMPERATURE, num_microbatches=1,
                        calculate_per_token_loss=False, groups=groups, output_path=path)
    batch = grpo.global_batch([mb], step=1)
    losses = forward_backward_cpu(forward_step_func=grpo.forward_step_func(batch, step=1), data_iterator=iter([mb]),
                                  model=ddp, num_microbatches=1, groups=groups)
    return mb, model, reduce_metrics(losses, groups.dp_cp), H.full_grads(model)


@contextlib.contextmanager
def recording_top_k():
    """MegatronGRPO._share records the trainer's top-K log-probs it receives (and hands them on to the loss)."""
    from mp_grpo.megatron import MegatronGRPO

    taken: list[torch.Tensor] = []
    original = MegatronGRPO._share

    def record(self, mb, batch, logprobs, entropy, top_k):
        taken.append(top_k.clone())
        return original(self, mb, batch, logprobs, entropy, top_k)

    MegatronGRPO._share = record
    try:
        yield taken
    finally:
        MegatronGRPO._share = original


def check_top_k(taken: list[torch.Tensor], model, mb, where: str) -> None:
    """The recorded top-K log-probs against the float64 log-softmax of the model's logits over each position's
    support, at the micro-batch's top-K ids of its trained positions (0 at the others': their rows are not computed)."""
    from tests.reference import logprobs_at_ids_reference, support_keep_reference

    assert taken, f"no top-K log-probs reached MegatronGRPO._share {where}"
    with torch.no_grad():
        logits = model(mb.input_ids, mb.position_ids).reshape(-1, H.VOCAB) / H.TEMPERATURE
    keep = support_keep_reference(mb.captured_support.indptr, mb.captured_support.ids, logits.shape)
    want = logprobs_at_ids_reference(logits, mb.rollout_top_k.ids.indptr, mb.rollout_top_k.ids.ids, keep=keep)
    # MegatronGRPO's output layer runs on the loss rows (OutputRows.LOSS): the entries of the other positions are 0
    indptr = mb.rollout_top_k.ids.indptr
    trained = mb.loss_mask.reshape(-1).repeat_interleave(indptr[1:] - indptr[:-1])
    got = taken[-1]
    assert bool((got[~trained] == 0).all()), f"top-K entries outside the loss rows {where}"
    got, want = got[trained], want[trained]
    finite = torch.isfinite(want)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), f"top-K -inf pattern {where}"
    assert_close(got[finite], want[finite], torch.float32, f"top-K log-probs {where}")


def case_context_parallel(cp: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mp_grpo.config.job import OutputPath, SequenceFormat
    from mp_grpo.megatron import ParallelGroups, prepare_micro_batch

    ps.initialize_model_parallel(context_parallel_size=cp)
    try:
        groups = ParallelGroups.from_parallel_state()
        solo = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
        rollouts = H.make_rollouts(4, seed=13)
        weights = H.full_weights()
        support, top, top_logprobs = engine_lists(rollouts, seed=1)
        # --- the split: each CP rank's positions, padded and packed ---
        for fmt in ("padded", "packed"):
            mb = prepare_micro_batch(rollouts, sequence_format=SequenceFormat(fmt), cp_group=groups.cp)
            check_layout(mb.with_captured_support(support).with_rollout_top_k(top, top_logprobs), rollouts, support,
                         top, top_logprobs)
        # --- one step over the support with the loss's top-K trust region equals the one-process batch; the
        #     trainer's log-probs at the engine's top-K ids as loss_func takes them (recorded in MegatronGRPO._share) ---
        for fmt, path, name in (("padded", OutputPath.LOGITS, "ppo_token_tis"),
                                ("packed", OutputPath.FUSED, "sequence_level")):
            where = f"[{fmt}, {path}, {name} + top-K TV, cp={cp}]"
            config = top_k_config(name)
            ref_loss, ref_grads = _reference(config, rollouts, weights, support, solo, top=(top, top_logprobs))
            with recording_top_k() as taken:
                mb, model, metrics, grads = _step(groups, rollouts, weights, support, fmt, path, config,
                                                  top=(top, top_logprobs))
            assert math.isclose(metrics["loss"], ref_loss, rel_tol=2e-5, abs_tol=1e-6), f"loss {where}"
            for pname, g in ref_grads.items():
                assert_close(grads[pname], g, torch.float32, msg=f"grad of {pname} {where}")
            check_top_k(taken, model, mb, where)
    finally:
        ps.destroy_model_parallel()


def test_context_parallel() -> None:
    torchrun(__file__, "case_context_parallel", nproc=2, cp=2)


def test_fused_loss_in_forward_and_the_refusal() -> None:
    """One process (no parallelism): ``loss_func`` on the fused output path with a token-separable loss — the loss and
    its gradient made in forward (``fused_linear_loss``) — with the support and the engine's top-K ids under a top-K
    trust region, against the log-prob op over the support and GRPOLoss on the same hidden states; the engine's top-K
    under another mode, or none under a top-K mode, refused naming ``mb.rollout_top_k``."""
    from mp_grpo import vocab_parallel_logprobs_with_top_k
    from mp_grpo.config.job import OutputPath
    from mp_grpo.loss import TopKLogprobs
    from mp_grpo.megatron import MegatronGRPO, ParallelGroups, prepare_micro_batch
    from mp_grpo.megatron.fused_output import OutputWeight

    rollouts = H.make_rollouts(2, seed=17)
    support, top, top_logprobs = engine_lists(rollouts, seed=2)
    mb = prepare_micro_batch(rollouts).with_captured_support(support).with_rollout_top_k(top, top_logprobs)
    grpo = MegatronGRPO(top_k_config("ppo_token_tis"), temperature=H.TEMPERATURE, num_microbatches=1,
                        calculate_per_token_loss=False, groups=ParallelGroups(), vocab_size=H.VOCAB,
                        output_path=OutputPath.FUSED)
    batch = grpo.global_batch([mb], step=0)
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(*mb.targets.shape, H.HIDDEN, generator=gen)
    weight = torch.randn(H.VOCAB, H.HIDDEN, generator=gen) * H.HIDDEN**-0.5
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with recording_top_k() as taken:
        loss, _ = grpo.loss_func(mb, batch, h, output_weight=OutputWeight(w, False))
    loss.backward()
    # the same over the logits: the log-prob op over the support, then GRPOLoss
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent, trainer = vocab_parallel_logprobs_with_top_k(
        h2 @ w2.t(), mb.targets, mb.rollout_top_k.ids, temperature=H.TEMPERATURE, with_entropy=True,
        captured_support=mb.captured_support)
    topk = TopKLogprobs(mb.rollout_top_k.ids.indptr, mb.rollout_top_k.logprobs, trainer)
    share, _ = grpo.loss(lp, mb.old_logprobs, mb.advantages, mb.loss_mask, rollout_logprobs=mb.rollout_logprobs,
                         ref_logprobs=mb.ref_logprobs, entropy=ent, batch=batch, layout=mb.sequences,
                         topk_logprobs=topk)
    share.backward()
    torch.testing.assert_close(loss, share, rtol=1e-5, atol=1e-7)
    assert_close(h.grad, h2.grad, torch.float32, "hidden gradient [fused loss in forward over the support]")
    assert_close(w.grad, w2.grad, torch.float32, "weight gradient [fused loss in forward over the support]")

    class Logits(torch.nn.Module):  # check_top_k's model: the logits of these hidden states
        def forward(self, input_ids, position_ids):
            return hidden @ weight.t()

    check_top_k(taken, Logits(), mb, "[fused loss in forward]")
    other = MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=H.TEMPERATURE, num_microbatches=1,
                         calculate_per_token_loss=False, groups=ParallelGroups(), vocab_size=H.VOCAB,
                         output_path=OutputPath.FUSED)
    with pytest.raises(ValueError, match="mb.rollout_top_k: trust_region.mode=none reads no top-K log-probs"):
        other.loss_func(mb, other.global_batch([mb], step=0), hidden.clone().requires_grad_(),
                        output_weight=OutputWeight(weight, False))
    without = replace(mb, rollout_top_k=None)
    with pytest.raises(ValueError, match="mb.rollout_top_k: trust_region.mode=topk_tv takes the divergence"):
        grpo.loss_func(without, grpo.global_batch([without], step=0), hidden.clone().requires_grad_(),
                       output_weight=OutputWeight(weight, False))


if __name__ == "__main__":
    worker_main({"case_context_parallel": case_context_parallel})
