"""fused_linear_logprobs with the output layer sharded over TP = 2 ranks (torchrun, gloo).

Every rank draws the same full inputs from a shared seed and keeps its rows of the weight. The
gradient w.r.t. ``hidden`` that the op returns is this rank's partial sum; the tests check the op's
contract with Megatron's mappings, which sum it exactly as for ColumnParallelLinear:

- summed over the ranks, it equals the float64 reference;
- sequence parallelism off: through megatron-core's ``copy_to_tensor_model_parallel_region``, the
  same gradients as megatron-core's ``ColumnParallelLinear`` followed by the logits path;
- sequence parallelism on: each rank holds ``[S/TP, B, H]``; all-gather forward and reduce-scatter
  backward (what ``gather_from_sequence_parallel_region`` does — megatron-core's own allocates CUDA
  buffers, so a gloo version stands in for it here) give each rank its slice of the reference gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.distributed import torchrun, worker_main

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _full_case(seed: int, shape: tuple[int, ...], hidden_size: int, vocab: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=gen).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * (2.0 / hidden_size**0.5)).to(dtype)
    target = torch.randint(0, vocab, shape, generator=gen)
    target.view(-1)[1] = -100
    g_lp = torch.randn(shape, generator=gen)
    g_ent = torch.randn(shape, generator=gen)
    return hidden, weight, target, g_lp, g_ent


def _rows(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous block of the first dimension."""
    size = x.shape[0] // world
    return x[rank * size : (rank + 1) * size]


def _assert_sum_close(actual, expected, dtype, msg):
    """As in test_fused_linear_logprobs: sums of rounded terms are compared on their largest entry."""
    from tests.tolerances import assert_close

    scale = expected.detach().abs().max().item()
    assert scale > 0, msg
    assert_close(actual.detach().double() / scale, expected.detach().double() / scale, dtype, msg)


def _reference(hidden, weight, target, g_lp, g_ent, *, temperature, dtype):
    """Float64 values and full gradients (``weight`` is the whole output layer)."""
    from tests.reference import linear_logprobs_reference

    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    lp, ent = linear_logprobs_reference(h, w, target, temperature=temperature, logits_dtype=dtype)
    ((lp * g_lp.double()).sum() + (ent * g_ent.double()).sum()).backward()
    return lp, ent, h.grad, w.grad


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 forward, reduce-scatter backward: Megatron's sequence-parallel gather."""

    @staticmethod
    def forward(ctx, x):
        world = dist.get_world_size()
        out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype)
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        total = grad.contiguous().clone()
        dist.all_reduce(total)  # gloo has no reduce-scatter: all-reduce, then keep this rank's rows
        return _rows(total, dist.get_rank(), dist.get_world_size()).clone()


# ----------------------------------------------------------------------------- worker cases
def case_matches_reference(dtype: str, temperature: float, chunk_tokens: int | None, chunk_vocab: int | None) -> None:
    from mp_grpo import fused_linear_logprobs
    from tests.tolerances import assert_close

    rank, world = dist.get_rank(), dist.get_world_size()
    dt = DTYPES[dtype]
    hidden, weight, target, g_lp, g_ent = _full_case(7, (11,), 16, 23 * world, dt)
    h = hidden.clone().requires_grad_()
    w = _rows(weight, rank, world).clone().requires_grad_()
    lp, ent = fused_linear_logprobs(
        h, w, target, tp_group=dist.group.WORLD, temperature=temperature, with_entropy=True,
        chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab,
    )
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    lp_ref, ent_ref, gh_ref, gw_ref = _reference(hidden, weight, target, g_lp, g_ent, temperature=temperature, dtype=dt)
    tag = f"rank {rank}, {dtype}, T={temperature}, chunks ({chunk_tokens}, {chunk_vocab})"
    assert_close(lp, lp_ref, torch.float32, f"logprobs {tag}")
    assert_close(ent, ent_ref, torch.float32, f"entropy {tag}")
    _assert_sum_close(w.grad, _rows(gw_ref, rank, world), dt, f"grad weight shard {tag}")
    partial = h.grad.clone()
    dist.all_reduce(partial)  # what the mapping's backward does
    _assert_sum_close(partial, gh_ref, dt, f"grad hidden summed over ranks {tag}")


