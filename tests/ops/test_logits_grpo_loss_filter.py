"""GRPOLoss.on_logits with a sampling filter: the fused path (one autograd Function) gives bit for bit what the
two ops in turn give — vocab_parallel_logprobs(sampling_filter=...) then the fused loss — and both match the
float64 reference of the filtered, renormalized distribution. Targets outside the kept set: recorded when checked,
-inf with no gradient from their log-prob when not, on both paths alike. TP = 1 in-process, TP = 2 under torchrun
(gloo). Under the Triton interpreter (small sizes; its tiny candidate buffer sends some rows to the fallback).
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

from mp_grpo.loss import GlobalBatch, GRPOLoss, LossBackend
from mp_grpo.ops import SamplingFilter
from tests.distributed import torchrun, worker_main
from tests.loss.helpers import config
from tests.reference import filtered_logprobs_reference, grpo_objective_reference, sampling_filter_keep_reference
from tests.tolerances import assert_close

B, T, VOCAB = 4, 5, 40
TEMPERATURE = 0.8
FILTERS = {
    "top_k": lambda gen: dict(top_k=6),
    "top_p": lambda gen: dict(top_p=0.85),
    "per_row": lambda gen: dict(top_k=torch.randint(-1, 15, (B, T), generator=gen),
                                top_p=torch.rand(B, T, generator=gen) * 0.5 + 0.5, min_p=0.02),
}
CASES = [("ppo_dual_delta", "token_mean", "top_k"), ("gspo_seq_is_geo_reject", "seq_mean_token_mean", "top_p"),
         ("sapo_entropy_kl", "seq_mean_token_sum_norm", "per_row")]


def _case(seed: int, filt_name: str, vocab: int = VOCAB):
    """Logits [B, T, V] (a few dominant tokens per row: the candidate path; flat rows: the fallback), a filter,
    targets drawn from its kept set, and the loss inputs around the reference's log-probs."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, vocab, generator=gen) * 1.5
    logits[::2, :, :3] += 6.0  # peaky rows
    filt = FILTERS[filt_name](gen)
    keep = sampling_filter_keep_reference(logits, temperature=TEMPERATURE, **filt)
    target = torch.multinomial(keep.reshape(-1, vocab).double(), 1, generator=gen).reshape(B, T)
    lengths = torch.tensor([5, 3, 0, 4])
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    target = torch.where(mask | (torch.rand(B, T, generator=gen) < 0.5), target, -100)
    lp_ref, _ = filtered_logprobs_reference(logits, target, temperature=TEMPERATURE, **filt)
    old = torch.where(torch.isfinite(lp_ref), lp_ref, 0.0) + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.15
    inputs = {"old_logprobs": old.float(), "rollout_logprobs": (old + 0.1).float(),
              "ref_logprobs": (old - 0.2).float(), "advantages": torch.randn(B, generator=gen), "loss_mask": mask}
    return logits, target, filt, inputs


def _batch(cfg, logits, target, inputs, filt, tp_group=None) -> GlobalBatch:
    from mp_grpo import vocab_parallel_logprobs

    _, entropy = vocab_parallel_logprobs(logits, target, with_entropy=True, temperature=TEMPERATURE,
                                         sampling_filter=SamplingFilter(**filt), tp_group=tp_group)
    return GlobalBatch.from_rollouts(cfg, [inputs["loss_mask"]], old_logprobs=[inputs["old_logprobs"]],
                                     rollout_logprobs=[inputs["rollout_logprobs"]], entropies=[entropy])


def _fused(cfg, logits, target, inputs, filt, g, batch, **kwargs):
    x = logits.clone().requires_grad_()
    loss, metrics = GRPOLoss(cfg, backend=LossBackend.TRITON).on_logits(
        x, target, inputs["old_logprobs"], inputs["advantages"], inputs["loss_mask"], temperature=TEMPERATURE,
        rollout_logprobs=inputs["rollout_logprobs"], ref_logprobs=inputs["ref_logprobs"],
        sampling_filter=SamplingFilter(**filt), batch=batch, **kwargs)
    (loss * g).backward()
    return loss.detach(), x.grad, metrics


def _two_ops(cfg, logits, target, inputs, filt, g, batch, **kwargs):
    from mp_grpo import vocab_parallel_logprobs

    x = logits.clone().requires_grad_()
    check_inputs = kwargs.pop("check_inputs", True)
    out = vocab_parallel_logprobs(x, target, with_entropy=cfg.needs_entropy, temperature=TEMPERATURE,
                                  sampling_filter=SamplingFilter(**filt), check_inputs=check_inputs, **kwargs)
    lp, ent = out if cfg.needs_entropy else (out, None)
    loss, metrics = GRPOLoss(cfg, backend=LossBackend.TRITON)(
        lp, inputs["old_logprobs"], inputs["advantages"], inputs["loss_mask"],
        rollout_logprobs=inputs["rollout_logprobs"], ref_logprobs=inputs["ref_logprobs"], entropy=ent, batch=batch,
        check_inputs=check_inputs)
    (loss * g).backward()
    return loss.detach(), x.grad, metrics


