"""Shared by the verl integration tests (single-process and torchrun workers): verl itself, a random mini-batch in
the form verl's ``ppo_loss`` reads, and one call of ``ppo_loss`` for a loss mode.

verl is imported only here, through :func:`require_verl`: without verl every test module skips, saying why (the
main CI stage has no verl; CI's verl stage installs verl 0.9.1 and runs them)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

VERL_MISSING = ("verl is not installed: the verl integration tests run in CI's verl stage (.ci/run: verl 0.9.1 "
                "with --no-deps and the few packages its loss module imports)")


def require_verl():
    """verl, or skip the calling test module saying why."""
    return pytest.importorskip("verl", reason=VERL_MISSING)


PROMPT = 3
"""Prompt tokens of every sequence (verl's no-padding slicing needs a non-empty prompt)."""


@dataclass
class VerlBatch:
    """A padded mini-batch of ``B`` sequences with responses of up to ``R`` tokens (fp32, as verl's engine)."""

    logprobs: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor
    entropy: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    token_weights: torch.Tensor
    """verl's token-level TIS weights: exp(old − rollout) truncated at 2, 0 on padding."""
    sequence_weights: torch.Tensor
    """verl's sequence-level weights: exp(Σ(old − rollout)) truncated at 2, broadcast, 0 on padding."""

    def rows(self, rows: slice) -> VerlBatch:
        return VerlBatch(*(getattr(self, f)[rows] for f in self.__dataclass_fields__))


def make_verl_batch(seed: int, lengths: list[int], R: int) -> VerlBatch:
    """Random rollouts: row b has ``lengths[b]`` response tokens; per-sequence advantages broadcast to tokens."""
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths)
    mask = torch.arange(R).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    logprobs = -torch.rand(B, R, generator=gen) * 3 - 0.05
    old = logprobs + 0.15 * torch.randn(B, R, generator=gen)
    rollout = old + 0.1 * torch.randn(B, R, generator=gen)
    ref = logprobs + 0.3 * torch.randn(B, R, generator=gen)
    entropy = torch.rand(B, R, generator=gen) * 2
    advantages = torch.randn(B, 1, generator=gen).expand(B, R).contiguous()
    zero = torch.zeros(())
    d = torch.where(mask, old - rollout, zero)
    token_weights = torch.where(mask, d.exp().clamp(max=2.0), zero)
    sequence_weights = torch.where(mask, d.sum(-1, keepdim=True).exp().clamp(max=2.0).expand(B, R), zero)
    return VerlBatch(logprobs, old, ref, entropy, advantages, mask, token_weights, sequence_weights)


def actor_config(loss_mode: str, **kwargs):
    """verl's ActorConfig with ``policy_loss.loss_mode=loss_mode``; ``policy_loss`` keys go under it."""
    from verl.workers.config import ActorConfig, PolicyLossConfig

    policy_keys = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")
    policy = {k: kwargs.pop(k) for k in policy_keys if k in kwargs}
    return ActorConfig(strategy="megatron", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                       policy_loss=PolicyLossConfig(loss_mode=loss_mode, **policy), **kwargs)


def run_ppo_loss(config, batch: VerlBatch, *, weights: str | None, batch_num_tokens: int | None,
                 global_batch_size: int | None, dp_size: int = 1, upstream: float = 1.0):
    """verl's ``ppo_loss`` on ``batch`` in verl's no-padding form: (loss, its metrics as floats, d(upstream·loss)
    / d log-probs, / d entropy). ``weights``: None, "token" or "sequence" (``rollout_is_weights``)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    B, R = batch.mask.shape
    lengths = batch.mask.sum(-1).tolist()
    leaf_lp = batch.logprobs.clone().requires_grad_()
    leaf_ent = batch.entropy.clone().requires_grad_()

    def flat(x: torch.Tensor) -> torch.Tensor:  # the model's output layout: prompt + response per sequence
        parts = []
        for b, n in enumerate(lengths):
            parts += [torch.zeros(PROMPT - 1), x[b, :n], torch.zeros(1)]
        return torch.cat(parts)

    attention = torch.cat([torch.ones(B, PROMPT, dtype=torch.long), batch.mask.long()], dim=1)
    fields = {"prompts": torch.zeros(B, PROMPT, dtype=torch.long), "responses": torch.zeros(B, R, dtype=torch.long),
              "attention_mask": attention, "response_mask": batch.mask.float(), "old_log_probs": batch.old,
              "advantages": batch.advantages, "ref_log_prob": batch.ref}
    if weights is not None:
        fields["rollout_is_weights"] = batch.token_weights if weights == "token" else batch.sequence_weights
    data = TensorDict(fields, batch_size=[B])
    tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
                         global_batch_size=global_batch_size)
    loss, metrics = ppo_loss(config, {"log_probs": flat(leaf_lp), "entropy": flat(leaf_ent)}, data)
    (loss * upstream).backward()
    values = {k: float(m.aggregate()) if hasattr(m, "aggregate") else float(m) for k, m in metrics.items()}
    grad_ent = torch.zeros_like(leaf_ent) if leaf_ent.grad is None else leaf_ent.grad
    return loss.detach(), values, leaf_lp.grad, grad_ent
