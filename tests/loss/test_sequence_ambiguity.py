"""Per-sequence or per-token: flat packed tokens ``[T]`` with as many tokens as sequences (T = S).

The context-parallel property test (tests/loss/test_properties_cp.py) found the loss silently wrong — 0.29 to 1.97
off the one-call loss, on both backends — on packed micro-batches whose segments were empty but for one: under
CP = 2 a rank holds half of each segment padded to 2·CP, so two sequences of lengths [0, 1] leave it T = 2 token
positions for S = 2 sequences. Given flat ``[T]`` tokens, an ``[S]`` advantage then has the token shape, and the loss
read the sequences' advantages as the tokens' (row 0's advantage on row 1's token). No rule can tell the two apart
from the shapes, so the call is refused, naming the argument; ``[1, T]`` tokens (Megatron's THD shape, what
``MegatronGRPO`` and the integrations pass) are never ambiguous and give the one-call result.
"""

from __future__ import annotations

import pytest
import torch

from mp_grpo.config import load_config
from mp_grpo.loss import GlobalBatch, GRPOLoss, LossBackend, PackedSequences
from tests.distributed import torchrun, worker_main
from tests.reference import grpo_objective_reference
from tests.tolerances import assert_close

BACKENDS = [LossBackend.TORCH, LossBackend.TRITON]
CONFIG = {"policy": {"objective": "gmpo", "eps_low": 0.4, "eps_high": 0.2, "log_ratio_clamp": None},
          "aggregation": {"mode": "seq_mean_token_sum", "count_empty_sequences": True},
          "rollout_correction": {"bypass": True}}
"""The shrunk draw of ``MP_GRPO_CP_SEED=11``: the sequence-level GMPO ratio and the empty sequence's count show a
misread advantage in the loss, the gradient and the metrics."""


def _inputs(gen: torch.Generator, num_tokens: int) -> dict[str, torch.Tensor]:
    lp = -torch.rand(num_tokens, generator=gen, dtype=torch.float64) - 0.05
    return {"logprobs": lp, "rollout_logprobs": lp + 0.1 * torch.randn(num_tokens, generator=gen, dtype=torch.float64)}


def test_flat_tokens_as_many_as_sequences_are_refused_naming_the_argument() -> None:
    cfg = load_config(CONFIG)
    layout = PackedSequences(torch.tensor([0, 0, 2]))  # an empty segment, then one of two positions: T = S = 2
    x = _inputs(torch.Generator().manual_seed(0), 2)
    mask = torch.tensor([True, False])
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=r"advantages has shape \(2,\): both one per sequence .* \[1, T\]"):
            GRPOLoss(cfg, backend=backend)(x["logprobs"], None, torch.randn(2), mask,
                                           rollout_logprobs=x["rollout_logprobs"], layout=layout)
    with pytest.raises(ValueError, match=r"positive has shape \(2,\): both one per sequence"):
        layout.is_per_sequence(torch.Size([2]), torch.Size([2]), "positive")
    assert layout.is_per_sequence(torch.Size([2]), torch.Size([1, 2]), "positive")
    assert not layout.is_per_sequence(torch.Size([1, 2]), torch.Size([1, 2]), "positive")
    skip = load_config(None, ["nonfinite.skip_step=true"])
    with pytest.raises(ValueError, match=r"advantages\[0\] has shape \(2,\): both one per sequence"):
        GlobalBatch.from_rollouts(skip, [mask], old_logprobs=[x["logprobs"]], rollout_logprobs=[x["rollout_logprobs"]],
                                  advantages=[torch.randn(2)], layouts=[layout])


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.value)
def test_one_row_tokens_give_the_padded_result(backend: LossBackend) -> None:
    """The same micro-batch as ``[1, T]``: the loss and gradient of the padded batch's float64 reference."""
    cfg = load_config(CONFIG)
    gen = torch.Generator().manual_seed(1)
    x = _inputs(gen, 2)
    adv = torch.randn(2, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[True, False]])
    lp = x["logprobs"].view(1, 2).clone().requires_grad_()
    loss, _ = GRPOLoss(cfg, backend=backend)(lp, None, adv, mask, rollout_logprobs=x["rollout_logprobs"].view(1, 2),
                                             layout=PackedSequences(torch.tensor([0, 0, 2])))
    upstream = torch.tensor(0.7, dtype=torch.float64)
    (loss * upstream).backward()
    # padded: row 0 empty, row 1 the one token
    ref_lp = torch.stack([torch.zeros(2, dtype=torch.float64), x["logprobs"]]).requires_grad_()
    ref_roll = torch.stack([torch.zeros(2, dtype=torch.float64), x["rollout_logprobs"]])
    ref_mask = torch.tensor([[False, False], [True, False]])
    want = grpo_objective_reference(cfg, ref_lp, None, adv, ref_mask, rollout_logprobs=ref_roll)
    (want * upstream).backward()
    assert_close(loss.detach(), want.detach(), torch.float64, "loss")
    assert_close(lp.grad[0], ref_lp.grad[1], torch.float64, "d/dlogprobs")


