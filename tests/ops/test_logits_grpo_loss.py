"""GRPOLoss.on_logits (mp_grpo/ops/logits_grpo_loss.py): the loss straight from logits, one autograd Function.

Against the float64 reference (log-probs and entropy of the logits, then the objective; gradient w.r.t. the
logits under a random upstream gradient), and against the two ops run one after the other (the same kernels:
equal values, gradients and metrics) — every fused feature config, padded and packed, TP = 1 in-process and
TP = 2 under torchrun (gloo). Under the Triton interpreter (small sizes).
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

from mp_grpo.loss import GlobalBatch, GRPOLoss, LossBackend, PackedSequences
from tests.distributed import torchrun, worker_main
from tests.loss.helpers import AGGREGATIONS, FEATURE_CONFIGS, config
from tests.reference import grpo_objective_reference, logprobs_reference
from tests.tolerances import assert_close

LENGTHS = [5, 3, 0, 6, 1, 4]
T = 7
VOCAB = 24
CASES = [(f, list(AGGREGATIONS)[i % len(AGGREGATIONS)]) for i, f in enumerate(FEATURE_CONFIGS)]


def _case(seed: int, vocab: int = VOCAB):
    """Logits [B, T, V], targets, and the loss inputs around the reference log-probs (garbage where masked)."""
    gen = torch.Generator().manual_seed(seed)
    B = len(LENGTHS)
    logits = torch.randn(B, T, vocab, generator=gen) * 2
    target = torch.randint(0, vocab, (B, T), generator=gen)
    mask = torch.arange(T).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)
    target = torch.where(mask | (torch.rand(B, T, generator=gen) < 0.5), target, -100)  # ignored where masked
    lp_ref, _ = logprobs_reference(logits, target)

    def near(x, scale):
        return x + torch.randn(B, T, generator=gen, dtype=torch.float64) * scale

    junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e4], dtype=torch.float64)
    pick = torch.randint(0, 4, (B, T), generator=gen)
    old = near(lp_ref, 0.15)
    inputs = {"old_logprobs": old, "rollout_logprobs": near(old, 0.15), "ref_logprobs": near(lp_ref, 0.3)}
    inputs = {k: torch.where(mask, v, junk[pick]).float() for k, v in inputs.items()}
    inputs["advantages"] = torch.randn(B, generator=gen, dtype=torch.float64).float()
    inputs["loss_mask"] = mask
    return logits, target, inputs


def _reference(cfg, logits, target, inputs, g: float):
    """The float64 objective of the full-vocabulary ``logits`` (log-probs and entropy of the reference, then
    the objective) and its gradient w.r.t. the logits under the upstream gradient ``g``."""
    ref = logits.double().requires_grad_()
    lp_ref, ent_ref = logprobs_reference(ref, target)
    j = grpo_objective_reference(
        cfg, lp_ref, inputs["old_logprobs"], inputs["advantages"], inputs["loss_mask"],
        rollout_logprobs=inputs["rollout_logprobs"], ref_logprobs=inputs["ref_logprobs"], entropy=ent_ref)
    (j * g).backward()
    return j, ref.grad


def _batch(cfg, logits, target, inputs, layout=None) -> GlobalBatch:
    """The step's account as a training loop builds it: from a forward-only pass's entropies."""
    from mp_grpo import vocab_parallel_logprobs

    _, entropy = vocab_parallel_logprobs(logits, target, with_entropy=True)
    return GlobalBatch.from_rollouts(
        cfg, [inputs["loss_mask"]], old_logprobs=[inputs["old_logprobs"]],
        rollout_logprobs=[inputs["rollout_logprobs"]], entropies=[entropy],
        layouts=None if layout is None else [layout])


def _on_logits(cfg, logits, target, inputs, g, **kwargs):
    x = logits.clone().requires_grad_()
    loss, metrics = GRPOLoss(cfg, backend=LossBackend.TRITON).on_logits(
        x, target, inputs["old_logprobs"], inputs["advantages"], inputs["loss_mask"],
        rollout_logprobs=inputs["rollout_logprobs"], ref_logprobs=inputs["ref_logprobs"], **kwargs)
    (loss * g).backward()
    return loss.detach(), x.grad, metrics


@pytest.mark.parametrize("feature,aggregation", CASES)
def test_matches_float64_reference(feature: str, aggregation: str) -> None:
    cfg = config(feature, aggregation)
    logits, target, inputs = _case(zlib.crc32(f"{feature}/{aggregation}".encode()))
    g = 0.7
    loss, grad, _ = _on_logits(cfg, logits, target, inputs, g, batch=_batch(cfg, logits, target, inputs))

    j, ref_grad = _reference(cfg, logits, target, inputs, g)
    assert_close(loss, j, torch.float32, "loss")
    assert_close(grad, ref_grad, torch.float32, "d loss / d logits")


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("feature,aggregation", CASES[:4] + CASES[-2:])
def test_equals_the_two_ops_in_turn(feature: str, aggregation: str, packed: bool) -> None:
    """Same kernels, one Function: loss, logits gradient and every metric equal the composed call's."""
    from mp_grpo import vocab_parallel_logprobs

    cfg = config(feature, aggregation)
    logits, target, inputs = _case(zlib.crc32(f"{feature}/{aggregation}/{packed}".encode()))
    layout = None
    if packed:  # the same tokens as one packed row: segments of LENGTHS, then padding
        lengths = torch.tensor(LENGTHS)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        rows = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
        n = int(cu[-1])
        flat_logits = torch.cat([logits[rows], torch.randn(3, logits.shape[-1])])
        flat_target = torch.cat([target[rows], torch.tensor([-100, 1, 2])])
        flat = {k: torch.cat([v[rows], torch.zeros(3)]) for k, v in inputs.items() if k not in ("advantages", "loss_mask")}
        flat["advantages"] = inputs["advantages"]
        flat["loss_mask"] = torch.cat([torch.ones(n, dtype=torch.bool), torch.zeros(3, dtype=torch.bool)])
        layout = PackedSequences(cu)
        logits, target, inputs = flat_logits, flat_target, flat
    batch = _batch(cfg, logits, target, inputs, layout)
    g = -1.3
    loss, grad, metrics = _on_logits(cfg, logits, target, inputs, g, batch=batch, layout=layout)

    x = logits.clone().requires_grad_()
    out = vocab_parallel_logprobs(x, target, with_entropy=cfg.needs_entropy)
    lp, ent = out if cfg.needs_entropy else (out, None)
    loss2, metrics2 = GRPOLoss(cfg, backend=LossBackend.TRITON)(
        lp, inputs["old_logprobs"], inputs["advantages"], inputs["loss_mask"],
        rollout_logprobs=inputs["rollout_logprobs"], ref_logprobs=inputs["ref_logprobs"], entropy=ent,
        batch=batch, layout=layout)
    (loss2 * g).backward()
    assert torch.equal(loss, loss2.detach()), (loss, loss2)
    torch.testing.assert_close(grad, x.grad, rtol=0, atol=0)
    assert metrics.keys() == metrics2.keys()
    for name in metrics:
        torch.testing.assert_close(metrics[name], metrics2[name], rtol=1e-12, atol=0, msg=name)


