"""fused_linear_loss with the output layer sharded over TP = 2 and 4 ranks (torchrun, gloo).

Every rank draws the same full inputs and keeps its rows of the weight; the loss (replicated on every TP
rank) and the gradients are compared with the float64 reference: the weight shard's gradient directly, the
hidden-state gradient after the sum over ranks that Megatron's input mapping makes. Upstream gradient g != 1,
several row chunks (one statistics all-gather per chunk), fp32 and bf16, with gradient-accumulation fusion.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import torchrun, worker_main


def case_all(tp: int) -> None:
    from mp_grpo.ops.fused_linear_loss import fused_linear_loss
    from tests.reference import linear_logprobs_reference
    from tests.tolerances import assert_close

    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == tp

    def rows(x):
        size = x.shape[0] // world
        return x[rank * size : (rank + 1) * size]

    def sum_close(actual, expected, dtype, msg):
        scale = expected.abs().max().item()
        assert scale > 0, msg
        assert_close(actual.detach().double() / scale, expected.detach().double() / scale, dtype, msg)

    for dtype, chunk_tokens, main_grad in [(torch.float32, 4, False), (torch.bfloat16, 3, True), (torch.float32, None, True)]:
        gen = torch.Generator().manual_seed(31)
        n, hidden_size, vocab = 11, 16, 9 * world
        hidden = torch.randn(n, hidden_size, generator=gen).to(dtype)
        weight = (torch.randn(vocab, hidden_size, generator=gen) * hidden_size**-0.5 * 2).to(dtype)
        target = torch.randint(0, vocab, (n,), generator=gen)
        target[2] = -100
        a, b = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        g = torch.tensor(1.7)

        def loss_fn(lp, ent):
            ratio = torch.exp(lp - lp.detach())
            return (-torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a) + 0.2 * lp**2).sum() - (b * ent).sum(), None

        h = hidden.clone().requires_grad_()
        w = torch.nn.Parameter(rows(weight).clone())
        if main_grad:
            w.main_grad = torch.zeros(w.shape)
            w.grad_added_to_main_grad = False
        loss, _ = fused_linear_loss(h, w, target, loss_fn, tp_group=dist.group.WORLD, with_entropy=True,
                                    chunk_tokens=chunk_tokens, accumulate_into_main_grad=main_grad)
        loss.backward(g)
        ref_h, ref_w = hidden.double().requires_grad_(), weight.double().requires_grad_()
        lp, ent = linear_logprobs_reference(ref_h, ref_w, target, logits_dtype=dtype)
        ref_loss, _ = loss_fn(lp, ent)
        (ref_loss * g.double()).backward()
        tag = f"rank {rank}/{world}, {dtype}, chunk_tokens {chunk_tokens}, main_grad {main_grad}"
        assert_close(loss, ref_loss, torch.float32, f"loss {tag}")
        sum_close(w.main_grad if main_grad else w.grad, rows(ref_w.grad), dtype, f"grad weight shard {tag}")
        partial = h.grad.float().clone()
        dist.all_reduce(partial)  # what Megatron's mapping does in backward
        sum_close(partial, ref_h.grad, dtype, f"grad hidden summed over ranks {tag}")


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_reference(tp: int) -> None:
    torchrun(__file__, "case_all", tp, tp=tp)


if __name__ == "__main__":
    worker_main({"case_all": case_all})
