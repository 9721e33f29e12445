"""The log-prob benchmark's targets and reports (scripts/bench_logprob.py): the met / not-met lines, the markdown
tables and the plots, written from a run's result dict (and the TP runs' JSON files)."""

from __future__ import annotations

import json
from pathlib import Path

LOSS_ROWS = ("mp_grpo logits->loss DAPO token-mean", "mp_grpo logits->loss GSPO + seq TIS",
             "mp_grpo logits->loss everything")
FLOOR_TARGET = 0.90
HOST_TARGET_US = 100.0
CHECK_COST_TARGET = 0.03


def targets_summary(result: dict) -> list[str]:
    """One met / not-met line per target, from this run's rows."""

    def floor_fb(r: dict) -> float:
        return r["fwd_bwd_floor_frac"] * r["fwd_bwd_ms"]  # the floor in ms
    rows = {(r["case"], r["V"]): r for r in result["rows"]}
    vocabs = sorted({r["V"] for r in result["rows"]}, reverse=True)
    lines = []
    for v in vocabs:
        for case in LOSS_ROWS:
            r = rows.get((case, v), {})
            if "fwd_bwd_ms" not in r:
                lines.append(f"{case}, V={v}: not measured ({r.get('error') or r.get('skipped')})")
                continue
            frac, host = r["fwd_bwd_floor_frac"], r["host_us"]
            floor_verdict = "MET" if frac >= FLOOR_TARGET else f"NOT MET by {100 * (FLOOR_TARGET - frac):.0f} points"
            host_verdict = "MET" if host <= HOST_TARGET_US else f"NOT MET ({host / HOST_TARGET_US:.1f}x)"
            graph = (f"CUDA graph replay {r['graph_ms']:.3f} ms = {100 * r['graph_floor_frac']:.0f} % of the floor"
                     if "graph_ms" in r else f"graph: {r.get('graph_error')}")
            normal = (f" (normal launch: {r['host_us_normal_launch']:.0f} us, "
                      f"{100 * floor_fb(r) / r['fwd_bwd_ms_normal_launch']:.0f} % of the floor)"
                      if "host_us_normal_launch" in r else "")
            lines.append(
                f"{case}, V={v}: {100 * frac:.0f} % of the memory floor (target >= {100 * FLOOR_TARGET:.0f} %): "
                f"{floor_verdict}; host {host:.0f} us per fwd+bwd call (target <= {HOST_TARGET_US:.0f} us): "
                f"{host_verdict}{normal}; {graph}"
            )
        off = rows.get(("mp_grpo vocab_parallel_logprobs unchecked (OFF)", v), {})
        on = rows.get(("mp_grpo vocab_parallel_logprobs checked (default DEFERRED)", v), {})
        if "fwd_bwd_ms" in off and "fwd_bwd_ms" in on:
            cost = on["fwd_bwd_ms"] / off["fwd_bwd_ms"] - 1.0
            lines.append(f"checking costs nothing, V={v}: default checked {on['fwd_bwd_ms']:.3f} ms vs unchecked "
                         f"{off['fwd_bwd_ms']:.3f} ms ({100 * cost:+.1f} %, target within {100 * CHECK_COST_TARGET:.0f} %): "
                         f"{'MET' if cost <= CHECK_COST_TARGET else 'NOT MET'}")
        graphed = [r for (c, vv), r in rows.items() if vv == v and c.startswith("mp_grpo") and "SYNC" not in c]
        bad = [r["case"] for r in graphed if "graph_ms" not in r]
        lines.append(f"CUDA-graph capturable with default arguments, V={v}: "
                     + ("MET (every mp_grpo row captured and replayed)" if graphed and not bad else f"NOT MET: {bad}"))
    return lines