def test_falls_back_to_the_two_ops_without_a_batch() -> None:
    cfg = config("ppo_dual_delta", "token_mean")
    logits, target, inputs = _case(3)
    loss, grad, _ = _on_logits(cfg, logits, target, inputs, 1.0)  # no batch: this call is the step
    loss_b, grad_b, _ = _on_logits(cfg, logits, target, inputs, 1.0, batch=_batch(cfg, logits, target, inputs))
    torch.testing.assert_close(loss, loss_b)
    torch.testing.assert_close(grad, grad_b)


def test_errors_name_the_argument() -> None:
    cfg = config("ppo_dual_delta", "token_mean")
    logits, target, inputs = _case(4)
    batch = _batch(cfg, logits, target, inputs)
    loss_fn = GRPOLoss(cfg, backend=LossBackend.TRITON)
    args = (inputs["old_logprobs"], inputs["advantages"], inputs["loss_mask"])
    with pytest.raises(ValueError, match="old_logprobs has shape .*, target has"):
        loss_fn.on_logits(logits, target, inputs["old_logprobs"][:, :3], *args[1:], batch=batch)
    with pytest.raises(ValueError, match="target"):
        loss_fn.on_logits(logits, target[:, :3], *args, batch=batch)
    with pytest.raises(ValueError, match="entropy_coef"):
        loss_fn.on_logits(logits, target, *args, batch=batch, entropy_coef=0.1)
    with pytest.raises(ValueError, match="temperature"):
        loss_fn.on_logits(logits, target, *args, batch=batch, temperature=0.0)
    bad = target.clone()
    bad[0, 0] = VOCAB  # outside the vocabulary: raised at once on the CPU (the deferred ledger on a GPU)
    with pytest.raises(ValueError, match="target"):
        loss_fn.on_logits(logits, bad, *args, batch=batch)


