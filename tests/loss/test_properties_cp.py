"""Property-based test of GRPOLoss under context parallelism, CP = 2 under torchrun / gloo (tests/distributed.py):
random valid configs and steps (tests/loss/strategies.py) on both backends, every sequence cut into Megatron's
2·CP load-balanced chunks — padded rows and packed segments (tokens ``[T]`` or ``[1, T]``), one or two micro-batches, one GlobalBatch over the
CP group —; the CP ranks' shares summed, each rank's gradients and the metrics reduced over the group equal one
call on the whole step (1e-9 relative in float64) and the float64 reference.

Both ranks run the same hypothesis test from the same seed, so they draw the same examples; each example's
verdict is agreed over the group (a max all-reduce) before it is raised, so both ranks fail, and shrink, alike.
The seed: fixed under the ``ci`` profile; drawn at random under ``dev`` / ``soak`` and printed — rerun with
``MP_GRPO_CP_SEED=<seed>`` (and the same profile) to reproduce a failure; hypothesis' falsifying example and
``@reproduce_failure`` blob are in the workers' output that the failing test shows.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import sys
import traceback

import torch
import torch.distributed as dist

from tests.distributed import torchrun

CP = 2
SEED_ENV = "MP_GRPO_CP_SEED"


def test_context_parallel_matches_single_call() -> None:
    from tests.hypothesis_profiles import profile_name, torchrun_timeout

    seed = os.environ.get(SEED_ENV)
    seed = int(seed) if seed is not None else (0 if profile_name() == "ci" else random.randrange(2**32))
    print(f"CP property: hypothesis seed {seed} (reproduce with {SEED_ENV}={seed})")
    torchrun(__file__, "case_context_parallel", nproc=CP, timeout=torchrun_timeout(590), seed=seed)


# ----------------------------------------------------------------------------------------------- worker
def _cp_positions(length: int, cp_rank: int) -> torch.Tensor:
    """Megatron's load-balanced CP split of ``length`` (a multiple of 2·CP): chunks r and 2·CP − 1 − r."""
    chunk = length // (2 * CP)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * CP - 1 - cp_rank) * chunk, (2 * CP - cp_rank) * chunk)
    return torch.cat([first, second])


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _run_cp(step, split, backend, cp_rank: int):
    """This rank's share of the step (its CP chunks of every sequence), its gradients at its positions of the
    step's ``[B, W]`` tokens (flat, one extra slot that must stay 0), which positions it holds, its metric dicts."""
    from mp_grpo.loss import GlobalBatch, GRPOLoss, PackedSequences, PaddedSequences
    from tests.loss import properties as P
    from tests.loss.properties import LEAVES, TOKEN_INPUTS

    group = dist.group.WORLD
    d = step.data
    width = step.width
    numel = step.rows * width

    def flat(b: int, cols: torch.Tensor) -> torch.Tensor:
        """Flat positions of row b's columns; a column past the step's width (padding up to a multiple of 2·CP)
        is the extra slot ``numel``: masked, value 0."""
        return torch.where(cols < width, b * width + cols, numel)

    def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.reshape(-1), x.new_zeros(1)])[index]

    tensors = []
    for mb in split:
        if mb["packed"]:  # each segment padded to a multiple of 2·CP, cut into 2·CP chunks
            segments = [_round_up(step.needed_width(b), 2 * CP) for b in mb["rows"]]
            index = torch.cat([flat(b, _cp_positions(seg, cp_rank)) for b, seg in zip(mb["rows"], segments)])
            if not mb["flat"] or index.numel() == len(mb["rows"]):  # [1, T]; [T] only where T ≠ S (unambiguous)
                index = index.unsqueeze(0)
            bounds = torch.tensor([0, *torch.tensor(segments).cumsum(0).div(CP, rounding_mode="floor").tolist()])
            layout = PackedSequences(bounds.to(torch.int64), group)
        else:  # every row padded to the micro-batch's width, a multiple of 2·CP, cut along it
            row_width = _round_up(max(step.needed_width(b) for b in mb["rows"]), 2 * CP) or 2 * CP
            index = torch.stack([flat(b, _cp_positions(row_width, cp_rank)) for b in mb["rows"]])
            layout = PaddedSequences(group)
        t = {n: take(d[n], index) for n in TOKEN_INPUTS if n in d}
        t["advantages"] = take(d["advantages"], index) if step.per_token_advantages else d["advantages"][mb["rows"]]
        tensors.append((t, index, layout, mb))
    gb = GlobalBatch.from_rollouts(
        step.cfg, [t["loss_mask"] for t, *_ in tensors],
        old_logprobs=[t.get("old_logprobs", t["logprobs"]) for t, *_ in tensors],
        rollout_logprobs=[t["rollout_logprobs"] for t, *_ in tensors] if "rollout_logprobs" in d else None,
        entropies=[t["entropy"] for t, *_ in tensors] if "entropy" in d else None,
        group=group, layouts=[layout for _, _, layout, _ in tensors],
        advantages=P._m2po_advantages(step, [t["advantages"] for t, *_ in tensors]))
    positive_tokens = None
    if step.positive is not None:
        masks = [t["loss_mask"] & (layout.broadcast(step.positive[mb["rows"]].to(torch.float64),
                                                    t["loss_mask"].shape) != 0) for t, _, layout, mb in tensors]
        positive_tokens = GlobalBatch.from_masks(masks, group=group, layouts=[x[2] for x in tensors]).valid_tokens
    loss_fn = GRPOLoss(step.cfg, backend=backend)
    total = torch.zeros((), dtype=torch.float64)
    grads = {n: torch.zeros(numel + 1, dtype=d[n].dtype) if n in d else None for n in LEAVES}
    seen = torch.zeros(numel + 1, dtype=torch.bool)
    metrics = []
    for t, index, layout, mb in tensors:
        leaves = {n: t[n].clone().requires_grad_() for n in LEAVES if n in t}
        kwargs = {n: t.get(n) for n in ("old_logprobs", "rollout_logprobs", "ref_logprobs")}
        kwargs.update({n: leaves[n] for n in leaves if n != "logprobs"})
        old = kwargs.pop("old_logprobs")
        extra = {}
        if step.positive is not None:
            extra.update(positive=step.positive[mb["rows"]], positive_tokens=positive_tokens)
        if step.entropy_coef is not None:
            extra["entropy_coef"] = step.entropy_coef
        if step.topk is not None:  # this rank's positions (the padding's extra slot has no entry)
            extra["topk_logprobs"] = P.topk_for(step, index)
        loss, mets = loss_fn(leaves["logprobs"], old, t["advantages"], t["loss_mask"], batch=gb, layout=layout,
                             **kwargs, **extra)
        (loss * step.upstream).backward()
        total = total + loss.detach().double()
        metrics.append(mets)
        flat_index = index.reshape(-1)
        seen[flat_index] = True  # the extra slot too: ignored
        for n, leaf in leaves.items():
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            grads[n].index_add_(0, flat_index, g.reshape(-1))
    return total, grads, seen, metrics


