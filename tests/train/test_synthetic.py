"""The main job's synthetic rollout engine (mp_grpo/train/synthetic.py)."""

from __future__ import annotations

import pytest
import torch

from mp_grpo.config.job import RolloutConfig
from mp_grpo.train.synthetic import synthesize_rollouts


def test_groups_masks_and_advantages() -> None:
    cfg = RolloutConfig(group_size=4, prompt_min_length=3, prompt_max_length=9, completion_min_length=2,
                        completion_max_length=20, tool_mask_fraction=0.3, mismatch_std=0.1)
    batch = synthesize_rollouts(cfg, num_sequences=12, vocab_size=50, seed=5)
    r = batch.rollouts
    assert r.num_sequences == 12 and r.seq_len == int(r.lengths.max())
    trained = r.loss_mask.sum(1)
    assert bool((trained >= 1).all())  # the first completion token is never a tool token
    for g in range(3):
        rows = slice(4 * g, 4 * g + 4)
        prompt_len = int(r.loss_mask[4 * g].nonzero()[0])  # the first completion token is trained
        assert bool((r.tokens[rows, :prompt_len] == r.tokens[4 * g, :prompt_len]).all())  # one prompt per group
        assert bool((r.loss_mask[rows].float().argmax(1) == prompt_len).all())
        adv = r.advantages[rows]
        rewards = batch.rewards[rows]
        expected = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
        torch.testing.assert_close(adv, expected)
    # the reward is the share of trained tokens from the lower half of the vocabulary
    low = ((r.tokens < 25) & r.loss_mask).sum(1).float() / trained.float()
    torch.testing.assert_close(batch.rewards, low)
    assert bool((batch.mismatch_noise[~r.loss_mask] == 0).all())
    assert float(batch.mismatch_noise[r.loss_mask].std()) == pytest.approx(0.1, rel=0.3)


def test_tool_spans_are_excluded() -> None:
    with_tools = synthesize_rollouts(RolloutConfig(tool_mask_fraction=0.5), num_sequences=8, vocab_size=64, seed=1)
    without = synthesize_rollouts(RolloutConfig(tool_mask_fraction=0.0), num_sequences=8, vocab_size=64, seed=1)
    assert torch.equal(with_tools.rollouts.tokens, without.rollouts.tokens)
    assert bool((with_tools.rollouts.loss_mask <= without.rollouts.loss_mask).all())
    assert int(with_tools.rollouts.loss_mask.sum()) < int(without.rollouts.loss_mask.sum())


def test_same_seed_same_batch_and_group_check() -> None:
    a = synthesize_rollouts(RolloutConfig(), num_sequences=8, vocab_size=64, seed=3)
    b = synthesize_rollouts(RolloutConfig(), num_sequences=8, vocab_size=64, seed=3)
    assert torch.equal(a.rollouts.tokens, b.rollouts.tokens) and torch.equal(a.mismatch_noise, b.mismatch_noise)
    with pytest.raises(ValueError, match="multiple of rollout.group_size"):
        synthesize_rollouts(RolloutConfig(group_size=3), num_sequences=8, vocab_size=64, seed=3)