def write_single_gpu_report(result: dict, out: Path) -> None:
    (out / "logprob.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Token log-probs from bf16 logits — {result['device']}",
        "",
        f"N = {result['tokens']} tokens; copy bandwidth measured in the same run: {result['copy_TBps']:.2f} TB/s. "
        "Floor: forward reads the logits once; forward+backward reads them twice and writes the bf16 gradient "
        "once. Extra peak: memory beyond the inputs and one gradient buffer. mp_grpo rows run with "
        "the check mode the row names (the default is `CheckInputs.DEFERRED`: no host read). logits->loss rows: "
        "`GRPOLoss(cfg).on_logits(logits, target, ...)` (one autograd Function) with default arguments and "
        "`loss.backward()`; *two ops*: `GRPOLoss(cfg)(vocab_parallel_logprobs(logits, target), ...)`; the loss "
        "fused (Triton), a GlobalBatch built beforehand; same floor as the op. *host us*: CPU time to issue one "
        "forward+backward call. *graph*: the same forward+backward captured in a CUDA graph, median replay. "
        "*normal launch*: the same mp_grpo row with `mp_grpo.ops.launcher`'s fast launch off (Triton's "
        f"`kernel[grid]`), same run. torch {result.get('torch')}, triton {result.get('triton')}; fast launch: "
        f"{result.get('fast_launch')}. Command: `python scripts/bench_logprob.py --out docs/benchmarks"
        + (f" --only {' '.join(repr(x) for x in result['only'])}" if result.get("only") else "") + "`.",
        "",
        *(f"- {line}" for line in result.get("summary", [])),
        "",
        "| implementation | V | fwd ms | fwd+bwd ms | extra peak | % of floor fwd / fwd+bwd | host us | graph ms (% floor) "
        "| normal launch: fwd+bwd ms (% floor) / host us |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "fwd_ms" in r:
            extra = f"{r['extra_peak_GiB']:.2f} GiB" if r["extra_peak_GiB"] >= 0.01 else f"{r['extra_peak_bytes_per_row']:.0f} B/row"
            host = f"{r['host_us']:.0f}" if "host_us" in r else ""
            graph = (f"{r['graph_ms']:.3f} ({100 * r['graph_floor_frac']:.0f})" if "graph_ms" in r
                     else (f"failed: {r['graph_error'][:60]}" if "graph_error" in r else ""))
            normal = (f"{r['fwd_bwd_ms_normal_launch']:.3f} "
                      f"({100 * r['fwd_bwd_floor_frac'] * r['fwd_bwd_ms'] / r['fwd_bwd_ms_normal_launch']:.0f}) / "
                      f"{r['host_us_normal_launch']:.0f}" if "host_us_normal_launch" in r else "")
            lines.append(
                f"| {r['case']} | {r['V']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {extra} | "
                f"{100 * r['fwd_floor_frac']:.0f} / {100 * r['fwd_bwd_floor_frac']:.0f} | {host} | {graph} | {normal} |"
            )
        else:
            why = (r.get("skipped") or r.get("error"))[:100]
            lines.append(f"| {r['case']} | {r['V']} | — | — | — | {why} | | | |")
    (out / "logprob.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot_single_gpu(result, out / "logprob.png")


def plot_single_gpu(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vocabs = sorted({r["V"] for r in result["rows"]}, reverse=True)
    fig, axes = plt.subplots(1, len(vocabs), figsize=(7 * len(vocabs), 4.5))
    axes = [axes] if len(vocabs) == 1 else axes
    for ax, v in zip(axes, vocabs):
        rows = [r for r in result["rows"] if r["V"] == v and "fwd_ms" in r]
        names = [r["case"].replace("vocab_parallel", "vp").replace("mp_grpo ", "mp_grpo\n") for r in rows]
        ax.barh(names, [r["fwd_bwd_ms"] for r in rows], color=["tab:green" if "mp_grpo" in r["case"] else "tab:gray" for r in rows])
        floor = 3 * result["tokens"] * v * 2 / (result["copy_TBps"] * 1e12) * 1e3
        ax.axvline(floor, color="tab:red", linestyle="--", label=f"memory floor {floor:.2f} ms")
        ax.set_xlabel("forward + backward, median ms")
        ax.set_title(f"N = {result['tokens']}, V = {v}, bf16 ({result['device']})")
        ax.invert_yaxis()
        ax.legend(loc="lower right")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_tp_report(result: dict, out: Path) -> None:
    tp = result["tp"]
    (out / f"logprob_tp{tp}.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Tensor-parallel log-probs, TP = {tp} — {result['device']}",
        "",
        f"N = {result['tokens']}, bf16, the global vocabulary split over {tp} ranks (NCCL). Median of {result['iters']} "
        "iterations timed with CUDA events after a barrier, per rank. Command: "
        f"`torchrun --nproc_per_node {tp} scripts/bench_logprob.py --out docs/benchmarks`.",
        "",
        "| V | V_local | rank | stats kernel ms | all-gather ms | fwd ms | all-gather / fwd | fwd+bwd ms | megatron-core CE fwd / fwd+bwd ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in result["rows"]:
        for rank, r in enumerate(entry["per_rank"]):
            mc = f"{r['megatron_ce_fwd_ms']:.3f} / {r['megatron_ce_fwd_bwd_ms']:.3f}" if "megatron_ce_fwd_ms" in r else "—"
            lines.append(
                f"| {r['V']} | {r['V_local']} | {rank} | {r['stats_kernel_ms']:.3f} | {r['all_gather_ms']:.3f} | "
                f"{r['fwd_ms']:.3f} | {100 * r['all_gather_frac_of_fwd']:.1f} % | {r['fwd_bwd_ms']:.3f} | {mc} |"
            )
    (out / f"logprob_tp{tp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot_tp_scaling(out: Path) -> None:
    """Per-rank time vs. TP size, from every logprob_tp*.json in ``out`` (rank 0's numbers; ranks agree)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = sorted((json.loads(p.read_text()) for p in out.glob("logprob_tp*.json")), key=lambda r: r["tp"])
    if not results:
        return
    vocabs = sorted({e["per_rank"][0]["V"] for r in results for e in r["rows"]}, reverse=True)
    fig, axes = plt.subplots(1, len(vocabs), figsize=(6 * len(vocabs), 4.2))
    axes = [axes] if len(vocabs) == 1 else axes
    for ax, v in zip(axes, vocabs):
        rows = [(r["tp"], e["per_rank"][0]) for r in results for e in r["rows"] if e["per_rank"][0]["V"] == v]
        tps = [tp for tp, _ in rows]
        for key, label in [("fwd_bwd_ms", "forward + backward"), ("fwd_ms", "forward"),
                           ("stats_kernel_ms", "statistics kernel"), ("all_gather_ms", "all-gather [N+1, 4]")]:
            ax.plot(tps, [r[key] for _, r in rows], marker="o", label=label)
        if all("megatron_ce_fwd_bwd_ms" in r for _, r in rows):
            ax.plot(tps, [r["megatron_ce_fwd_bwd_ms"] for _, r in rows], marker="x", linestyle="--",
                    label="megatron-core CE forward + backward")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(tps, [str(t) for t in tps])
        ax.set_xlabel("tensor-parallel size")
        ax.set_ylabel("ms per rank (median)")
        ax.set_title(f"N = {results[0]['tokens']}, V = {v} split over TP ranks ({results[0]['device']})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "logprob_tp_scaling.png", dpi=120)
