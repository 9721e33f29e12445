"""``model.logit_dtype`` and ``engine.logit_dtype`` through the learning loop (mp_grpo/train/loop.py, CPU, TP = 1).

A bf16 trainer (``model.params_dtype = bf16``: the CPU stand-in under Megatron's bf16 contract) whose logits are at
an LLM's scale (``model.cpu_logit_offset = 16``: maximum ~18), one on-policy step. Against float64 logits of the
trainer's own bf16 operands (its output layer's input and weight):

- the old log-probs (the forward-only pass) under ``model.logit_dtype = fp32`` are within 1e-4, under bf16 they carry
  the logits' bf16 rounding (measured, ~1e-2); the training pass computes the same log-probs (the on-policy ratio
  is 1: both passes got the setting);
- the engine's log-probs under ``engine.logit_dtype = fp32`` are within 1e-4 of the same reference (its bf16
  weights are the trainer's, its arithmetic the same), under bf16 they carry the rounding;
- a mutant loop whose MegatronGRPO ignores the key (bf16-rounded logits) fails the fp32 bound.
"""

from __future__ import annotations

import pytest
import torch

from mp_grpo.config.precision import LogitDtype

FP32_MAX_ERROR = 1e-4
"""fp32 logits' largest log-prob error against float64 of the same bf16 operands (issue's CPU target)."""
ON_POLICY_RATIO_TOL = 1e-6
"""|ratio − 1| of the first, on-policy update: the forward-only and training passes' log-probs differ by fp32
reduction order at most."""

JOB = ("parallel.tensor_model_parallel_size=1", "parallel.sequence_format=padded", "train.steps=1",
       "train.num_microbatches=1", "train.micro_batch_size=8", "rollout.group_size=4", "task.completion_length=3",
       "output.progress_bar=false", "model.params_dtype=bf16", "model.cpu_logit_offset=16", "engine.dtype=bf16")


@pytest.fixture
def world_of_one(monkeypatch):
    """The loop starts a gloo world of one on a free port; the environment is restored and the group destroyed after."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@torch.no_grad()
def _exact_logprobs(policy: torch.nn.Module, mb) -> torch.Tensor:
    """float64 log-probs of ``mb.targets`` from the policy's own output-layer operands (its bf16 input and weight)."""
    captured = {}
    hook = policy.output_layer.register_forward_pre_hook(lambda module, args: captured.update(x=args[0]))
    try:
        policy(mb.input_ids, mb.position_ids)
    finally:
        hook.remove()
    logits = (captured["x"].double() @ policy.output_layer.weight.double().t()).transpose(0, 1)  # [B, S, V]
    target = torch.where(mb.loss_mask, mb.targets, torch.zeros_like(mb.targets))
    return torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0]


def _run(trainer: LogitDtype, engine: LogitDtype) -> dict:
    """One step; the largest errors of the old and rollout log-probs against float64, the logit scale, the metrics."""
    from mp_grpo.config.job import load_job_config
    from mp_grpo.train.__main__ import config_path
    from mp_grpo.train.loop import run

    cfg = load_job_config(config_path("cpu"), [*JOB, f"model.logit_dtype={trainer.value}", f"engine.logit_dtype={engine.value}"])
    held: dict = {}
    seen: dict = {}

    def take(micro) -> None:
        (mb,) = micro
        policy = held["trainer"].policy
        assert next(policy.parameters()).dtype == torch.bfloat16
        exact = _exact_logprobs(policy, mb)
        seen["old"] = float((mb.old_logprobs.double() - exact)[mb.loss_mask].abs().max())
        seen["rollout"] = float((mb.rollout_logprobs.double() - exact)[mb.loss_mask].abs().max())

    (record,) = run(cfg, on_rollout=take, on_trainer=lambda t: held.update(trainer=t))
    return {**seen, "metrics": record["metrics"]}


def test_each_logit_dtype_reaches_its_side(world_of_one) -> None:
    fp32 = _run(LogitDtype.FP32, LogitDtype.FP32)
    bf16 = _run(LogitDtype.BF16, LogitDtype.BF16)
    print(f"\nmax |Δ log-prob| vs float64 of the bf16 operands: trainer fp32 {fp32['old']:.2e}, bf16 {bf16['old']:.2e}; "
          f"engine fp32 {fp32['rollout']:.2e}, bf16 {bf16['rollout']:.2e}")
    assert fp32["old"] <= FP32_MAX_ERROR and fp32["rollout"] <= FP32_MAX_ERROR, fp32
    assert bf16["old"] > 100 * FP32_MAX_ERROR and bf16["rollout"] > 100 * FP32_MAX_ERROR, bf16
    for result in (fp32, bf16):  # the training pass computes the forward-only pass's log-probs: ratio 1 on-policy
        m = result["metrics"]
        assert abs(m["ratio/max"] - 1) <= ON_POLICY_RATIO_TOL and abs(m["ratio/min"] - 1) <= ON_POLICY_RATIO_TOL, m


def test_a_loop_that_drops_the_trainer_key_fails_the_fp32_bound(world_of_one, monkeypatch) -> None:
    from mp_grpo.train import loop

    original = loop.MegatronGRPO

    def ignoring_the_key(*args, logit_dtype=None, **kwargs):  # the mutant: bf16-rounded logits whatever the key
        return original(*args, logit_dtype=LogitDtype.BF16, **kwargs)

    monkeypatch.setattr(loop, "MegatronGRPO", ignoring_the_key)
    mutant = _run(LogitDtype.FP32, LogitDtype.FP32)
    assert mutant["old"] > FP32_MAX_ERROR and mutant["rollout"] <= FP32_MAX_ERROR, mutant
