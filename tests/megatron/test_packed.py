"""THD packing (mp_grpo/megatron/packed.py): boundaries, padding, pack / unpack."""

from __future__ import annotations

import pytest
import torch

from mp_grpo.megatron.packed import PackedLayout, packed_seq_params, round_up


def test_boundaries_and_padding() -> None:
    layout = PackedLayout.build(torch.tensor([3, 5, 2]), segment_multiple=4, total_multiple=16)
    assert layout.cu_seqlens.tolist() == [0, 3, 8, 10]
    # 3 -> 4, 5 -> 8, 2 -> 4 (16 in all: already a multiple of 16)
    assert layout.cu_seqlens_padded.tolist() == [0, 4, 12, 16]
    assert layout.cu_seqlens.dtype == torch.int32 and layout.total == 16 and layout.max_seqlen == 8
    wider = PackedLayout.build(torch.tensor([3, 5, 2]), segment_multiple=4, total_multiple=24)
    assert wider.cu_seqlens_padded.tolist() == [0, 4, 12, 24]  # the last segment takes the extra padding


def test_pack_unpack_round_trip() -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 7, 1, 5])
    x = torch.randn(4, 7, 2, generator=gen)
    layout = PackedLayout.build(lengths, segment_multiple=2)
    packed = layout.pack(x, fill=float("nan"))
    assert packed.shape == (layout.total, 2)
    for b in range(4):
        start, n = int(layout.cu_seqlens_padded[b]), int(lengths[b])
        assert torch.equal(packed[start : start + n], x[b, :n])
        pad = int(layout.padded_lengths[b]) - n
        assert torch.isnan(packed[start + n : start + n + pad]).all()
    back = layout.unpack(packed, 7, fill=0.0)
    inside = torch.arange(7).unsqueeze(0) < lengths.unsqueeze(1)
    assert torch.equal(back[inside], x[inside])
    assert (back[~inside] == 0).all()


def test_packed_seq_params_is_megatron_thd() -> None:
    layout = PackedLayout.build(torch.tensor([3, 5]), segment_multiple=2)
    params = packed_seq_params(layout)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 3, 8] and params.cu_seqlens_q_padded.tolist() == [0, 4, 10]
    assert params.max_seqlen_q == 6


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="lengths must all be ≥ 1"):
        PackedLayout.build(torch.tensor([3, 0]))
    with pytest.raises(ValueError, match="lengths must be a 1-D integer"):
        PackedLayout.build(torch.tensor([3.0]))
    with pytest.raises(ValueError, match="total_multiple"):
        PackedLayout.build(torch.tensor([3]), segment_multiple=4, total_multiple=6)
    layout = PackedLayout.build(torch.tensor([3, 5]))
    with pytest.raises(ValueError, match="exceed the padded sequence length"):
        layout.pack(torch.zeros(2, 4), fill=0)
    with pytest.raises(ValueError, match=r"\[B=2, S, ...\]"):
        layout.pack(torch.zeros(3, 8), fill=0)
    assert round_up(5, 4) == 8 and round_up(8, 4) == 8