def context_parallel_example(data) -> None:
    """One drawn example; raises AssertionError on every rank when it fails on any. (Its name is the property's
    in the soak statistics, tests/property_stats.py.)"""
    from hypothesis import event, note
    from hypothesis import strategies as st

    from mp_grpo.loss import LossBackend, reduce_metrics
    from tests.loss import properties as P
    from tests.loss.strategies import loss_configs, steps

    rank = dist.get_rank()
    backend = data.draw(st.sampled_from([LossBackend.TORCH, LossBackend.TRITON]))
    cfg_dict = data.draw(loss_configs("torch" if backend == LossBackend.TORCH else "triton"))
    note(f"backend {backend.value}, config: {cfg_dict}")
    step = data.draw(steps(cfg_dict, max_rows=4, max_len=7, kl_logprobs=backend == LossBackend.TORCH))
    note(f"step: {step!r}")
    order = data.draw(st.permutations(range(step.rows)))
    cut = data.draw(st.integers(1, step.rows))
    parts = [list(order[:cut]), list(order[cut:])]
    split = [{"rows": rows, "packed": data.draw(st.booleans()), "flat": data.draw(st.booleans())} for rows in parts if rows]
    note(f"split: {split}")
    event("backend", backend.value)
    event("compute", str(step.compute_dtype()).removeprefix("torch."))
    ref = P.reference(step)
    from hypothesis import assume

    assume(P.representable(step, ref))  # the same verdict on both ranks (the same draw)
    problem = None
    try:
        single = P.run_single(step, backend)
        share, grads, seen, metrics = _run_cp(step, split, backend, rank % CP)
    except Exception:  # noqa: BLE001 — agreed over the group below, then raised
        problem = traceback.format_exc()
    failed = torch.tensor([0.0 if problem is None else 1.0])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        raise AssertionError(problem or "the example failed on the other rank")
    # the collectives: the shares' sum, every rank's gradients, the metrics
    dist.all_reduce(share)
    for n in grads:
        if grads[n] is not None:
            g64 = grads[n].double()
            dist.all_reduce(g64)
            grads[n] = g64
    seen_all = seen.to(torch.float64)
    dist.all_reduce(seen_all)
    reduced = reduce_metrics(metrics, dist.group.WORLD)
    try:
        compute = step.compute_dtype()
        rtol = P.RTOL_SPLIT[compute]
        numel = step.rows * step.width
        for n, g in grads.items():
            assert g is None or g[numel] == 0, f"d/d{n} at a position outside the step"
        assert bool((seen_all[:numel] <= 1).all()), "a position on two CP ranks"
        got_grads = {n: None if g is None else g[:numel].view(step.rows, step.width).to(step.data[n].dtype)
                     for n, g in grads.items()}
        P.assert_loss_close(share, single.loss, ref[1], compute, "CP vs one call", rtol=rtol)
        mask = P.valid_mask(step)
        for n in P.LEAVES:
            if single.grads[n] is not None:
                dtype = step.data[n].dtype
                P.assert_grad_close(got_grads[n], single.grads[n], mask, dtype, f"CP vs one call d/d{n}",
                                    rtol=max(rtol, P._rtol(dtype)))
        P.assert_metrics_close(reduced, single.metrics, compute, "CP vs one call", rtol=rtol, scales=ref[2])
        P.check_against_reference(step, P.Result(share, got_grads, reduced), ref, f"{backend.value} CP")
    except AssertionError:
        problem = traceback.format_exc()
    failed = torch.tensor([0.0 if problem is None else 1.0])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        raise AssertionError(problem or "the example failed on the other rank")


def case_context_parallel(seed: int) -> None:
    from hypothesis import given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    from tests.hypothesis_profiles import examples, load_profile

    load_profile()
    # Both ranks draw the same examples: the same seed, no example database, no derandomization by test name.
    runner = settings(max_examples=examples(0.4), derandomize=False, database=None)(
        hypothesis_seed(seed)(given(data=st.data())(context_parallel_example)))
    runner()


if __name__ == "__main__":
    case, kwargs = sys.argv[1], json.loads(sys.argv[2])
    # A rank that fails alone must not leave its peer waiting for the default 30 minutes.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    try:
        {"case_context_parallel": case_context_parallel}[case](**kwargs)
    finally:
        dist.destroy_process_group()
