"""vocab_parallel_logprobs with the vocabulary sharded over TP = 2 and TP = 4 ranks (torchrun, gloo).

Every rank draws the same full-vocabulary inputs from a shared seed, keeps its contiguous shard, and
checks values and its shard's gradient against the float64 reference and against megatron-core's
``vocab_parallel_cross_entropy``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import torchrun, worker_main

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _full_case(seed: int, rows: int, vocab: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    logits[0, :] = 1e4  # an extreme row whose maximum is on every shard
    target = torch.randint(0, vocab, (rows,), generator=gen)
    target[1] = -100
    filtered = torch.rand(rows, vocab, generator=gen) < 0.3
    filtered[:, :] &= torch.arange(rows).unsqueeze(1) == 2  # row 2: a filtered vocabulary
    filtered[2, target[2]] = False
    logits = torch.where(filtered, torch.tensor(float("-inf"), dtype=dtype), logits)
    g_lp = torch.randn(rows, generator=gen)
    g_ent = torch.randn(rows, generator=gen)
    return logits, target, g_lp, g_ent


def _shard(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    v_local = x.shape[-1] // world
    return x[..., rank * v_local : (rank + 1) * v_local]


# ----------------------------------------------------------------------------- worker cases
def case_matches_reference(dtype: str, with_entropy: bool, temperature: float) -> None:
    from mp_grpo import vocab_parallel_logprobs
    from tests.reference import logprobs_reference
    from tests.tolerances import assert_close

    rank, world = dist.get_rank(), dist.get_world_size()
    logits, target, g_lp, g_ent = _full_case(1234, rows=7, vocab=45 * world, dtype=DTYPES[dtype])
    shard = _shard(logits, rank, world).clone().requires_grad_()
    out = vocab_parallel_logprobs(
        shard, target, tp_group=dist.group.WORLD, temperature=temperature, with_entropy=with_entropy
    )
    lp, ent = out if with_entropy else (out, None)
    ref = logits.double().requires_grad_()
    lp_ref, ent_ref = logprobs_reference(ref, target, temperature=temperature)
    assert_close(lp, lp_ref, torch.float32, f"logprobs rank {rank}")
    loss, loss_ref = (lp * g_lp).sum(), (lp_ref * g_lp.double()).sum()
    if with_entropy:
        assert_close(ent, ent_ref, torch.float32, f"entropy rank {rank}")
        loss, loss_ref = loss + (ent * g_ent).sum(), loss_ref + (ent_ref * g_ent.double()).sum()
    loss.backward()
    loss_ref.backward()
    assert_close(shard.grad, _shard(ref.grad, rank, world), DTYPES[dtype], f"grad rank {rank}")


def case_matches_megatron(tp: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from mp_grpo import vocab_parallel_logprobs
    from tests.tolerances import assert_close

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        rank = parallel_state.get_tensor_model_parallel_rank()
        gen = torch.Generator().manual_seed(99)
        logits = torch.randn(5, 3, 32 * tp, generator=gen) * 2  # Megatron's [S, B, V] layout
        target = torch.randint(0, 32 * tp, (5, 3), generator=gen)
        g = torch.randn(5, 3, generator=gen)

        ours = _shard(logits, rank, tp).clone().requires_grad_()
        lp = vocab_parallel_logprobs(ours, target, tp_group=group)
        (lp * g).sum().backward()

        theirs = _shard(logits, rank, tp).clone().requires_grad_()
        ce = vocab_parallel_cross_entropy(theirs, target)
        (-ce * g).sum().backward()

        assert_close(lp, -ce.detach(), torch.float32, "logprobs vs megatron-core CE")
        assert_close(ours.grad, theirs.grad, torch.float32, "grad vs megatron-core CE")
    finally:
        parallel_state.destroy_model_parallel()


def case_unequal_shards() -> None:
    from mp_grpo import vocab_parallel_logprobs

    rank = dist.get_rank()
    shard = torch.randn(4, 10 + rank)  # rank 1 holds one more column
    try:
        vocab_parallel_logprobs(shard, torch.zeros(4, dtype=torch.long), tp_group=dist.group.WORLD)
    except ValueError as err:
        assert "differ in size" in str(err) and "[10, 11]" in str(err), err
    else:
        raise AssertionError("unequal vocabulary shards were not detected")
    lp, ent = vocab_parallel_logprobs(
        shard, torch.zeros(4, dtype=torch.long), tp_group=dist.group.WORLD, with_entropy=True, check_inputs=False
    )
    assert torch.isnan(lp).all() and torch.isnan(ent).all(), "unchecked unequal shards must poison every output"


def case_target_range_is_global() -> None:
    """A target owned by the last rank is valid everywhere; one past V_global is an error."""
    from mp_grpo import vocab_parallel_logprobs

    world = dist.get_world_size()
    shard = torch.randn(2, 8)
    lp = vocab_parallel_logprobs(shard, torch.tensor([8 * world - 1, 0]), tp_group=dist.group.WORLD)
    assert torch.isfinite(lp).all()
    try:
        vocab_parallel_logprobs(shard, torch.tensor([8 * world, 0]), tp_group=dist.group.WORLD)
    except ValueError as err:
        assert f"outside [0, {8 * world})" in str(err), err
    else:
        raise AssertionError("out-of-range target was not detected")


def case_all(tp: int) -> None:
    """Everything for one TP size in one launch (a torchrun start costs seconds on 2 cores)."""
    for dtype, with_entropy, temperature in [("float32", True, 0.8), ("bfloat16", True, 1.0), ("float32", False, 1.3)]:
        case_matches_reference(dtype, with_entropy, temperature)
    case_matches_megatron(tp)
    case_target_range_is_global()


# ----------------------------------------------------------------------------- pytest entry points
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_reference_and_megatron(tp):
    torchrun(__file__, "case_all", tp, tp=tp)


def test_tp_unequal_shards():
    torchrun(__file__, "case_unequal_shards", 2)


if __name__ == "__main__":
    worker_main({name: fn for name, fn in globals().items() if name.startswith("case_")})
