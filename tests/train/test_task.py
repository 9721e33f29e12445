"""The learning job's task (mp_grpo/train/task.py): prompts keyed by (seed, step), the exact checker, advantages."""

from __future__ import annotations

import torch

from mp_grpo.train.task import group_advantages, make_prompts, successor_reward


def test_successor_reward_by_hand() -> None:
    # prompt lengths 2 and 1; completions of 3 tokens mod 5
    tokens = torch.tensor([[3, 4, 0, 1, 2],     # 4 -> 0 -> 1 -> 2: all right
                           [4, 0, 3, 1, 0]])    # 4 -> 0 right, 0 -> 3 wrong, 3 -> 1 wrong; trailing token not scored
    reward = successor_reward(tokens, torch.tensor([2, 1]), completion_length=3, modulus=5)
    assert torch.equal(reward, torch.tensor([1.0, 1 / 3], dtype=torch.float32))


def test_prompts_are_keyed_and_in_range() -> None:
    a, la = make_prompts(num_prompts=50, min_length=1, max_length=4, modulus=7, seed=3, step=2)
    b, lb = make_prompts(num_prompts=80, min_length=1, max_length=4, modulus=7, seed=3, step=2)
    assert torch.equal(a, b[:50]) and torch.equal(la, lb[:50])  # prompt i does not depend on the batch size
    assert int(la.min()) >= 1 and int(la.max()) <= 4 and len(set(la.tolist())) == 4
    assert int(a.max()) < 7 and int(a.min()) >= 0
    c, _ = make_prompts(num_prompts=50, min_length=1, max_length=4, modulus=7, seed=3, step=3)
    assert not torch.equal(a, c)


def test_group_advantages() -> None:
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.5, 0.2, 0.2, 0.2, 0.2])
    adv = group_advantages(rewards, group_size=4, eps=1e-6)
    g = rewards[:4]
    assert torch.allclose(adv[:4], (g - g.mean()) / (g.std(unbiased=False) + 1e-6))
    assert adv[4:].tolist() == [0.0] * 4  # equal rewards: advantage 0, not 0/0
