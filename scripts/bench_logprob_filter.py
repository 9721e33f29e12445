"""Benchmark: the sampling-filter replay of vocab_parallel_logprobs, before / after, side by side (one GPU).

    python3 scripts/bench_logprob_filter.py --out docs/benchmarks

Writes ``logprob_filter.{json,md,png}`` into ``--out``. In one run, for N = 16384 bf16 logits at V = 151936 and
18992 (``with_entropy=True``, ``check_inputs=False``, TP = 1):

1. **Correctness first**: before and after vs the float64 reference (16 rows); at full size, after's kept set vs
   before's on every row (equal for top-k; for top-p at most the boundary tie group may differ: fp32 sums).
2. **Filters**: unfiltered, top_k = 50, top_p = 0.95, top_k = 50 + top_p = 0.95 — each "before" (the schedule of
   before, ``scripts/filter_before.py``: radix passes over every row, then the statistics) and "after" (the
   library: candidates in the statistics' read, the radix passes for the rows they do not finish) — on three
   inputs (``tests/policy_logits.py``): a trained policy's rows, flat rows (the bulk holds ~95 % of the mass:
   top-p falls back on every row) and the policy's rows with 5 % flat rows. Median forward and forward+backward
   ms (``triton.testing.do_bench``, host launch overhead included) and forward+backward as CUDA-graph replays
   (GPU time only); the rows the candidates finished; the mean kept tokens.
3. **Building blocks** (after, policy rows): one read (``amax``), the unfiltered statistics kernel, the group-maxima
   read, the candidate kernel, the select kernel, the whole threshold search (and before's).

Tensor parallel (``torchrun --nproc_per_node TP scripts/bench_logprob_filter.py --out DIR``, TP ≥ 2, NCCL): writes
``logprob_filter_tp<TP>.{json,md}`` (``--report logprob_filter_tp<TP>.json --out DIR``: the markdown again from the
JSON, no measurement). Every rank draws the same full logits and keeps its vocabulary shard.

1. **Correctness first**, against TP = 1 on the same logits (``tests/gpu/test_logprob_filter_tp.tp_against_tp1``:
   each rank also runs the op on the whole logits), ``--check-rows`` rows of policy + 5 % flat rows, every filter:
   thresholds (the kept sets) equal bit for bit on every rank, log-probs / entropy / gradient to fp32 rounding (the
   rows equal bit for bit counted).
2. **Cost beside the unfiltered op** (N = ``--tokens``, with entropy, ``check_inputs=False``): top_k = 20 / 50,
   top_p = 0.9 / 0.95 on a trained policy's rows and on policy + 5 % flat rows — forward and forward+backward
   (``measure.timed_ms``: a fixed count of iterations after a barrier, the slowest rank's median) and
   forward+backward as CUDA-graph replays (the collectives captured); **the collectives' share**: the NCCL kernels'
   share of the GPU time of three forward+backward calls (``torch.profiler``; NCCL kernel time includes waiting for
   the other ranks), the largest over ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mp_grpo import vocab_parallel_logprobs  # noqa: E402
from mp_grpo.ops import SamplingFilter  # noqa: E402
from mp_grpo.ops.filter_launch import (  # noqa: E402
    candidates_from_maxima,
    candidates_of,
    gather_candidates,
    group_maxima,
    select_from_candidates,
)
from mp_grpo.ops.logprob_launch import new_stats_buffer, shard_statistics  # noqa: E402
from mp_grpo.ops.sampling_filter import threshold_search  # noqa: E402
from tests.policy_logits import flat_logits, mixed_logits, policy_logits  # noqa: E402
from tests.reference import filtered_logprobs_reference, sampling_filter_keep_reference  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from filter_before import logprobs_before, threshold_before  # noqa: E402
from measure import graph_replay_ms, timed_ms  # noqa: E402
from measure import median_ms as _median_ms  # noqa: E402

REP_MS = 60
"""do_bench's repetition window (ms): every timing is a median of >= 2 calls (the slowest, before's both, ~50 ms);
short, so that this benchmark and the GPU tests fit one device call."""
DEVICE = "cuda"
"""``--dry-run`` runs every step once on the CPU (Triton interpreter, tiny sizes): a check of this script."""
FLAT_FRACTION = 0.05
FILTERS = {"top_k=50": SamplingFilter(top_k=50), "top_p=0.95": SamplingFilter(top_p=0.95),
           "top_k=50, top_p=0.95": SamplingFilter(top_k=50, top_p=0.95)}
INPUTS = {"policy": lambda n, v: policy_logits(n, v, device=DEVICE),
          "flat": lambda n, v: flat_logits(n, v, device=DEVICE),
          f"policy + {FLAT_FRACTION:.0%} flat": lambda n, v: mixed_logits(n, v, FLAT_FRACTION, device=DEVICE)}


def median_ms(fn) -> float:
    return _median_ms(fn, warmup_ms=20, rep_ms=REP_MS)


def graph_ms(fn) -> float:
    return graph_replay_ms(fn, warmup=2, warmup_ms=20, rep_ms=REP_MS)


def check_correctness(vocab: int) -> float:
    """Before and after vs the float64 reference (16 policy + flat rows), before timing anything."""
    worst = 0.0
    x = torch.cat([policy_logits(8, vocab, device=DEVICE, seed=3), flat_logits(8, vocab, device=DEVICE, seed=3)])
    for filt in (dict(top_k=50), dict(top_p=0.9), dict(top_k=50, top_p=0.95)):
        keep = sampling_filter_keep_reference(x.cpu(), **filt)
        t = torch.multinomial(keep.double(), 1, generator=torch.Generator().manual_seed(0)).squeeze(1).to(DEVICE)
        lp_ref, ent_ref = filtered_logprobs_reference(x.cpu(), t.cpu(), **filt)
        for lp, ent in (vocab_parallel_logprobs(x, t, with_entropy=True, sampling_filter=SamplingFilter(**filt)),
                        logprobs_before(x, t, SamplingFilter(**filt))):
            worst = max(worst, (lp.cpu().double() - lp_ref).abs().max().item(),
                        (ent.cpu().double() - ent_ref).abs().max().item())
    return worst


def kept_set_agreement(x: torch.Tensor, filt: SamplingFilter) -> dict:
    """After's vs before's kept set on every row: rows that differ, and whether each difference is only the
    boundary tie group (the smaller kept set's complement within the larger is one logit value: its smallest)."""
    tau_after = threshold_search(x, filt, x.shape[:1], tp_group=None, inv_temperature=1.0).tau
    tau_before = threshold_before(x, filt, x.shape[:1], inv_temperature=1.0)
    differ = tau_after != tau_before
    rows = differ.nonzero().flatten()
    boundary_only = True
    for r in rows[:64].tolist():  # each differing row: nothing strictly between the two thresholds
        lo, hi = sorted((tau_after[r].item(), tau_before[r].item()))
        between = (x[r].float() > lo) & (x[r].float() < hi)
        boundary_only &= not bool(between.any())
    return {"rows_differing": int(differ.sum()), "only_boundary_tie_groups": boundary_only}


def time_case(x, t, g_lp, g_ent, fn) -> dict:
    def fwd():
        with torch.no_grad():
            fn(x, t)

    def fwd_bwd():
        x.grad = None
        torch.autograd.backward(fn(x, t), (g_lp, g_ent))

    return {"fwd_ms": median_ms(fwd), "fwd_bwd_ms": median_ms(fwd_bwd), "fwd_bwd_graph_ms": graph_ms(fwd_bwd)}


def run_filters(n: int, v: int) -> list[dict]:
    rows = []
    g_lp, g_ent = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    for input_name, make in INPUTS.items():
        x = make(n, v).requires_grad_()
        t = x.detach().float().argmax(-1)  # inside every filter's kept set
        cases = [("unfiltered", "—", lambda xx, tt: vocab_parallel_logprobs(xx, tt, with_entropy=True, check_inputs=False))]
        for name, filt in FILTERS.items():
            cases.append((name, "after", lambda xx, tt, filt=filt: vocab_parallel_logprobs(
                xx, tt, with_entropy=True, check_inputs=False, sampling_filter=filt)))
            if not input_name.startswith("policy +"):  # before's passes do not depend on the rows
                cases.append((name, "before", lambda xx, tt, filt=filt: logprobs_before(xx, tt, filt)))
        for name, impl, fn in cases:
            row = {"V": v, "N": n, "input": input_name, "filter": name, "impl": impl}
            try:
                row.update(time_case(x, t, g_lp, g_ent, fn))
                if name != "unfiltered" and impl == "after":
                    filt = FILTERS[name]
                    search = threshold_search(x.detach(), filt, t.shape, tp_group=None, inv_temperature=1.0)
                    row["finished_on_candidates"] = search.finished.float().mean().item()
                    row["mean_kept"] = (x.detach().float() >= search.tau[:, None]).sum(-1).float().mean().item()
                    row["vs_before"] = kept_set_agreement(x.detach(), filt)
            except Exception as err:  # reported, not hidden
                traceback.print_exc()
                row["error"] = repr(err)[:300]
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
        del x
        torch.cuda.empty_cache()
    return rows


def building_blocks(n: int, v: int) -> dict:
    """The forward's parts alone on policy rows (after)."""
    x = policy_logits(n, v, device=DEVICE)
    t = x.float().argmax(-1)
    stats = new_stats_buffer(n, x.device)
    grouped = group_maxima(x, with_sum=True, inv_temperature=1.0)
    found = gather_candidates(x, with_sum=True, inv_temperature=1.0)
    gathered = candidates_of(found.buffer.unsqueeze(0), x.dtype)
    k = torch.full((n,), 50, dtype=torch.int32, device=x.device)
    p = torch.full((n,), 0.95, device=x.device)
    out = {
        "read (amax)": median_ms(lambda: x.amax(-1)),
        "statistics kernel (unfiltered, with entropy)": median_ms(lambda: shard_statistics(
            x, t, stats, vocab_start=0, inv_temperature=1.0, with_entropy=True)),
        "group-maxima read (no sum: top-k)": median_ms(lambda: group_maxima(x, with_sum=False, inv_temperature=1.0)),
        "group-maxima read (with sum: top-p)": median_ms(lambda: group_maxima(x, with_sum=True, inv_temperature=1.0)),
        "candidate kernel (theta, re-read of the chosen groups)": median_ms(lambda: candidates_from_maxima(x, grouped)),
        "select kernel, top-k (with statistics)": median_ms(lambda: select_from_candidates(
            gathered, x, rank=0, v_global=v, top_k=k, top_p=None, min_p=None, inv_temperature=1.0, stats=stats,
            target=t, with_entropy=True)),
        "select kernel, top-p (with statistics)": median_ms(lambda: select_from_candidates(
            gathered, x, rank=0, v_global=v, top_k=None, top_p=p, min_p=None, inv_temperature=1.0, stats=stats,
            target=t, with_entropy=True)),
    }
    for name, filt in FILTERS.items():
        out[f"threshold search, {name} (candidates + select + skipped fallback)"] = median_ms(
            lambda filt=filt: threshold_search(x, filt, t.shape, tp_group=None, inv_temperature=1.0))
    for name, filt in FILTERS.items():
        out[f"threshold search before, {name}"] = median_ms(
            lambda filt=filt: threshold_before(x, filt, t.shape, inv_temperature=1.0))
    print(json.dumps({"V": v, **out}), flush=True)
    return out


def _by(rows, v, input_name, name, impl):
    for r in rows:
        if (r["V"], r["input"], r["filter"], r["impl"]) == (v, input_name, name, impl) and "error" not in r:
            return r
    return None


def write_report(result: dict, out: Path) -> None:
    (out / "logprob_filter.json").write_text(json.dumps(result, indent=1))
    rows = result["filters"]
    lines = [
        f"# Sampling-filter replay, before / after — {result['device']}",
        "",
        f"Command: `python3 scripts/bench_logprob_filter.py --out docs/benchmarks`. N = {result['tokens']} bf16 "
        "logits, `with_entropy=True`, `check_inputs=False`, one GPU (TP = 1: no collective runs). **before**: the "
        "schedule of before (`scripts/filter_before.py`: radix passes over every row, then the statistics); "
        "**after**: the library (the statistics' read keeps each row's largest logits; a select kernel finishes the "
        "rows it can; the radix passes run for the others). Inputs (`tests/policy_logits.py`): **policy** — a "
        "trained policy's rows (1-8 head tokens hold 97-99.99 % of the mass); **flat** — the bulk holds ~95 % of the "
        "mass (top-p keeps thousands of tokens: every row takes the fallback); **policy + 5 % flat**. Targets: each "
        f"row's argmax. Correctness before timing: max |diff| of before and after from the float64 reference "
        f"{result['max_abs_err']:.1e}.",
        "",
    ]
    for v in result["vocab"]:
        base = {i: _by(rows, v, i, "unfiltered", "—") for i in INPUTS}
        lines += [f"## V = {v}", "",
                  "× = / the unfiltered op on the same input. eager: `do_bench` medians (host launches included); "
                  "graph: CUDA-graph replays (GPU time). Where the two differ (the filtered op at small V), the host "
                  "sets the eager time: the filtered forward makes ~12 launches against the unfiltered op's 2, about "
                  "as long as its kernels run at V = 18992, so those eager medians carry the host's jitter; a CUDA "
                  "graph of the training step (the op is capturable) leaves the GPU time.", "",
                  "| filter | input | before fwd+bwd ms (×) | after fwd+bwd ms (×) | after graph ms (×) | after fwd ms "
                  "(×) | rows finished on candidates | mean kept | kept set vs before |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for i in INPUTS:
            b = base[i]
            if b is not None:
                lines.append(f"| unfiltered | {i} | — | {b['fwd_bwd_ms']:.3f} (1.00) | {b['fwd_bwd_graph_ms']:.3f} "
                             f"(1.00) | {b['fwd_ms']:.3f} (1.00) | — | all | — |")
        for name in FILTERS:
            for i in INPUTS:
                a, bef, b = _by(rows, v, i, name, "after"), _by(rows, v, i, name, "before"), base[i]
                if a is None or b is None:
                    lines.append(f"| {name} | {i} | error | | | | | | |")
                    continue
                before = (f"{bef['fwd_bwd_ms']:.2f} ({bef['fwd_bwd_ms'] / b['fwd_bwd_ms']:.2f})" if bef else
                          "as policy")
                agree = a["vs_before"]
                agree_text = ("equal" if agree["rows_differing"] == 0 else
                              f"{agree['rows_differing']} rows: boundary tie group only"
                              if agree["only_boundary_tie_groups"] else f"{agree['rows_differing']} rows DIFFER")
                lines.append(
                    f"| {name} | {i} | {before} | {a['fwd_bwd_ms']:.3f} ({a['fwd_bwd_ms'] / b['fwd_bwd_ms']:.2f}) | "
                    f"{a['fwd_bwd_graph_ms']:.3f} ({a['fwd_bwd_graph_ms'] / b['fwd_bwd_graph_ms']:.2f}) | "
                    f"{a['fwd_ms']:.3f} ({a['fwd_ms'] / b['fwd_ms']:.2f}) | {100 * a['finished_on_candidates']:.1f} % | "
                    f"{a['mean_kept']:.1f} | {agree_text} |")
        blocks = result["blocks"].get(str(v), {})
        if blocks:
            lines += ["", "Building blocks alone (policy rows, eager medians): " + "; ".join(
                f"{k} {ms:.3f} ms" if isinstance(ms, float) else f"{k}: {ms}" for k, ms in blocks.items()) + ".", ""]
    (out / "logprob_filter.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(result, out / "logprob_filter.png")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["filters"]
    fig, axes = plt.subplots(1, len(result["vocab"]), figsize=(8 * len(result["vocab"]), 5))
    axes = [axes] if len(result["vocab"]) == 1 else axes
    for ax, v in zip(axes, result["vocab"]):
        labels, before, after = [], [], []
        for name in FILTERS:
            for i in INPUTS:
                a, b, base = (_by(rows, v, i, name, "after"), _by(rows, v, i, name, "before") or
                              _by(rows, v, "policy", name, "before"), _by(rows, v, i, "unfiltered", "—"))
                if a is None or b is None or base is None:
                    continue
                labels.append(f"{name}\n{i}")
                before.append(b["fwd_bwd_graph_ms"] / base["fwd_bwd_graph_ms"])
                after.append(a["fwd_bwd_graph_ms"] / base["fwd_bwd_graph_ms"])
        pos = range(len(labels))
        ax.barh([p + 0.2 for p in pos], before, height=0.4, color="tab:gray", label="before")
        ax.barh([p - 0.2 for p in pos], after, height=0.4, color="tab:green", label="after")
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_yticks(list(pos), labels, fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("forward + backward, × the unfiltered op (CUDA-graph replays: GPU time)")
        ax.set_title(f"N = {result['tokens']}, V = {v}, bf16 ({result['device']})")
        ax.invert_yaxis()
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)

# ----------------------------------------------------------------------------- tensor parallel
TP_FILTERS = {"top_k=20": SamplingFilter(top_k=20), "top_k=50": SamplingFilter(top_k=50),
              "top_p=0.9": SamplingFilter(top_p=0.9), "top_p=0.95": SamplingFilter(top_p=0.95)}
TP_INPUTS = {"policy": lambda n, v: policy_logits(n, v, device=DEVICE),
             f"policy + {FLAT_FRACTION:.0%} flat": lambda n, v: mixed_logits(n, v, FLAT_FRACTION, device=DEVICE)}
TP_ITERS = 20
PROFILE_CALLS = 3
# (TP, V, filter) -> (predicted fwd+bwd × the unfiltered op, predicted NCCL share of the GPU time), policy rows;
# written before the first TP run. The kernels cost what they cost at TP = 1 (1.26-1.27× at V = 151936, 1.53-1.54× at
# 18992, this file's single-GPU rows); the collectives add a fixed cost set by N, not V: the candidates' all-gather
# ([N, 260] int32: 17 MB a rank) and, issued whether or not a row needs them (no host read), the fallback's
# all-reduces (top-k: 2 of [N, 256] int32; top-p: 2 of [N, 16] and 1 of [N, 256] fp32) — ~0.4-0.5 ms at TP = 2,
# ~0.5-0.6 ms at TP = 4 on NVLink, against an unfiltered op of ~2.6 / ~1.3 ms (V = 151936) and ~0.35 / ~0.2 ms
# (V = 18992). Kept sets: equal to TP = 1's on every row; log-probs: ≥ 90 % of the rows bit for bit, the others
# within a few fp32 ulps (the kept set's sums in another order).
TP_PREDICTIONS = {
    (2, 151936, "top_k=20"): (1.43, 0.12), (2, 151936, "top_k=50"): (1.43, 0.12),
    (2, 151936, "top_p=0.9"): (1.43, 0.12), (2, 151936, "top_p=0.95"): (1.43, 0.12),
    (4, 151936, "top_k=20"): (1.7, 0.25), (4, 151936, "top_k=50"): (1.7, 0.25),
    (4, 151936, "top_p=0.9"): (1.7, 0.25), (4, 151936, "top_p=0.95"): (1.7, 0.25),
    (2, 18992, "top_k=20"): (2.8, 0.45), (2, 18992, "top_k=50"): (2.8, 0.45),
    (2, 18992, "top_p=0.9"): (2.8, 0.45), (2, 18992, "top_p=0.95"): (2.8, 0.45),
    (4, 18992, "top_k=20"): (4.0, 0.55), (4, 18992, "top_k=50"): (4.0, 0.55),
    (4, 18992, "top_p=0.9"): (4.0, 0.55), (4, 18992, "top_p=0.95"): (4.0, 0.55),
}


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=DEVICE)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def _nccl_share(fn) -> float | None:
    """The NCCL kernels' share of the GPU time of ``PROFILE_CALLS`` calls of ``fn`` (None on the CPU)."""
    if DEVICE == "cpu":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILE_CALLS):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(getattr(e, "self_device_time_total", 0) for e in events)
    nccl = sum(getattr(e, "self_device_time_total", 0) for e in events if "nccl" in e.key.lower())
    return nccl / total if total else None


def _tp_timed(fn, iters: int) -> float:
    return _max_over_ranks(timed_ms(fn, iters, warmup=3) if DEVICE != "cpu" else (fn(), 0.001)[1])


def _tp_graph_ms(fn, iters: int) -> float | None:
    if DEVICE == "cpu":
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = _tp_timed(graph.replay, iters)
    del graph
    torch.cuda.empty_cache()
    return ms


def run_tensor_parallel(args) -> dict:
    import torch.distributed as dist

    from tests.gpu.test_logprob_filter_tp import tp_against_tp1

    rank, tp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    result = {"device": "CPU DRY RUN" if DEVICE == "cpu" else torch.cuda.get_device_name(), "tp": tp,
              "tokens": args.tokens, "vocab": args.vocab, "check_rows": args.check_rows, "iters": args.iters,
              "command": f"torchrun --nproc_per_node {tp} scripts/bench_logprob_filter.py " + " ".join(sys.argv[1:]),
              "dry_run": DEVICE == "cpu", "correctness": [], "cost": []}
    for v in args.vocab:
        v_local = v // tp
        cols = slice(rank * v_local, (rank + 1) * v_local)
        # --- 1. correctness against TP = 1 on the same logits ---
        logits = mixed_logits(args.check_rows, v, FLAT_FRACTION, device=DEVICE, seed=5)
        target = logits.float().argmax(-1)
        for name, filt in TP_FILTERS.items():
            out = tp_against_tp1(logits, target, filt, group)
            out.pop("_tensors")
            everywhere = _max_over_ranks(out["rows"] - out["tau_rows_bitwise"]) == 0
            row = {"V": v, "filter": name, "thresholds_bitwise_on_every_rank": everywhere, **out}
            result["correctness"].append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
        del logits
        # --- 2. cost beside the unfiltered op, and the collectives' share ---
        g_lp = torch.randn(args.tokens, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(1))
        g_ent = torch.randn(args.tokens, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(2))
        for input_name, make in TP_INPUTS.items():
            full = make(args.tokens, v)
            t = full.float().argmax(-1)  # inside every filter's kept set
            x = full[:, cols].contiguous().requires_grad_()
            del full
            cases = {"unfiltered": None, **TP_FILTERS}
            for name, filt in cases.items():
                def call(filt=filt):
                    return vocab_parallel_logprobs(x, t, tp_group=group, with_entropy=True, check_inputs=False,
                                                   sampling_filter=filt)

                def fwd(call=call):
                    with torch.no_grad():
                        call()

                def fwd_bwd(call=call):
                    x.grad = None
                    torch.autograd.backward(call(), (g_lp, g_ent))

                row = {"V": v, "N": args.tokens, "tp": tp, "input": input_name, "filter": name}
                try:
                    row["fwd_ms"] = _tp_timed(fwd, args.iters)
                    row["fwd_bwd_ms"] = _tp_timed(fwd_bwd, args.iters)
                    row["fwd_bwd_graph_ms"] = _tp_graph_ms(fwd_bwd, args.iters)
                    share = _nccl_share(fwd_bwd)
                    row["nccl_share_of_gpu_time"] = None if share is None else _max_over_ranks(share)
                except Exception as err:  # reported, not hidden
                    traceback.print_exc()
                    row["error"] = repr(err)[:300]
                result["cost"].append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
                if DEVICE != "cpu":
                    torch.cuda.empty_cache()
            del x
        if rank == 0:
            write_tp_report(result, args.out)
    wrong = [f"V = {r['V']}, {r['filter']}" for r in result["correctness"] if not r["thresholds_bitwise_on_every_rank"]]
    if wrong:  # after the report is written: the kept sets must not differ from TP = 1's
        raise SystemExit(f"kept sets differ from TP = 1 on the same logits: {'; '.join(wrong)}")
    return result


def _grad_bitwise(r: dict) -> str:
    """The gradient elements equal bit for bit: "all" only when none differs (largest difference 0); the count that
    differ where the run recorded it; else the fraction, never rounded up to 100 % (an fp32 mean over ~10⁸ elements
    reads 1.0 with a few dozen differing)."""
    if r["grad_max_abs_diff"] == 0:
        return "all"
    if "grad_elements_different" in r:
        return f"all but {r['grad_elements_different']}"
    percent = 100 * r["grad_bitwise_fraction"]
    return "> 99.99 %" if percent >= 99.995 else f"{percent:.2f} %"


def write_tp_report(result: dict, out: Path) -> None:
    tp = result["tp"]
    (out / f"logprob_filter_tp{tp}.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Sampling-filter replay at TP = {tp} — {result['device']}", ""]
    if result["dry_run"]:
        lines += ["**DRY RUN — not a measurement** (CPU, gloo, Triton's interpreter, tiny sizes).", ""]
    lines += [
        f"Command: `{result['command']}`. The vocabulary split over {tp} ranks, bf16 logits, with entropy, "
        "`check_inputs=False`. Times: the slowest rank's median of a fixed number of calls after a barrier; graph: "
        "the same forward+backward captured in a CUDA graph (collectives included) and replayed; × = / the unfiltered "
        "op on the same input. NCCL share: the NCCL kernels' share of the GPU time of three forward+backward calls "
        "(torch.profiler; it includes waiting for the other ranks), the largest over ranks.",
        "",
        f"## Against TP = 1 on the same logits ({result['check_rows']} rows: a policy's, 5 % flat)",
        "",
        "The thresholds — the kept sets — must equal TP = 1's bit for bit on every rank (the script fails otherwise). "
        "The log-probs, entropy and gradient are equal to fp32 rounding, not bit for bit: the kept set's sums are the "
        "same terms added in another order (each rank's shard, then the shards merged in rank order), so a row's "
        "last bits may differ from TP = 1's, where one pass adds the whole row.",
        "",
        "| V | filter | thresholds (kept sets) bitwise, every rank | mean kept | log-prob rows bitwise | max abs diff | "
        "entropy rows bitwise | max abs diff | gradient elements bitwise | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["correctness"]:
        lines.append(f"| {r['V']} | {r['filter']} | {'yes' if r['thresholds_bitwise_on_every_rank'] else 'NO'} | "
                     f"{r['kept_per_row_mean']:.1f} | {r['logprob_rows_bitwise']} / {r['rows']} | "
                     f"{r['logprob_max_abs_diff']:.1e} | {r['entropy_rows_bitwise']} / {r['rows']} | "
                     f"{r['entropy_max_abs_diff']:.1e} | {_grad_bitwise(r)} | "
                     f"{r['grad_max_abs_diff']:.1e} |")
    lines += ["", "## Cost beside the unfiltered op", "",
              "| V | input | filter | fwd ms (×) | fwd+bwd ms (×) | graph fwd+bwd ms (×) | NCCL share of GPU time |",
              "|---|---|---|---|---|---|---|"]

    def fmt(r, base, key):
        if r.get(key) is None:
            return "—"
        x = f" ({r[key] / base[key]:.2f})" if base and base.get(key) else ""
        return f"{r[key]:.3f}{x}"

    for r in result["cost"]:
        base = next((b for b in result["cost"] if (b["V"], b["input"], b["filter"]) == (r["V"], r["input"], "unfiltered")
                     and "error" not in b), None)
        if "error" in r:
            lines.append(f"| {r['V']} | {r['input']} | {r['filter']} | error: {r['error']} | | | |")
            continue
        share = r.get("nccl_share_of_gpu_time")
        lines.append(f"| {r['V']} | {r['input']} | {r['filter']} | {fmt(r, base, 'fwd_ms')} | {fmt(r, base, 'fwd_bwd_ms')} | "
                     f"{fmt(r, base, 'fwd_bwd_graph_ms')} | {'—' if share is None else f'{100 * share:.1f} %'} |")
    lines += ["", "## Predictions (written before the first TP run), policy rows", "",
              "| V | filter | predicted fwd+bwd × | measured | predicted NCCL share | measured |", "|---|---|---|---|---|---|"]
    for (p_tp, v, name), (x_pred, share_pred) in TP_PREDICTIONS.items():
        if p_tp != tp or v not in result["vocab"]:
            continue
        r = next((c for c in result["cost"] if (c["V"], c["input"], c["filter"]) == (v, "policy", name)), {})
        base = next((c for c in result["cost"] if (c["V"], c["input"], c["filter"]) == (v, "policy", "unfiltered")), {})
        x = r["fwd_bwd_ms"] / base["fwd_bwd_ms"] if r.get("fwd_bwd_ms") and base.get("fwd_bwd_ms") else None
        share = r.get("nccl_share_of_gpu_time")
        lines.append(f"| {v} | {name} | {x_pred} | {'—' if x is None else f'{x:.2f}'} | {share_pred:.0%} | "
                     f"{'—' if share is None else f'{share:.0%}'} |")
    (out / f"logprob_filter_tp{tp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main() -> None:
    global DEVICE, median_ms, graph_ms
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 18992])
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny sizes: check the script only")
    parser.add_argument("--iters", type=int, default=TP_ITERS, help="under torchrun: timed calls per case")
    parser.add_argument("--check-rows", type=int, default=4096, help="under torchrun: rows of the TP = 1 comparison")
    parser.add_argument("--report", type=Path, metavar="LOGPROB_FILTER_TP_JSON",
                        help="no measurement: rewrite the TP report of this logprob_filter_tp<TP>.json into --out")
    args = parser.parse_args()
    if args.report:
        args.out.mkdir(parents=True, exist_ok=True)
        write_tp_report(json.loads(args.report.read_text()), args.out)
        return
    if args.dry_run:
        DEVICE = "cpu"
        median_ms = graph_ms = lambda fn: (fn(), 0.001)[1]  # noqa: E731
        torch.cuda.get_device_name = lambda: "CPU dry run"
        torch.cuda.empty_cache = lambda: None
    elif not torch.cuda.is_available():
        sys.exit("bench_logprob_filter.py needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    if "LOCAL_RANK" in os.environ:  # started by torchrun: the tensor-parallel benchmark
        import torch.distributed as dist

        if args.dry_run:
            dist.init_process_group("gloo")
        else:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            dist.init_process_group("nccl")
        try:
            run_tensor_parallel(args)
        finally:
            dist.barrier()
            dist.destroy_process_group()
        return
    err = check_correctness(min(args.vocab))
    print(f"correctness (V={min(args.vocab)}): max |diff| of before and after from float64 = {err:.2e}", flush=True)
    assert err < 1e-3, err
    result = {"device": torch.cuda.get_device_name(), "tokens": args.tokens, "vocab": args.vocab,
              "max_abs_err": err, "filters": [], "blocks": {}}
    for v in args.vocab:
        result["filters"] += run_filters(args.tokens, v)
        write_report(result, args.out)  # after each V: a time limit keeps what was measured
        try:
            result["blocks"][str(v)] = building_blocks(args.tokens, v)
        except Exception as err:  # reported, not hidden
            traceback.print_exc()
            result["blocks"][str(v)] = {"error": repr(err)[:300]}
        write_report(result, args.out)


if __name__ == "__main__":
    main()
