"""Shared by the CPU and GPU batch-invariance tests: run probe rows inside batches of other rows and
compare their log-prob, entropy and gradient bit for bit with the probe rows run alone."""

from __future__ import annotations

import torch

from mp_grpo import vocab_parallel_logprobs
from mp_grpo.ops import SamplingFilter


def run_rows(logits, target, g_lp, g_ent, *, filt: SamplingFilter | None, shape=None):
    """(log-prob, entropy, gradient) of ``logits`` [N, V] viewed as ``shape`` + [V]; flattened to rows."""
    n, v = logits.shape
    x = logits.reshape(*(shape or (n,)), v).clone().requires_grad_()
    t = target.reshape(shape or (n,))
    lp, ent = vocab_parallel_logprobs(x, t, with_entropy=True, sampling_filter=filt, check_inputs=False)
    finite = torch.isfinite(lp)
    upstream = (lp.where(finite, 0.0) * g_lp.reshape(lp.shape)).sum() + (ent * g_ent.reshape(ent.shape)).sum()
    upstream.backward()
    return lp.detach().reshape(n), ent.detach().reshape(n), x.grad.reshape(n, v)


def assert_batch_invariant(
    vocab: int, dtype: torch.dtype, device: str, batch_sizes, *, filt: SamplingFilter | None, seed: int = 0,
    probes: int = 3, leading_shapes=(),
) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool_rows = max(batch_sizes)
    pool = (torch.randn(pool_rows, vocab, generator=gen) * 3).to(dtype).to(device)
    pool_target = torch.randint(0, vocab, (pool_rows,), generator=gen).to(device)
    pool_target[pool_target.argmax()] = -100  # an ignored row among them
    pool_g_lp = torch.randn(pool_rows, generator=gen).to(device)
    pool_g_ent = torch.randn(pool_rows, generator=gen).to(device)
    # The probes' targets are their argmax: inside any filter's kept set.
    probe_ids = list(range(probes))
    pool_target[probe_ids] = pool[probe_ids].argmax(-1)

    alone = [run_rows(pool[i : i + 1], pool_target[i : i + 1], pool_g_lp[i : i + 1], pool_g_ent[i : i + 1], filt=filt)
             for i in probe_ids]
    for n in batch_sizes:
        # Probes at random positions among other pool rows.
        others = torch.randperm(pool_rows - probes, generator=gen)[: max(n - probes, 0)] + probes
        order = torch.cat([torch.tensor(probe_ids[: min(probes, n)]), others])
        perm = torch.randperm(n, generator=gen)
        rows = order[perm].to(device)
        shapes = [None] + [s for s in leading_shapes if torch.Size(s).numel() == n]
        for shape in shapes:
            lp, ent, grad = run_rows(pool[rows], pool_target[rows], pool_g_lp[rows], pool_g_ent[rows], filt=filt,
                                     shape=shape)
            for i in probe_ids[: min(probes, n)]:
                pos = int((rows == i).nonzero()[0])
                lp1, ent1, grad1 = alone[i]
                where = f"probe {i} at row {pos} of {n}, shape {shape}"
                assert torch.equal(lp[pos], lp1[0]), f"log-prob differs: {where}"
                assert torch.equal(ent[pos], ent1[0]), f"entropy differs: {where}"
                assert torch.equal(grad[pos], grad1[0]), f"gradient differs: {where}"
