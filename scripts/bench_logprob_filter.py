"""Benchmark: the sampling-filter replay and the batch-invariance guarantee of vocab_parallel_logprobs (one GPU).

    python3 scripts/bench_logprob_filter.py --out docs/benchmarks

Writes ``logprob_filter.{json,md,png}`` into ``--out``. Every row is measured in the same run:

1. **Filters** (N = 16384 bf16 logits, V = 151936 and 18992, ``with_entropy=True``, ``check_inputs=False``):
   the unfiltered op side by side with top_k = 20 / 50, top_p = 0.9 / 0.95 / 1.0, top_k = 50 with
   top_p = 0.95, and per-row top_p tensors; median forward and forward+backward ms
   (``triton.testing.do_bench``), the threshold search alone with its prediction from the timed building
   blocks (one read, one counting pass, one mass pass), and the extra peak memory. The logits
   are language-model-like (a few dominant tokens over a long tail). Before timing, the filtered op
   is checked against the float64 reference at a small size.
2. **Batch invariance**: the launch configuration depends on V_local only (that is the guarantee);
   its cost is the gap to the best configuration of a small sweep at each row count N, forward +
   backward. A bitwise check (rows alone vs the same rows inside N = 16384) runs first.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mp_grpo.ops.logprob_launch as logprob_launch  # noqa: E402
from mp_grpo import vocab_parallel_logprobs  # noqa: E402
from mp_grpo.kernels import logprob_launch_config  # noqa: E402
from mp_grpo.ops import SamplingFilter  # noqa: E402
from mp_grpo.ops.sampling_filter import filter_threshold  # noqa: E402
from tests.reference import filtered_logprobs_reference, sampling_filter_keep_reference  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_filter_passes  # noqa: E402
from measure import GiB, extra_peak_bytes, graph_replay_ms  # noqa: E402
from measure import median_ms as _median_ms  # noqa: E402

REP_MS = 100
"""do_bench's repetition window (ms): shorter than measure.py's default, so that this benchmark and the GPU
tests fit one device call; every timing here is a median of >= 3 calls (the slowest is ~30 ms)."""


def median_ms(fn, **kwargs):
    return _median_ms(fn, warmup_ms=25, rep_ms=REP_MS, **kwargs)


DEVICE = "cuda"
"""``--dry-run`` runs every step once on the CPU (Triton interpreter, tiny sizes): a check of this script,
not a measurement."""


def peaky_logits(n: int, v: int, seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    """Language-model-like rows: 40 dominant tokens (logit +9 … +3) over a N(0, 2²) tail, shuffled."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(n, v, device=DEVICE, generator=gen) * 2
    x[:, :40] += torch.linspace(9, 3, 40, device=DEVICE)
    perm = torch.randperm(v, device=DEVICE, generator=gen)
    return x[:, perm].to(dtype)


def filter_cases(n: int) -> dict[str, SamplingFilter | None]:
    per_row_p = torch.where(torch.arange(n, device=DEVICE) % 2 == 0, 0.9, 0.95)
    return {
        "unfiltered": None,
        "top_k=20": SamplingFilter(top_k=20),
        "top_k=50": SamplingFilter(top_k=50),
        "top_p=0.9": SamplingFilter(top_p=0.9),
        "top_p=0.95": SamplingFilter(top_p=0.95),
        "top_p=1.0": SamplingFilter(top_p=1.0),
        "top_k=50, top_p=0.95": SamplingFilter(top_k=50, top_p=0.95),
        "top_p per row (0.9/0.95)": SamplingFilter(top_p=per_row_p),
    }