def test_context_parallel_empty_segments() -> None:
    """CP = 2 under torchrun: the issue's layouts, both backends — refused as ``[T]``, the one-call result as
    ``[1, T]``."""
    torchrun(__file__, "case_context_parallel_empty_segments", nproc=2)


# ----------------------------------------------------------------------------------------------- worker
def _cp_positions(length: int, cp: int, rank: int) -> torch.Tensor:
    chunk = length // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def case_context_parallel_empty_segments() -> None:
    import torch.distributed as dist

    cp, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    cfg = load_config(CONFIG)
    for backend in BACKENDS:
        for lengths in ([0, 1], [0, 0, 0, 1], [0, 2, 0, 1]):
            gen = torch.Generator().manual_seed(len(lengths))
            S, W = len(lengths), 2 * cp
            full = {k: v.view(S, W) for k, v in _inputs(gen, S * W).items()}
            adv = torch.randn(S, generator=gen, dtype=torch.float64)
            full_mask = torch.arange(W).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
            segments = [W if n else 0 for n in lengths]  # each padded to 2·CP; an empty sequence has no positions
            rows = torch.cat([torch.full((s,), b) for b, s in enumerate(segments)])
            cols = torch.cat([torch.arange(s) for s in segments])
            mine = torch.cat([_cp_positions(s, cp, rank) + o for s, o in
                              zip(segments, torch.tensor([0, *segments]).cumsum(0).tolist())])
            r, c = rows[mine], cols[mine]
            bounds = torch.tensor([0, *segments]).cumsum(0) // cp
            layout = PackedSequences(bounds, group)
            local = {k: v[r, c] for k, v in full.items()}
            mask = full_mask[r, c]
            loss_fn = GRPOLoss(cfg, backend=backend)
            if mask.numel() == S:  # flat [T] with T = S: refused on every rank
                with pytest.raises(ValueError, match="advantages has shape"):
                    loss_fn(local["logprobs"], None, adv, mask, rollout_logprobs=local["rollout_logprobs"],
                            layout=layout)
            lp = local["logprobs"].view(1, -1).clone().requires_grad_()
            batch = GlobalBatch.from_rollouts(cfg, [mask.view(1, -1)], old_logprobs=[lp.detach()],
                                              rollout_logprobs=[local["rollout_logprobs"].view(1, -1)],
                                              group=group, layouts=[layout])
            share, _ = loss_fn(lp, None, adv, mask.view(1, -1), rollout_logprobs=local["rollout_logprobs"].view(1, -1),
                               batch=batch, layout=layout)
            share.backward()
            total = share.detach().clone()
            dist.all_reduce(total)
            grad = torch.zeros(S, W, dtype=torch.float64)
            grad[r, c] = lp.grad.view(-1)
            dist.all_reduce(grad)
            ref_lp = full["logprobs"].clone().requires_grad_()
            want = grpo_objective_reference(cfg, ref_lp, None, adv, full_mask, rollout_logprobs=full["rollout_logprobs"])
            want.backward()
            what = f"{backend.value} lengths {lengths}"
            assert_close(total, want.detach(), torch.float64, f"{what}: loss")
            assert_close(torch.where(full_mask, grad, 0.0), ref_lp.grad, torch.float64, f"{what}: d/dlogprobs")


if __name__ == "__main__":
    worker_main({"case_context_parallel_empty_segments": case_context_parallel_empty_segments})
