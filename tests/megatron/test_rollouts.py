"""Rollouts validation (mp_grpo/megatron/rollouts.py): every bad field is named."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mp_grpo.megatron.rollouts import Rollouts
from tests.megatron import helpers as H


def _fields(**changes):
    r = H.make_rollouts(2, seed=0)
    values = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}
    values.update(changes)
    return values


@pytest.mark.parametrize(
    "name,value,match",
    [
        ("tokens", torch.zeros(2, 5), "rollouts.tokens must be an int64"),
        ("lengths", torch.tensor([1]), "rollouts.lengths must be an int64"),
        ("lengths", torch.tensor([0, 3]), r"rollouts.lengths must lie in \[1, S="),
        ("loss_mask", torch.ones(2, 3, dtype=torch.bool), "rollouts.loss_mask must be a bool"),
        ("advantages", torch.zeros(3), "rollouts.advantages must be a float"),
        ("rollout_logprobs", torch.zeros(2, 1), "rollouts.rollout_logprobs must be None or a float"),
        ("old_logprobs", torch.zeros(2, 2, dtype=torch.int64), "rollouts.old_logprobs"),
    ],
)
def test_bad_field_is_named(name, value, match) -> None:
    with pytest.raises(ValueError, match=match):
        Rollouts(**_fields(**{name: value}))


def test_mask_consistency() -> None:
    values = _fields()
    first = values["loss_mask"].clone()
    first[0, 0] = True
    with pytest.raises(ValueError, match="token 0"):
        Rollouts(**_fields(loss_mask=first))
    short = int(values["lengths"].argmin())
    length = int(values["lengths"][short])
    assert length < values["loss_mask"].shape[1], "the test data needs a sequence shorter than S"
    past_end = values["loss_mask"].clone()
    past_end[short, length:] = True
    with pytest.raises(ValueError, match="padding position"):
        Rollouts(**_fields(loss_mask=past_end))


def test_token_ids_against_the_vocabulary() -> None:
    r = H.make_rollouts(2, seed=1)
    r.validate(vocab_size=H.VOCAB)
    with pytest.raises(ValueError, match="outside \\[0, vocab_size=8\\)"):
        r.validate(vocab_size=8)


def test_select_rows() -> None:
    r = H.make_rollouts(4, seed=2)
    part = r.select(slice(1, 3))
    assert part.num_sequences == 2 and torch.equal(part.tokens, r.tokens[1:3])
    assert torch.equal(part.old_logprobs, r.old_logprobs[1:3])