def check_correctness(vocab: int) -> float:
    """Filtered op vs the float64 reference (16 rows of the smallest benchmarked V), before timing anything."""
    worst = 0.0
    x = peaky_logits(16, vocab, seed=3)
    for filt in (dict(top_k=50), dict(top_p=0.9), dict(top_k=50, top_p=0.95, min_p=0.01)):
        keep = sampling_filter_keep_reference(x.cpu(), **filt)
        t = torch.multinomial(keep.double(), 1, generator=torch.Generator().manual_seed(0)).squeeze(1).to(DEVICE)
        lp, ent = vocab_parallel_logprobs(x, t, with_entropy=True, sampling_filter=SamplingFilter(**filt))
        lp_ref, ent_ref = filtered_logprobs_reference(x.cpu(), t.cpu(), **filt)
        worst = max(worst, (lp.cpu().double() - lp_ref).abs().max().item(),
                    (ent.cpu().double() - ent_ref).abs().max().item())
    return worst


def pass_times(x: torch.Tensor) -> dict:
    """The threshold search's building blocks alone (``bench_filter_passes.measure``: one plain read, every
    variant of the counting and mass passes), with the library formulations' fastest times as
    ``count_pass_ms`` / ``mass_pass_ms``."""
    out = bench_filter_passes.measure(x, rep_ms=REP_MS)
    out["count_pass_ms"] = out["best_count_where"][1]
    out["mass_pass_ms"] = out["best_mass_tile"][1]
    return out


@contextmanager
def filter_launch(best: dict | None):
    """The search passes at the launch parameters ``best`` = {kind: (block, warps)} (this benchmark only; the
    library hard-codes the fastest measured ones in ``kernels/launch_config.py``)."""
    if not best:
        yield
        return
    fixed = logprob_launch_config

    def patched(v_local):
        return replace(fixed(v_local), **{f"filter_{kind}_{field}": value for kind, (block, warps) in best.items()
                                          for field, value in (("block_v", min(block, triton.next_power_of_2(v_local))),
                                                               ("warps", warps))})
    logprob_launch.logprob_launch_config = patched
    try:
        yield
    finally:
        logprob_launch.logprob_launch_config = fixed


def predicted_search_ms(filt: SamplingFilter, passes: dict) -> float:
    """The prediction from the passes (bf16: 16 key bits): top-k = 2 counting passes; top-p = one read for the
    row maximum (a by-product of top-k's first pass when top-k is on) + 2 mass passes + 1 counting pass."""
    ms = 0.0
    if filt.top_k is not None:
        ms += 2 * passes["count_pass_ms"]
    if filt.top_p is not None:
        ms += (0.0 if filt.top_k is not None else passes["read_ms"]) + 2 * passes["mass_pass_ms"] + passes["count_pass_ms"]
    return ms


def run_filters(args) -> tuple[list[dict], dict]:
    rows = []
    n = args.tokens
    all_passes = {}
    for v in args.vocab:
        x = peaky_logits(n, v).requires_grad_()
        passes = all_passes[str(v)] = pass_times(x.detach())
        print(json.dumps({"V": v, **passes}), flush=True)
        best = bench_filter_passes.best_library_configs({str(v): passes})[str(v)] if DEVICE == "cuda" else None
        passes["end_to_end_launch"] = best
        t = x.detach().float().argmax(-1)  # inside every filter's kept set
        g_lp, g_ent = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
        base = {}
        for name, filt in filter_cases(n).items():
            torch.cuda.empty_cache()
            row = {"case": name, "N": n, "V": v}
            try:
                stack = ExitStack()
                stack.enter_context(filter_launch(best))

                def f(filt=filt):
                    return vocab_parallel_logprobs(x, t, with_entropy=True, check_inputs=False, sampling_filter=filt)

                def fwd():
                    with torch.no_grad():
                        f()

                def fwd_bwd():
                    x.grad = None
                    torch.autograd.backward(f(), (g_lp, g_ent))

                row["fwd_ms"] = median_ms(fwd)
                row["fwd_bwd_ms"] = median_ms(fwd_bwd)
                row["extra_peak_GiB"] = extra_peak_bytes(fwd_bwd) / GiB
                if filt is not None and filt.without_noops(v) is not None:
                    row["threshold_ms"] = median_ms(
                        lambda filt=filt: filter_threshold(x.detach(), filt, t.shape, tp_group=None, inv_temperature=1.0)
                    )
                    row["predicted_threshold_ms"] = predicted_search_ms(filt.without_noops(v), passes)
                    thr = filter_threshold(x.detach(), filt, t.shape, tp_group=None, inv_temperature=1.0)
                    row["mean_kept"] = (x.detach().float() >= thr[:, None]).sum(-1).float().mean().item()
                if name == "unfiltered":
                    base = row
                row["fwd_vs_unfiltered"] = row["fwd_ms"] / base["fwd_ms"]
                row["fwd_bwd_vs_unfiltered"] = row["fwd_bwd_ms"] / base["fwd_bwd_ms"]
            except Exception as err:  # reported, not hidden
                traceback.print_exc()
                row["error"] = repr(err)[:300]
            finally:
                stack.close()
            print(json.dumps(row), flush=True)
            rows.append(row)
        del x
        torch.cuda.empty_cache()
    return rows, all_passes