def _assert_same_bits(a, b) -> None:
    (loss, grad, metrics), (loss2, grad2, metrics2) = a, b
    assert torch.equal(loss, loss2), (loss, loss2)
    torch.testing.assert_close(grad, grad2, rtol=0, atol=0)
    assert metrics.keys() == metrics2.keys()
    for name in metrics:
        torch.testing.assert_close(metrics[name], metrics2[name], rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("feature,aggregation,filt_name", CASES)
def test_fused_filter_equals_the_two_ops_and_the_reference(feature, aggregation, filt_name):
    cfg = config(feature, aggregation)
    logits, target, filt, inputs = _case(zlib.crc32(f"{feature}/{filt_name}".encode()), filt_name)
    batch = _batch(cfg, logits, target, inputs, filt)
    g = -1.3
    fused = _fused(cfg, logits, target, inputs, filt, g, batch)
    _assert_same_bits(fused, _two_ops(cfg, logits, target, inputs, filt, g, batch))

    ref = logits.double().requires_grad_()
    lp_ref, ent_ref = filtered_logprobs_reference(ref, target, temperature=TEMPERATURE, **filt)
    j = grpo_objective_reference(cfg, lp_ref, inputs["old_logprobs"], inputs["advantages"], inputs["loss_mask"],
                                 rollout_logprobs=inputs["rollout_logprobs"], ref_logprobs=inputs["ref_logprobs"],
                                 entropy=ent_ref)
    (j * g).backward()
    assert_close(fused[0], j, torch.float32, "loss")
    assert_close(fused[1], ref.grad, torch.float32, "d loss / d logits")


def test_targets_outside_the_kept_set():
    """Unchecked: the same bits on both paths (log-prob -inf, no gradient from it); checked: raised on both."""
    cfg = config("ppo_dual_delta", "token_mean")
    logits, target, filt, inputs = _case(7, "top_k")
    keep = sampling_filter_keep_reference(logits, temperature=TEMPERATURE, **filt)
    outside = target.clone()
    for b, t in ((0, 1), (3, 2)):  # two valid positions get a target outside the kept set
        outside[b, t] = int((~keep[b, t]).nonzero()[0])
        inputs["loss_mask"][b, t] = True
    batch = _batch(cfg, logits, target, inputs, filt)
    fused = _fused(cfg, logits, outside, inputs, filt, 0.9, batch, check_inputs=False)
    _assert_same_bits(fused, _two_ops(cfg, logits, outside, inputs, filt, 0.9, batch, check_inputs=False))
    for run in (_fused, _two_ops):
        with pytest.raises(ValueError, match=r"target: 2 token id\(s\) lie outside the sampling_filter's kept set"):
            run(cfg, logits, outside, inputs, filt, 0.9, batch)


# ----------------------------------------------------------------------------- TP = 2 (torchrun, gloo)
def case_tensor_parallel() -> None:
    """Each rank holds half the vocabulary: fused == two ops bit for bit, and == the float64 reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for feature, aggregation, filt_name in CASES[1:]:
        cfg = config(feature, aggregation)
        logits, target, filt, inputs = _case(zlib.crc32(f"tp/{feature}".encode()), filt_name, vocab=VOCAB * world)
        shard = logits[..., rank * VOCAB:(rank + 1) * VOCAB]
        group = dist.group.WORLD
        batch = _batch(cfg, shard, target, inputs, filt, tp_group=group)
        fused = _fused(cfg, shard, target, inputs, filt, 0.6, batch, tp_group=group)
        _assert_same_bits(fused, _two_ops(cfg, shard, target, inputs, filt, 0.6, batch, tp_group=group))
        ref = logits.double().requires_grad_()
        lp_ref, ent_ref = filtered_logprobs_reference(ref, target, temperature=TEMPERATURE, **filt)
        j = grpo_objective_reference(cfg, lp_ref, inputs["old_logprobs"], inputs["advantages"], inputs["loss_mask"],
                                     rollout_logprobs=inputs["rollout_logprobs"],
                                     ref_logprobs=inputs["ref_logprobs"], entropy=ent_ref)
        (j * 0.6).backward()
        assert_close(fused[0], j, torch.float32, f"loss rank {rank} {feature}")
        assert_close(fused[1], ref.grad[..., rank * VOCAB:(rank + 1) * VOCAB], torch.float32, f"grad rank {rank}")


def test_tensor_parallel() -> None:
    torchrun(__file__, "case_tensor_parallel", 2)


if __name__ == "__main__":
    worker_main({"case_tensor_parallel": case_tensor_parallel})