# ----------------------------------------------------------------------------- TP = 2 (torchrun, gloo)
def case_tensor_parallel() -> None:
    """Each rank holds half the vocabulary; loss and its shard's gradient equal the float64 reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for feature, aggregation in (CASES[1], CASES[4]):  # gspo + sequence IS; sapo + entropy + KL
        cfg = config(feature, aggregation)
        logits, target, inputs = _case(zlib.crc32(f"tp/{feature}".encode()), vocab=VOCAB * world)
        v_local = VOCAB
        shard = logits[..., rank * v_local:(rank + 1) * v_local]
        from mp_grpo import vocab_parallel_logprobs

        _, entropy = vocab_parallel_logprobs(shard, target, tp_group=dist.group.WORLD, with_entropy=True)
        batch = GlobalBatch.from_rollouts(cfg, [inputs["loss_mask"]], old_logprobs=[inputs["old_logprobs"]],
                                          rollout_logprobs=[inputs["rollout_logprobs"]], entropies=[entropy])
        g = 0.9
        loss, grad, _ = _on_logits(cfg, shard, target, inputs, g, batch=batch, tp_group=dist.group.WORLD)
        j, ref_grad = _reference(cfg, logits, target, inputs, g)
        assert_close(loss, j, torch.float32, f"loss rank {rank} {feature}")
        assert_close(grad, ref_grad[..., rank * v_local:(rank + 1) * v_local], torch.float32,
                     f"grad rank {rank} {feature}")


def case_context_parallel() -> None:
    """CP = 2: each rank holds chunks of every row (Megatron's load-balanced split); the shares sum to the
    float64 objective, each rank's logits gradient is the reference's on its positions — gspo and gmpo, whose
    sequence mean spans both ranks (backward's CP all-reduce)."""
    from mp_grpo.loss import PaddedSequences

    rank, cp = dist.get_rank(), dist.get_world_size()
    width = 2 * cp  # the first 2·CP positions of every row, one chunk of one position each
    cols = torch.tensor([rank, 2 * cp - 1 - rank])
    for feature, aggregation in (CASES[1], CASES[2]):
        cfg = config(feature, aggregation)
        logits, target, inputs = _case(zlib.crc32(f"cp/{feature}".encode()))
        logits, target = logits[:, :width], target[:, :width]
        inputs = {k: (v[:, :width] if v.dim() == 2 else v) for k, v in inputs.items()}
        layout = PaddedSequences(dist.group.WORLD)
        mine = {k: (v[:, cols] if v.dim() == 2 else v) for k, v in inputs.items()}
        batch = GlobalBatch.from_rollouts(cfg, [mine["loss_mask"]], old_logprobs=[mine["old_logprobs"]],
                                          rollout_logprobs=[mine["rollout_logprobs"]], group=dist.group.WORLD,
                                          layouts=[layout])
        g = 1.1
        share, grad, _ = _on_logits(cfg, logits[:, cols], target[:, cols], mine, g, batch=batch, layout=layout)
        total = share.clone()
        dist.all_reduce(total)
        j, ref_grad = _reference(cfg, logits, target, inputs, g)
        assert_close(total, j, torch.float32, f"loss rank {rank} {feature}")
        assert_close(grad, ref_grad[:, cols], torch.float32, f"grad rank {rank} {feature}")


def test_tensor_parallel() -> None:
    torchrun(__file__, "case_tensor_parallel", 2)


def test_context_parallel() -> None:
    torchrun(__file__, "case_context_parallel", 2)


if __name__ == "__main__":
    worker_main({"case_tensor_parallel": case_tensor_parallel, "case_context_parallel": case_context_parallel})
