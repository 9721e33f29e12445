"""NaN and ±inf inputs at trained positions, per input, on the torch and the fused (Triton) paths.

For each input of a DAPO step with token TIS and a KL penalty — the logits (through the two ops and through
``GRPOLoss.on_logits``), the policy log-probs, the old / rollout / reference log-probs and the advantages —
and each of NaN, +inf and −inf at one trained position: the position is dropped from the loss (no value, no
gradient), counted in the metric ``nonfinite_inputs``, and ``check_errors()`` raises a ValueError naming the
input; the loss and the gradient stay finite, every other position's gradient is the clean run's (the config
is token-separable), and the torch and fused paths agree. The same values at masked positions change nothing.
``nonfinite.skip_step`` under torchrun / gloo: a bad rollout input on one rank skips the step on both.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import mp_grpo
from mp_grpo import GlobalBatch, GRPOLoss, LossBackend, reduce_metrics, vocab_parallel_logprobs
from mp_grpo.config import load_config
from mp_grpo.ops.checks import deferred_checks
from tests.distributed import torchrun, worker_main
from tests.loss.helpers import make_batch

LENGTHS = [5, 3, 0, 6]
T, V = 6, 24
BAD = (0, 1)  # a trained position
MASKED = (1, 4)  # a masked one
VALUES = [float("nan"), float("inf"), float("-inf")]
IDS = ["nan", "+inf", "-inf"]
OVERRIDES = ["rollout_correction.weight_level=token", "rollout_correction.weight_max=2.0",
             "rollout_correction.reject_level=null", "rollout_correction.reject_max=null", "kl.coef=0.05"]


def _config(*extra: str):
    return load_config("trl_dapo", OVERRIDES + list(extra))


def _data(seed: int = 0) -> dict[str, torch.Tensor]:
    batch = make_batch(seed, LENGTHS, T, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    batch["logits"] = torch.randn(len(LENGTHS), T, V, generator=gen) * 2
    batch["target"] = torch.where(batch["loss_mask"], torch.randint(0, V, (len(LENGTHS), T), generator=gen),
                                  torch.full((), -100))
    return batch


def _run(path: str, data: dict[str, torch.Tensor], cfg) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(loss, gradient w.r.t. the differentiable input — logits or log-probs —, metrics) of one call."""
    backend = LossBackend.TORCH if path.endswith("torch") else LossBackend.TRITON
    loss_fn = GRPOLoss(cfg, backend=backend)
    batch = GlobalBatch.from_masks([data["loss_mask"]])
    kw = dict(rollout_logprobs=data["rollout_logprobs"], ref_logprobs=data["ref_logprobs"], batch=batch)
    args = (data["old_logprobs"], data["advantages"], data["loss_mask"])
    if path.startswith("logits"):
        x = data["logits"].clone().requires_grad_()
        if path.startswith("logits on_logits"):
            loss, metrics = loss_fn.on_logits(x, data["target"], *args, **kw)
        else:
            loss, metrics = loss_fn(vocab_parallel_logprobs(x, data["target"]), *args, **kw)
    else:
        x = data["logprobs"].clone().requires_grad_()
        loss, metrics = loss_fn(x, *args, **kw)
    (grad,) = torch.autograd.grad(loss * 1.7, x)
    return loss.detach(), grad, metrics


def _place(data: dict[str, torch.Tensor], name: str, value: float, where: tuple[int, int]) -> dict:
    data = {k: v.clone() for k, v in data.items()}
    b, t = where
    if name == "logits":  # NaN / +inf anywhere in the row; -inf at the target (probability 0; elsewhere allowed)
        column = int(data["target"][b, t]) if value == float("-inf") else (int(data["target"][b, t]) + 5) % V
        if where == MASKED:
            column = 3
        data["logits"][b, t, column] = value
    elif name == "advantages":  # per sequence: every trained position of the sequence
        data["advantages"][b] = value
    else:
        data[name][b, t] = value
    return data


CASES = [(name, path) for name in ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs", "advantages")
         for path in ("torch", "triton")]
CASES += [("logits", path) for path in ("logits two ops torch", "logits two ops triton", "logits on_logits triton")]


