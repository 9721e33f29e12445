"""The sampling-filter replay at TP = 2 and 4 on GPUs (NCCL) against TP = 1 on the same logits. Skipped without
enough GPUs.

    python -m pytest tests/gpu/test_logprob_filter_tp.py -v -s

Every rank draws the same full bf16 logits — a trained policy's rows and flat rows (``tests/policy_logits.py``:
the candidates finish the first, top-p sends the second to the radix fallback, whose passes all-reduce their
histograms over the group) at V = 151936 and 18992 — and runs the filtered op on its vocabulary shard with the
group, and the same op at TP = 1 on the whole logits. Checked per filter (top-k 20 / 50, top-p 0.9 / 0.95, both):

- the kept sets: the raw-logit threshold of every row **bitwise** equal to TP = 1's (the kept set is every logit
  ≥ it, so equal thresholds are equal kept sets);
- the log-probs, the entropy and this shard's gradient equal to TP = 1's to fp32 rounding (``tests/tolerances``):
  the kept set's sums are the same terms added in another order — per shard, then merged in rank order — so a
  row's last bit may differ (``docs/kernel.md``, "Batch invariance": the bits depend on the TP size); the rows
  equal bit for bit are counted and printed.

:func:`tp_against_tp1` is also ``scripts/bench_logprob_filter.py``'s correctness check at full size under torchrun.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the worker processes run this file as a script

from tests.gpu.launch import init_nccl, torchrun, worker_main  # noqa: E402

FILTERS = [dict(top_k=20), dict(top_k=50), dict(top_p=0.9), dict(top_p=0.95), dict(top_k=50, top_p=0.95)]
ROWS = 96
"""Rows a case: half a policy's, half flat."""
TEMPERATURE = 0.9


def tp_against_tp1(logits: torch.Tensor, target: torch.Tensor, filt, group, *, temperature: float = 1.0,
                   seed: int = 7) -> dict:
    """The filtered op on this rank's shard of ``logits`` (``[N, V]``, the same on every rank of ``group``) against
    the op at TP = 1 on the whole of it: thresholds, log-probs, entropy, this shard's gradient (upstream gradients
    drawn from ``seed``). Returns the comparison (bitwise counts and largest differences)."""
    import torch.distributed as dist

    from mp_grpo import vocab_parallel_logprobs
    from mp_grpo.ops.sampling_filter import filter_threshold

    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    n, v = logits.shape
    v_local = v // tp
    cols = slice(rank * v_local, (rank + 1) * v_local)
    shard = logits[:, cols].contiguous().requires_grad_()
    whole = logits.clone().requires_grad_()
    inv_t = 1.0 / temperature
    tau = filter_threshold(shard.detach(), filt, target.shape, tp_group=group, inv_temperature=inv_t)
    tau1 = filter_threshold(whole.detach(), filt, target.shape, tp_group=None, inv_temperature=inv_t)
    lp, ent = vocab_parallel_logprobs(shard, target, tp_group=group, temperature=temperature, with_entropy=True,
                                      sampling_filter=filt, check_inputs=False)
    lp1, ent1 = vocab_parallel_logprobs(whole, target, temperature=temperature, with_entropy=True,
                                        sampling_filter=filt, check_inputs=False)
    gen = torch.Generator(device=logits.device).manual_seed(seed)
    g_lp = torch.randn(n, device=logits.device, generator=gen)
    g_ent = torch.randn(n, device=logits.device, generator=gen)
    torch.autograd.backward((lp, ent), (g_lp, g_ent))
    torch.autograd.backward((lp1, ent1), (g_lp, g_ent))
    grad1 = whole.grad[:, cols]

    def same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a == b) | (a.isnan() & b.isnan())

    def worst(a: torch.Tensor, b: torch.Tensor) -> float:
        finite = torch.isfinite(a) & torch.isfinite(b)
        diff = (a.detach().double() - b.detach().double()).abs()
        return float(diff.where(finite, 0.0).max()) if a.numel() else 0.0

    return {
        "rows": n,
        "tau_rows_bitwise": int(same(tau, tau1).sum()),
        "kept_per_row_mean": float((whole.detach().float() >= tau1[:, None]).sum(-1).float().mean()),
        "logprob_rows_bitwise": int(same(lp, lp1).sum()),
        "logprob_max_abs_diff": worst(lp, lp1),
        "entropy_rows_bitwise": int(same(ent, ent1).sum()),
        "entropy_max_abs_diff": worst(ent, ent1),
        "grad_bitwise_fraction": float(same(shard.grad, grad1).float().mean()),
        "grad_elements_different": int((~same(shard.grad, grad1)).sum()),
        "grad_max_abs_diff": worst(shard.grad.float(), grad1.float()),
        "_tensors": (lp, lp1, ent, ent1, shard.grad, grad1),
    }


# ------------------------------------------------------------------------------------------------ pytest
@pytest.mark.gpu
@pytest.mark.parametrize("tp", [2, 4])
def test_filter_at_tp_equals_tp1(tp: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPUs")
    print(torchrun(__file__, "case_filters", tp))


# ------------------------------------------------------------------------------------------------ worker
def case_filters(vocab: tuple[int, ...] = (151936, 18992), rows: int = ROWS) -> None:
    import torch.distributed as dist

    from mp_grpo.ops import SamplingFilter
    from tests.policy_logits import flat_logits, policy_logits
    from tests.tolerances import assert_close

    if torch.cuda.is_available():
        init_nccl()
    else:  # a CPU check of the worker (gloo, Triton's interpreter)
        dist.init_process_group("gloo")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    failures = []
    for v in vocab:
        logits = torch.cat([policy_logits(rows // 2, v, seed=v % 89, device=device),
                            flat_logits(rows // 2, v, seed=v % 89, device=device)])
        for filt in FILTERS:
            # Targets inside every filter's kept set: each row's argmax and, for a few rows, its second token.
            target = logits.float().topk(2, dim=-1).indices[:, 0].clone()
            target[::5] = logits.float().topk(2, dim=-1).indices[::5, 1]
            target[3] = -100
            out = tp_against_tp1(logits, target, SamplingFilter(**filt), dist.group.WORLD, temperature=TEMPERATURE)
            lp, lp1, ent, ent1, grad, grad1 = out.pop("_tensors")
            where = f"V = {v}, {filt}, rank {dist.get_rank()}"
            if out["tau_rows_bitwise"] != out["rows"]:
                failures.append(f"{where}: thresholds (kept sets) differ from TP = 1 on "
                                f"{out['rows'] - out['tau_rows_bitwise']} of {out['rows']} rows")
            try:
                assert_close(lp, lp1, torch.float32, f"log-probs {where}")
                assert_close(ent, ent1, torch.float32, f"entropy {where}")
                assert_close(grad, grad1, torch.bfloat16, f"gradient {where}")
            except AssertionError as err:
                failures.append(str(err))
            if dist.get_rank() == 0:
                print(json.dumps({"tp": dist.get_world_size(), "V": v, "filter": filt, **out}), flush=True)
    assert not failures, "\n".join(failures)


if __name__ == "__main__":
    worker_main({"case_filters": case_filters})
