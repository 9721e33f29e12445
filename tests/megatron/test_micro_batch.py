"""prepare_micro_batch (mp_grpo/megatron/micro_batch.py): the shift, padding and packing on one rank.

Context-parallel splitting is checked under torchrun in test_loss_func.py (against megatron-core's
``get_batch_on_this_cp_rank`` and, through the gradients, for packed sequences).
"""

from __future__ import annotations

import pytest
import torch

from mp_grpo.config.job import SequenceFormat
from mp_grpo.megatron import IGNORE_INDEX, prepare_micro_batch
from tests.megatron import helpers as H


def test_targets_are_the_next_token_where_trained() -> None:
    r = H.make_rollouts(4, seed=0)
    mb = prepare_micro_batch(r)
    b, s = mb.targets.shape
    assert s == int(r.lengths.max())  # padded to the longest sequence
    for i in range(b):
        for t in range(s):
            trained = t + 1 < r.seq_len and bool(r.loss_mask[i, t + 1])
            assert bool(mb.loss_mask[i, t]) == trained
            assert int(mb.targets[i, t]) == (int(r.tokens[i, t + 1]) if trained else IGNORE_INDEX)
            if trained:
                assert float(mb.old_logprobs[i, t]) == float(r.old_logprobs[i, t + 1])
                assert float(mb.rollout_logprobs[i, t]) == float(r.rollout_logprobs[i, t + 1])
    assert torch.equal(mb.input_ids, r.tokens[:, :s])
    assert mb.position_ids[0].tolist() == list(range(s))
    assert torch.equal(mb.advantages, r.advantages)


def test_packed_holds_the_same_tokens_as_padded() -> None:
    r = H.make_rollouts(6, seed=1)
    padded = prepare_micro_batch(r)
    packed = prepare_micro_batch(r, sequence_format=SequenceFormat.PACKED)
    assert packed.input_ids.shape[0] == 1 and packed.packed_seq_params is not None
    cu = packed.packed_seq_params.cu_seqlens_q_padded.tolist()
    for i, n in enumerate(r.lengths.tolist()):
        row = slice(cu[i], cu[i] + n)
        assert torch.equal(packed.input_ids[0, row], padded.input_ids[i, :n])
        assert torch.equal(packed.targets[0, row], padded.targets[i, :n])
        assert torch.equal(packed.loss_mask[0, row], padded.loss_mask[i, :n])
        assert packed.position_ids[0, row].tolist() == list(range(n))
    assert int(packed.loss_mask.sum()) == int(padded.loss_mask.sum())
    assert packed.sequences.num_sequences(packed.targets.shape) == 6


def test_fixed_length_and_sequence_parallel_padding() -> None:
    r = H.make_rollouts(2, seed=2)
    mb = prepare_micro_batch(r, seq_len=30, sequence_parallel_size=4)
    assert mb.input_ids.shape[1] == 32  # 30 rounded up to a multiple of the SP size
    with pytest.raises(ValueError, match="seq_len .* shorter than the longest"):
        prepare_micro_batch(r, seq_len=int(r.lengths.max()) - 1)
    with pytest.raises(ValueError, match="seq_len is only used by the padded format"):
        prepare_micro_batch(r, sequence_format=SequenceFormat.PACKED, seq_len=32)


@pytest.mark.parametrize("sequence_format", [SequenceFormat.PADDED, SequenceFormat.PACKED])
def test_token_field_follows_the_layout(sequence_format: SequenceFormat) -> None:
    """A field as wide as the rollouts (wider than the micro-batch's longest sequence) lands like the others."""
    r = H.make_rollouts(4, seed=3)
    mb = prepare_micro_batch(r, sequence_format=sequence_format)
    wide = torch.cat([r.tokens, r.tokens[:, :5]], dim=1)  # wider than any row the layout holds
    noise = torch.arange(wide.numel(), dtype=torch.float32).view_as(wide)
    local = mb.layout.target_field(noise, 0.0)
    shifted_old = mb.layout.target_field(r.old_logprobs, 0.0)
    assert local.shape == mb.targets.shape
    assert torch.equal(shifted_old, mb.old_logprobs)


def test_with_logprobs_checks_the_shape() -> None:
    mb = prepare_micro_batch(H.make_rollouts(2, seed=4))
    with pytest.raises(ValueError, match="old_logprobs must have the local shape"):
        mb.with_logprobs(old_logprobs=torch.zeros(3))
    updated = mb.with_logprobs(rollout_logprobs=torch.zeros_like(mb.targets, dtype=torch.float32))
    assert torch.equal(updated.rollout_logprobs, torch.zeros_like(mb.targets, dtype=torch.float32))
    assert updated.old_logprobs is mb.old_logprobs


def test_to_moves_the_packed_boundaries_of_the_loss_layout() -> None:
    """No host-to-device copy of cu_seqlens inside the loop: MicroBatch.to moves the loss layout's too."""
    from mp_grpo.loss.sequence import PackedSequences
    from tests.megatron import helpers as H

    mb = prepare_micro_batch(H.make_rollouts(4, seed=2), sequence_format="packed")
    moved = mb.to("meta")
    assert isinstance(moved.sequences, PackedSequences)
    assert moved.sequences.cu_seqlens.device.type == "meta"
    assert moved.packed_seq_params.cu_seqlens_q.device.type == "meta"