def case_matches_megatron_column_parallel(tp: int) -> None:
    """Sequence parallelism off: the mapping + this op == ColumnParallelLinear + the logits path."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mp_grpo import fused_linear_logprobs, vocab_parallel_logprobs
    from tests.tolerances import assert_close

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        rank = parallel_state.get_tensor_model_parallel_rank()
        hidden, weight, target, g_lp, g_ent = _full_case(11, (5, 3), 16, 20 * tp, torch.float32)  # [S, B, H]
        config = TransformerConfig(
            num_layers=1, hidden_size=16, num_attention_heads=tp, use_cpu_initialization=True,
            tensor_model_parallel_size=tp, params_dtype=torch.float32,
        )
        layer = tensor_parallel.ColumnParallelLinear(
            16, 20 * tp, config=config, init_method=torch.nn.init.zeros_, bias=False, gather_output=False,
            tp_group=group,
        )
        with torch.no_grad():
            layer.weight.copy_(_rows(weight, rank, tp))

        theirs_h = hidden.clone().requires_grad_()
        logits, _ = layer(theirs_h)
        lp, ent = vocab_parallel_logprobs(logits, target, tp_group=group, with_entropy=True)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()

        ours_h = hidden.clone().requires_grad_()
        ours_w = _rows(weight, rank, tp).clone().requires_grad_()
        mapped = tensor_parallel.copy_to_tensor_model_parallel_region(ours_h, group=group)
        lp2, ent2 = fused_linear_logprobs(mapped, ours_w, target, tp_group=group, with_entropy=True, chunk_tokens=4)
        ((lp2 * g_lp).sum() + (ent2 * g_ent).sum()).backward()

        assert_close(lp2, lp, torch.float32, f"logprobs vs ColumnParallelLinear rank {rank}")
        assert_close(ent2, ent, torch.float32, f"entropy vs ColumnParallelLinear rank {rank}")
        _assert_sum_close(ours_h.grad, theirs_h.grad, torch.float32, f"grad hidden (all-reduced) rank {rank}")
        _assert_sum_close(ours_w.grad, layer.weight.grad, torch.float32, f"grad weight rank {rank}")
    finally:
        parallel_state.destroy_model_parallel()


def case_sequence_parallel(dtype: str) -> None:
    """Sequence parallelism on: local [S/TP, B, H] in, gathered, and the reduce-scattered gradient out."""
    from mp_grpo import fused_linear_logprobs

    rank, world = dist.get_rank(), dist.get_world_size()
    dt = DTYPES[dtype]
    hidden, weight, target, g_lp, g_ent = _full_case(13, (6, 2), 16, 19 * world, dt)  # [S, B, H], S % TP == 0
    local = _rows(hidden, rank, world).clone().requires_grad_()
    w = _rows(weight, rank, world).clone().requires_grad_()
    lp, ent = fused_linear_logprobs(
        _GatherSequence.apply(local), w, target, tp_group=dist.group.WORLD, with_entropy=True, chunk_vocab=7
    )
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    _, _, gh_ref, gw_ref = _reference(hidden, weight, target, g_lp, g_ent, temperature=1.0, dtype=dt)
    _assert_sum_close(local.grad, _rows(gh_ref, rank, world), dt, f"grad of this rank's sequence slice, rank {rank}")
    _assert_sum_close(w.grad, _rows(gw_ref, rank, world), dt, f"grad weight shard, rank {rank}")


def case_unequal_shards() -> None:
    from mp_grpo import fused_linear_logprobs

    rank = dist.get_rank()
    weight = torch.randn(10 + rank, 8)  # rank 1 holds one more row
    try:
        fused_linear_logprobs(torch.randn(4, 8), weight, torch.zeros(4, dtype=torch.long), tp_group=dist.group.WORLD)
    except ValueError as err:
        assert "differ in size" in str(err) and "[10, 11]" in str(err), err
    else:
        raise AssertionError("unequal vocabulary shards were not detected")


def case_all(tp: int) -> None:
    """Everything in one launch (a torchrun start costs seconds on 2 cores)."""
    for dtype, temperature, chunk_tokens, chunk_vocab in [
        ("float32", 0.8, None, None),
        ("float32", 1.0, 4, 5),
        ("bfloat16", 1.3, 3, None),
        ("bfloat16", 1.0, None, 6),
    ]:
        case_matches_reference(dtype, temperature, chunk_tokens, chunk_vocab)
    case_matches_megatron_column_parallel(tp)
    case_sequence_parallel("float32")
    case_sequence_parallel("bfloat16")
    case_unequal_shards()


# ----------------------------------------------------------------------------- pytest entry point
def test_tp2_matches_reference_megatron_and_sequence_parallel():
    torchrun(__file__, "case_all", 2, tp=2)


if __name__ == "__main__":
    worker_main({name: fn for name, fn in globals().items() if name.startswith("case_")})