def check_bitwise(v: int, n: int) -> bool:
    """A few rows alone vs the same rows at spread positions inside n rows: identical bits."""
    x = peaky_logits(n, v, seed=9)
    t = torch.randint(0, v, (n,), device=DEVICE)
    g_lp, g_ent = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)

    def run(rows):
        xx = x[rows].clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs(xx, t[rows], with_entropy=True, check_inputs=False)
        torch.autograd.backward((lp, ent), (g_lp[rows], g_ent[rows]))
        return lp.detach(), ent.detach(), xx.grad

    whole = run(torch.arange(n, device=DEVICE))
    ok = True
    for i in sorted({0, 1 % n, n // 2, n - 1}):
        alone = run(torch.tensor([i], device=DEVICE))
        ok &= all(torch.equal(a[0], w[i]) for a, w in zip(alone, whole))
    return bool(ok)


def graph_ms(fn) -> float:
    """GPU time of one call of ``fn`` (a CUDA-graph replay: no host launch overhead, which eager timing
    includes — ~1 ms a forward+backward, more than the kernels at small N)."""
    return graph_replay_ms(fn, warmup=2, warmup_ms=25, rep_ms=REP_MS)


def run_batch_invariance(args) -> dict:
    """Fixed (V_local-only) launch configuration vs the best of a sweep at each N, forward + backward, timed
    eagerly (host launch overhead included) and as CUDA-graph replays (GPU time only)."""
    configs = [(2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8)]  # launch_config's own is timed as "fixed"
    bitwise = {v: check_bitwise(v, args.tokens) for v in args.vocab}
    print(f"bitwise rows alone == rows inside N={args.tokens}: {bitwise}", flush=True)
    rows = []
    for v in args.vocab:
        fixed = logprob_launch_config(v)
        for n in args.invariance_rows:
            x = peaky_logits(n, v).requires_grad_()
            t = torch.randint(0, v, (n,), device=DEVICE)
            g = torch.randn(n, device=DEVICE)

            def fwd_bwd():
                x.grad = None
                vocab_parallel_logprobs(x, t, check_inputs=False).backward(g)

            row = {"V": v, "N": n}
            for timing, timer in (("eager", median_ms), ("graph", graph_ms)):
                try:
                    timings = {"fixed": timer(fwd_bwd)}
                except Exception as err:  # reported, not hidden
                    traceback.print_exc()
                    row[timing] = {"fixed_ms": float("nan"), "best_config": repr(err)[:80], "best_ms": float("nan"),
                                   "cost": float("nan"), "all_ms": {}}
                    continue
                for block, warps in configs:
                    cfg = replace(fixed, stats_block_v=block, stats_warps=warps,
                                  backward_block_v=block, backward_warps=warps)
                    logprob_launch.logprob_launch_config = lambda _v, cfg=cfg: cfg
                    try:
                        timings[f"{block}x{warps}"] = timer(fwd_bwd)
                    finally:
                        logprob_launch.logprob_launch_config = logprob_launch_config
                best_name = min(timings, key=timings.get)
                row[timing] = {"fixed_ms": timings["fixed"], "best_config": best_name, "best_ms": timings[best_name],
                               "cost": timings["fixed"] / timings[best_name] - 1.0, "all_ms": timings}
            print(json.dumps(row), flush=True)
            rows.append(row)
            del x
            x = None
            torch.cuda.empty_cache()
    return {"bitwise": {str(k): v for k, v in bitwise.items()}, "rows": rows}


def write_report(result: dict, out: Path) -> None:
    (out / "logprob_filter.json").write_text(json.dumps(result, indent=1))
    by = {(r["case"], r["V"]): r for r in result["filters"] if "fwd_bwd_ms" in r}
    v_big = max(r["V"] for r in result["filters"])
    summary = "Summary: " + ", ".join(
        f"{c} {by[(c, v_big)]['fwd_bwd_ms']:.2f} ms ({by[(c, v_big)]['fwd_bwd_vs_unfiltered']:.2f}×)"
        for c in ("top_k=50", "top_p=0.95", "top_k=50, top_p=0.95") if (c, v_big) in by
    ) + (f" forward+backward vs unfiltered {by[('unfiltered', v_big)]['fwd_bwd_ms']:.2f} ms at N = {result['tokens']}, "
         f"V = {v_big}, bf16." if ("unfiltered", v_big) in by else "")
    lines = [
        f"# Sampling-filter replay and batch invariance — {result['device']}",
        "",
        summary,
        "",
        f"Command: `python3 scripts/bench_logprob_filter.py --out docs/benchmarks`. N = {result['tokens']} bf16 "
        "language-model-like logits, `with_entropy=True`, `check_inputs=False`, one GPU (TP = 1: no collective "
        f"runs). Correctness before timing: max |diff| from the float64 reference {result['max_abs_err']:.1e}.",
        "",
        "## Filtered vs unfiltered",
        "",
        "Threshold search: an exact radix select on the logits' 16-bit key (bf16), one read of the logits per pass "
        "(docs/kernel.md). Its building blocks alone, per V: " + "; ".join(
            f"V = {v}: one read (amax) {p['read_ms']:.3f} ms, counting pass {p['count_pass_ms']:.3f} ms, mass pass "
            f"{p['mass_pass_ms']:.3f} ms" for v, p in result["passes"].items()) + ". Predicted search = top-k: 2 "
        "counting passes; top-p: one read (row max) + 2 mass passes + 1 counting pass.",
        "",
        "The passes' formulations side by side (`scripts/bench_filter_passes.py`: `old` / `masked` = the variants "
        "the library does not use, kept in that script only; `where` / `tile` = the library's; a later pass of the search, whose prefix "
        "holds the bulk of the row):",
        "",
        *bench_filter_passes.table({v: p for v, p in result["passes"].items()}),
        "",
        "End-to-end rows below: the library's passes at their fastest measured launch parameters "
        "(" + "; ".join(f"V = {v}: " + ", ".join(f"{k} {b}x{w}" for k, (b, w) in (p.get("end_to_end_launch") or {}).items())
                        for v, p in result["passes"].items()) + "), which `kernels/launch_config.py` hard-codes.",
        "",
        "| filter | V | fwd ms | fwd+bwd ms | × unfiltered fwd / fwd+bwd | threshold search ms (predicted) | mean kept tokens | extra peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["filters"]:
        if "fwd_ms" not in r:
            lines.append(f"| {r['case']} | {r['V']} | error: {r.get('error')} | | | | | |")
            continue
        thr = f"{r['threshold_ms']:.3f} ({r['predicted_threshold_ms']:.3f})" if "threshold_ms" in r else "—"
        kept = f"{r['mean_kept']:.1f}" if "mean_kept" in r else "all"
        lines.append(
            f"| {r['case']} | {r['V']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | "
            f"{r['fwd_vs_unfiltered']:.2f} / {r['fwd_bwd_vs_unfiltered']:.2f} | {thr} | {kept} | {r['extra_peak_GiB']:.2f} |"
        )
    inv = result["batch_invariance"]
    lines += [
        "",
        "## Batch invariance: what the row-count-independent launch configuration costs",
        "",
        f"Bitwise check (rows alone vs inside N = {result['tokens']}, log-prob, entropy and gradient): {inv['bitwise']}.",
        "Cost = fixed configuration (V_local only) / best of the sweep (block x warps of the statistics and "
        "backward kernels) at that N − 1, forward + backward. **eager**: `do_bench` of the Python call, host launch "
        "overhead included (~1 ms, the same for every configuration: at small N it is most of the time); "
        "**graph**: replays of a CUDA graph of the call, GPU time only. The fixed configuration is also in the "
        "sweep, so a cost within a few % is the noise of picking a minimum.",
        "",
        "| V | N | eager: fixed ms | eager: best ms (config) | eager cost | graph: fixed ms | graph: best ms (config) | graph cost |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in inv["rows"]:
        e, gr = r["eager"], r["graph"]
        lines.append(f"| {r['V']} | {r['N']} | {e['fixed_ms']:.3f} | {e['best_ms']:.3f} ({e['best_config']}) | "
                     f"{100 * e['cost']:.1f} % | {gr['fixed_ms']:.3f} | {gr['best_ms']:.3f} ({gr['best_config']}) | "
                     f"{100 * gr['cost']:.1f} % |")
    (out / "logprob_filter.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(result, out / "logprob_filter.png")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vocabs = sorted({r["V"] for r in result["filters"]}, reverse=True)
    fig, axes = plt.subplots(1, len(vocabs), figsize=(7 * len(vocabs), 4.5))
    axes = [axes] if len(vocabs) == 1 else axes
    for ax, v in zip(axes, vocabs):
        rows = [r for r in result["filters"] if r["V"] == v and "fwd_ms" in r]
        names = [r["case"] for r in rows]
        ax.barh(names, [r["fwd_bwd_ms"] for r in rows], color=["tab:gray" if r["case"] == "unfiltered" else "tab:green" for r in rows],
                label="forward + backward")
        ax.barh(names, [r.get("threshold_ms", 0.0) for r in rows], color="tab:orange", label="of which threshold search")
        ax.set_xlabel("median ms")
        ax.set_title(f"N = {result['tokens']}, V = {v}, bf16 ({result['device']})")
        ax.invert_yaxis()
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 18992])
    parser.add_argument("--invariance-rows", type=int, nargs="+", default=[256, 2048, 16384])
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny sizes: check the script only")
    args = parser.parse_args()
    if args.dry_run:
        global DEVICE, median_ms, extra_peak_bytes
        DEVICE = "cpu"
        median_ms = lambda fn, **_: (fn(), 0.001)[1]  # noqa: E731
        global graph_ms
        graph_ms = median_ms
        bench_filter_passes.median_ms = median_ms
        bench_filter_passes.DEVICE = "cpu"
        extra_peak_bytes = lambda fn: (fn(), 0)[1]  # noqa: E731
        torch.cuda.get_device_name = lambda: "CPU dry run"
    elif not torch.cuda.is_available():
        sys.exit("bench_logprob_filter.py needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    err = check_correctness(min(args.vocab))
    print(f"correctness (filtered, V={min(args.vocab)}): max |diff| from float64 = {err:.2e}", flush=True)
    assert err < 1e-3, err
    filters, passes = run_filters(args)
    result = {"device": torch.cuda.get_device_name(), "tokens": args.tokens, "max_abs_err": err,
              "filters": filters, "passes": passes, "batch_invariance": {"bitwise": "not run", "rows": []}}
    write_report(result, args.out)  # written twice: a time limit in the invariance rows keeps the filter rows
    result["batch_invariance"] = run_batch_invariance(args)
    write_report(result, args.out)


if __name__ == "__main__":
    main()
