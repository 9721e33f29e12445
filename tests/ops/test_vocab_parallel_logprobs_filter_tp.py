"""vocab_parallel_logprobs with a sampling filter, the vocabulary sharded over TP = 2 / 4 ranks (torchrun, gloo).

Every rank draws the same full-vocabulary inputs, keeps its contiguous shard and checks values and its
shard's gradient against the float64 reference that filters the full softmax. Ties at the top-k
threshold are placed on different shards.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import torchrun, worker_main

FILTERS = [
    dict(top_k=6),
    dict(top_p=0.85),
    dict(top_k=15, top_p=0.7, min_p=0.02),
]


def _shard(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    v_local = x.shape[-1] // world
    return x[..., rank * v_local : (rank + 1) * v_local]


def _check_one(logits: torch.Tensor, target: torch.Tensor, filt: dict, temperature: float, gen: torch.Generator) -> None:
    from mp_grpo import vocab_parallel_logprobs
    from mp_grpo.ops import SamplingFilter
    from tests.reference import filtered_logprobs_reference
    from tests.tolerances import assert_close

    rank, world = dist.get_rank(), dist.get_world_size()
    shard = _shard(logits, rank, world).clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(
        shard, target, tp_group=dist.group.WORLD, temperature=temperature, with_entropy=True,
        sampling_filter=SamplingFilter(**filt),
    )
    ref = logits.double().requires_grad_()
    lp_ref, ent_ref = filtered_logprobs_reference(ref, target, temperature=temperature, **filt)
    assert_close(lp, lp_ref, torch.float32, f"logprobs {filt} rank {rank}")
    assert_close(ent, ent_ref, torch.float32, f"entropy {filt} rank {rank}")
    g_lp = torch.randn(lp.shape, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(lp.shape, generator=gen, dtype=torch.float64)
    ((lp.double() * g_lp).sum() + (ent.double() * g_ent).sum()).backward()
    ((lp_ref * g_lp).sum() + (ent_ref * g_ent).sum()).backward()
    assert_close(shard.grad, _shard(ref.grad, rank, world), logits.dtype, f"grad {filt} rank {rank}")


def case_all(tp: int) -> None:
    """Every filter, fp32 and bf16, per-row tensors and a cross-shard tie, in one launch."""
    from tests.reference import sampling_filter_keep_reference

    world = dist.get_world_size()
    assert world == tp
    vocab = 24 * world
    for dtype, filt in [(torch.float32, f) for f in FILTERS] + [(torch.bfloat16, FILTERS[-1])]:
        gen = torch.Generator().manual_seed(2024)
        logits = (torch.randn(5, vocab, generator=gen) * 2.5).to(dtype)
        keep = sampling_filter_keep_reference(logits, temperature=0.9, **filt)
        target = torch.multinomial(keep.double(), 1, generator=gen).squeeze(1)
        target[3] = -100
        _check_one(logits, target, filt, 0.9, gen)
    # Per-row tensors over an [S, B] leading shape.
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, vocab, generator=gen) * 2
    filt = dict(top_k=torch.tensor([[2, 0, 9], [vocab, 4, 1]]), top_p=torch.tensor([[0.9, 0.5, 1.0], [0.8, 0.99, 0.3]]))
    keep = sampling_filter_keep_reference(logits, **filt)
    target = torch.multinomial(keep.reshape(6, -1).double(), 1, generator=gen).reshape(2, 3)
    _check_one(logits, target, filt, 1.0, gen)
    # top-k tie across shards: the 4th largest value sits on every shard; k = 4 keeps all copies.
    logits = torch.randn(3, vocab, generator=gen) - 5
    logits[:, 0], logits[:, 1], logits[:, 2] = 3.0, 2.5, 2.0
    tie_cols = [r * (vocab // world) + 5 for r in range(world)]
    logits[:, tie_cols] = 1.0
    target = torch.tensor([tie_cols[-1], 0, tie_cols[0]])
    keep = sampling_filter_keep_reference(logits, top_k=4)
    assert int(keep[0].sum()) == 3 + world
    _check_one(logits, target, dict(top_k=4), 1.0, gen)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_filter_matches_reference(tp):
    torchrun(__file__, "case_all", tp, tp=tp)


if __name__ == "__main__":
    worker_main({name: fn for name, fn in globals().items() if name.startswith("case_")})