@pytest.mark.parametrize("value", VALUES, ids=IDS)
@pytest.mark.parametrize("name,path", CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_nonfinite_input_is_dropped_counted_and_raised(name: str, path: str, value: float) -> None:
    cfg = _config()
    data = _data()
    clean_loss, clean_grad, _ = _run(path, data, cfg)
    mp_grpo.check_errors()
    bad = _place(data, name, value, BAD)
    with deferred_checks():
        loss, grad, metrics = _run(path, bad, cfg)
        expected = r"(logits|logprobs): 1 " if name == "logits" else rf"{name}: {LENGTHS[0] if name == 'advantages' else 1} trained"
        with pytest.raises(ValueError, match=expected):
            mp_grpo.check_errors()
        mp_grpo.check_errors()
    dropped = LENGTHS[0] if name == "advantages" else 1
    assert reduce_metrics([metrics])["nonfinite_inputs"] == dropped
    assert torch.isfinite(loss) and torch.isfinite(grad).all(), "a non-finite input leaked into the loss or gradient"
    # the dropped positions get no gradient; every other position the clean run's (token-separable config)
    others = torch.ones(len(LENGTHS), T, dtype=torch.bool)
    if name == "advantages":
        others[BAD[0]] = False
    else:
        others[BAD] = False
    grad_tokens = grad if grad.dim() == 2 else grad.abs().sum(-1)
    assert (grad_tokens[~others] == 0).all()
    torch.testing.assert_close(grad[others], clean_grad[others], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("value", VALUES, ids=IDS)
@pytest.mark.parametrize("name", ["logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs", "logits"])
def test_torch_and_fused_paths_agree(name: str, value: float) -> None:
    """The paths agree on the loss, the gradient and the metrics with a non-finite input (the torch path used to
    give a NaN loss for a NaN policy log-prob where the fused one hid it)."""
    cfg = _config()
    bad = _place(_data(1), name, value, BAD)
    paths = ("logits two ops torch", "logits on_logits triton") if name == "logits" else ("torch", "triton")
    with deferred_checks():
        (l1, g1, m1), (l2, g2, m2) = (_run(p, bad, cfg) for p in paths)
        with pytest.raises(ValueError):
            mp_grpo.check_errors()
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-7)
    r1, r2 = reduce_metrics([m1]), reduce_metrics([m2])
    assert r1.keys() == r2.keys()
    for key in r1:
        assert r1[key] == pytest.approx(r2[key], rel=1e-5, abs=1e-7), key


MASKED_CASES = [(name, path) for name in ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs")
                for path in ("torch", "triton")] + [("logits", "logits on_logits triton")]


@pytest.mark.parametrize("name,path", MASKED_CASES, ids=[f"{n}-{p}" for n, p in MASKED_CASES])
def test_masked_positions_leak_nothing(name: str, path: str) -> None:
    cfg = _config()
    data = _data(2)
    clean = _run(path, data, cfg)
    for value in VALUES:
        loss, grad, metrics = _run(path, _place(data, name, value, MASKED), cfg)
        mp_grpo.check_errors()
        assert torch.equal(loss, clean[0]) and torch.equal(grad, clean[1])
        assert reduce_metrics([metrics])["nonfinite_inputs"] == 0


def test_minus_inf_logit_off_the_target_is_probability_zero() -> None:
    """A −inf logit elsewhere than at the target is a filtered / masked token: nothing counted, all finite."""
    cfg = _config()
    data = _data(3)
    data["logits"][BAD[0], BAD[1], (int(data["target"][BAD]) + 5) % V] = float("-inf")
    for path in ("logits two ops torch", "logits on_logits triton"):
        loss, grad, metrics = _run(path, data, cfg)
        mp_grpo.check_errors()
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert reduce_metrics([metrics])["nonfinite_inputs"] == 0


# --------------------------------------------------------------------------- nonfinite.skip_step, two ranks
def case_skip_step(backend: str) -> None:
    rank = dist.get_rank()
    cfg = _config("nonfinite.skip_step=true")
    data = _data(10 + rank)
    if rank == 1:
        data["rollout_logprobs"][BAD] = float("nan")
    loss_fn = GRPOLoss(cfg, backend=LossBackend(backend))

    def step(data):
        batch = GlobalBatch.from_rollouts(
            cfg, [data["loss_mask"]], old_logprobs=[data["old_logprobs"]], rollout_logprobs=[data["rollout_logprobs"]],
            ref_logprobs=[data["ref_logprobs"]], advantages=[data["advantages"]], group=dist.group.WORLD)
        x = data["logprobs"].clone().requires_grad_()
        loss, metrics = loss_fn(x, data["old_logprobs"], data["advantages"], data["loss_mask"],
                                rollout_logprobs=data["rollout_logprobs"], ref_logprobs=data["ref_logprobs"],
                                batch=batch)
        (grad,) = torch.autograd.grad(loss, x)
        return batch, loss, grad, metrics

    # a NaN rollout log-prob on rank 1 only: both ranks skip — loss 0, zero gradient, nothing raised
    batch, loss, grad, metrics = step(data)
    metrics = reduce_metrics([metrics], dist.group.WORLD)
    assert batch.nonfinite_inputs.item() == 1 and batch.skip_step() is True
    assert loss.item() == 0 and (grad == 0).all()
    assert metrics["nonfinite_inputs"] == 1 and metrics["mismatch/skipped"] == 1
    # the policy's own log-probs are not seen by the batch: a NaN there still raises (on its rank)
    data = _data(20 + rank)
    if rank == 0:
        data["logprobs"][BAD] = float("nan")
    with deferred_checks():
        batch, loss, grad, _ = step(data)
        assert batch.skip.item() is False and torch.isfinite(loss) and torch.isfinite(grad).all()
        if rank == 0:
            with pytest.raises(ValueError, match="logprobs: 1 trained"):
                mp_grpo.check_errors()
        mp_grpo.check_errors()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_skip_step_on_every_rank_alike(backend: str) -> None:
    torchrun(__file__, "case_skip_step", nproc=2, backend=backend)


if __name__ == "__main__":
    worker_main({"case_skip_step": case_skip_step})


@pytest.mark.parametrize("backend", [LossBackend.TORCH, LossBackend.TRITON])
def test_check_inputs_off_and_sync(backend: LossBackend) -> None:
    """``check_inputs=OFF``: the position is still dropped and counted in the metric, nothing is recorded;
    ``SYNC``: raised at the call."""
    cfg = _config()
    data = _place(_data(4), "rollout_logprobs", float("nan"), BAD)
    loss_fn = GRPOLoss(cfg, backend=backend)
    batch = GlobalBatch.from_masks([data["loss_mask"]])
    args = (data["logprobs"], data["old_logprobs"], data["advantages"], data["loss_mask"])
    kw = dict(rollout_logprobs=data["rollout_logprobs"], ref_logprobs=data["ref_logprobs"], batch=batch)
    with deferred_checks():
        loss, metrics = loss_fn(*args, **kw, check_inputs=mp_grpo.CheckInputs.OFF)
        mp_grpo.check_errors()
        assert torch.isfinite(loss) and reduce_metrics([metrics])["nonfinite_inputs"] == 1
        with pytest.raises(ValueError, match="rollout_logprobs: 1 trained"):
            loss_fn(*args, **kw, check_inputs=mp_grpo.CheckInputs.SYNC)
