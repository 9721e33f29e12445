"""The fused-output-layer benchmark's row names, targets and reports (scripts/bench_fused.py): the met / not-met
lines, the markdown tables, the plot and the compact print, written from a run's result dict."""

from __future__ import annotations

import json
from pathlib import Path

BARE = "bare matmul h@Wᵀ + 2 backward GEMMs (no softmax)"
FUSED = "mp_grpo fused_linear_logprobs"
WITH_LOSS = "mp_grpo fused_linear_loss + GRPOLoss (loss in forward)"
LIGER = "Liger LigerFusedLinearGRPOLoss (chunked, compiled)"
GSPO = f"{FUSED} + GSPO GRPOLoss (sequence-level: recompute path)"
CCE = "Apple cut-cross-entropy linear_cross_entropy"
FP32 = ", logit_dtype=fp32"
"""Suffix of the rows with logits kept in fp32 (``LogitDtype.FP32``)."""
NOT_MEASURED = "not measured this run"
"""How the reports name a row that was skipped or failed (its reason follows)."""
TARGET_TIME_RATIO = 1.10  # fwd+bwd of the fused output layer + loss vs. the bare matmuls (the target)
TARGET_EXTRA_GiB = 1.0
TARGET_LIGER_SPEEDUP = 3.0
TARGET_FP32_TIME_RATIO = 1.15
"""fp32 logits: fwd+bwd of fused_linear_loss + GRPOLoss vs. the bare bf16 matmuls (memory: TARGET_EXTRA_GiB); the
per-token op at fp32 no slower than at bf16."""
TARGET_REPLAY_RATIOS = {"loss_support": 1.10, "loss_top_k": 1.15}
"""fwd+bwd of the replay rows vs. the same op without them (the ``loss`` row): the captured support (512 ids a token)
and the log-probs at the engine's K = 20 top-K ids."""


def _verdict(value: float, limit: float, unit: str, at_most: bool = True) -> str:
    """``met (by x)`` / ``NOT MET (by x)`` for ``value`` against ``limit`` (an upper bound, or a lower one)."""
    margin = limit - value if at_most else value - limit
    return f"{'met' if margin >= 0 else 'NOT MET'} (by {abs(margin):.2f}{unit})"


def _interval(r: dict, key: str) -> str:
    """`` [low, high], N interleaved rounds`` of a row's ratio where it has them ('' for a ratio of two medians)."""
    iv = r.get(f"{key}_interval")
    return "" if iv is None else f" [95 % interval {iv['low']:.3f}–{iv['high']:.3f}, {iv['n']} interleaved rounds]"


def _targets(result: dict) -> list[str]:
    """One line per target and vocabulary size (met or not, and by how much), then the sequence-level case."""
    lines = []
    for v in sorted({r["V"] for r in result["rows"]}, reverse=True):
        rows = {r["key"]: r for r in result["rows"] if r["V"] == v}
        ours, bare, liger = rows.get("loss", {}), rows.get("bare", {}), rows.get("liger", {})
        if "fwd_bwd_ms" not in ours:
            lines.append(f"- V = {v}: {WITH_LOSS} {NOT_MEASURED} ({ours.get('error', 'row not run')})")
            continue
        if "fwd_bwd_vs_bare" in ours:
            ratio = ours["fwd_bwd_vs_bare"]
            lines.append(
                f"- V = {v}, time: {WITH_LOSS} fwd+bwd {ours['fwd_bwd_ms']:.2f} ms = {ratio:.3f}x the bare matmuls "
                f"({bare['fwd_bwd_ms']:.2f} ms){_interval(ours, 'fwd_bwd_vs_bare')}; target ≤ {TARGET_TIME_RATIO:.2f}x: "
                f"{_verdict(ratio, TARGET_TIME_RATIO, 'x')[:-1]} = "
                f"{abs(TARGET_TIME_RATIO * bare['fwd_bwd_ms'] - ours['fwd_bwd_ms']):.2f} ms)"
            )
        else:
            lines.append(f"- V = {v}, time: the bare matmul row did not run, no ratio")
        lines.append(
            f"- V = {v}, memory: extra peak {ours['extra_peak_GiB']:.2f} GiB; target ≤ {TARGET_EXTRA_GiB:.1f} GiB: "
            f"{_verdict(ours['extra_peak_GiB'], TARGET_EXTRA_GiB, ' GiB')}"
        )
        if "liger_fwd_bwd_over_this" in ours and "fwd_bwd_ms" in liger:
            speedup = ours["liger_fwd_bwd_over_this"]
            lines.append(
                f"- V = {v}, vs Liger: {speedup:.1f}x faster than {LIGER} ({liger['fwd_bwd_ms']:.1f} ms); target ≥ "
                f"{TARGET_LIGER_SPEEDUP:.1f}x: {_verdict(speedup, TARGET_LIGER_SPEEDUP, 'x', at_most=False)}"
            )
        else:
            why = liger.get("skipped") or liger.get("error") or "row not run"
            lines.append(f"- V = {v}, vs Liger: {NOT_MEASURED} ({why})")
        lines += _fp32_targets(v, rows)
        lines += _replay_targets(v, rows)
        gspo = rows.get("gspo", {})
        if "fwd_bwd_vs_bare" in gspo:
            lines.append(
                f"- V = {v}, sequence-level objective (GSPO; no target, the recompute path): "
                f"{gspo['fwd_bwd_ms']:.2f} ms "
                f"= {gspo['fwd_bwd_vs_bare']:.3f}x the bare matmuls, extra peak {gspo['extra_peak_GiB']:.2f} GiB"
            )
    return lines


def _fp32_targets(v: int, rows: dict) -> list[str]:
    """The fp32-logit rows' targets at one V: the loss op vs the bare matmuls and its memory, the per-token op vs bf16."""
    lines = []
    loss, bare, op, op16 = (rows.get(k, {}) for k in ("loss_fp32", "bare", "per_token_fp32", "per_token"))
    if "fwd_bwd_ms" in loss and "fwd_bwd_ms" in bare:
        ratio = loss.get("fwd_bwd_vs_bare", loss["fwd_bwd_ms"] / bare["fwd_bwd_ms"])
        margin_ms = (TARGET_FP32_TIME_RATIO - ratio) * bare["fwd_bwd_ms"]
        lines.append(
            f"- V = {v}, fp32 logits, time: {WITH_LOSS}{FP32} {loss['fwd_bwd_ms']:.2f} ms = {ratio:.3f}x the bare bf16 "
            f"matmuls{_interval(loss, 'fwd_bwd_vs_bare')}; target ≤ {TARGET_FP32_TIME_RATIO:.2f}x: "
            f"{'met' if margin_ms >= 0 else 'NOT MET'} "
            f"(by {abs(ratio - TARGET_FP32_TIME_RATIO):.4f}x = {abs(margin_ms):.3f} ms)")
        lines.append(
            f"- V = {v}, fp32 logits, memory: extra peak {loss['extra_peak_GiB']:.2f} GiB; target ≤ "
            f"{TARGET_EXTRA_GiB:.1f} GiB: {_verdict(loss['extra_peak_GiB'], TARGET_EXTRA_GiB, ' GiB')}")
    elif loss:
        lines.append(f"- V = {v}, fp32 logits: {WITH_LOSS}{FP32} or the bare row {NOT_MEASURED} "
                     f"({loss.get('skipped') or loss.get('error') or bare.get('error') or 'row not run'})")
    if "fwd_bwd_ms" in op and "fwd_bwd_ms" in op16:
        ratio = op.get("fwd_bwd_vs_bf16", op["fwd_bwd_ms"] / op16["fwd_bwd_ms"])
        lines.append(
            f"- V = {v}, fp32 logits, per-token op: {FUSED}{FP32} {op['fwd_bwd_ms']:.2f} ms = {ratio:.3f}x the bf16 op "
            f"({op16['fwd_bwd_ms']:.2f} ms){_interval(op, 'fwd_bwd_vs_bf16')}; target ≤ 1.00x: "
            f"{_verdict(ratio, 1.0, 'x')[:-1]} = {abs(ratio - 1.0) * op16['fwd_bwd_ms']:.2f} ms)")
    return lines


def _replay_targets(v: int, rows: dict) -> list[str]:
    """The captured-support and top-K rows at one V, each against the op without them (the ``loss`` row)."""
    lines = []
    base = rows.get("loss", {})
    for key, limit in TARGET_REPLAY_RATIOS.items():
        row = rows.get(key)
        if row is None:
            continue
        if "fwd_bwd_ms" not in row or "fwd_bwd_ms" not in base:
            why = row.get("skipped") or row.get("error") or base.get("error") or "the loss row did not run"
            lines.append(f"- V = {v}, {row['case']}: {NOT_MEASURED} ({why})")
            continue
        ratio = row["fwd_bwd_ms"] / base["fwd_bwd_ms"]
        lines.append(f"- V = {v}, {row['case']}: fwd+bwd {row['fwd_bwd_ms']:.2f} ms = {ratio:.3f}x the op without it "
                     f"({base['fwd_bwd_ms']:.2f} ms); target ≤ {limit:.2f}x: {_verdict(ratio, limit, 'x')}; "
                     f"extra peak {row['extra_peak_GiB']:.2f} GiB")
    return lines


def _precision(r: dict) -> str:
    if "logprob_max_abs" not in r:
        return "—"
    return f"{r['logprob_max_abs']:.1e} / {r['logprob_mean_abs']:.1e}"


def _predicted(p: dict | None) -> str:
    """The prediction written before the run: fwd+bwd ms, extra GiB, log-prob max abs. error (what it covers)."""
    if not p:
        return "—"
    parts = []
    if "fwd_bwd_ms" in p:
        parts.append(f"{p['fwd_bwd_ms']:.2f} ms")
    elif "delta_ms" in p:
        parts.append(f"bf16 row {p['delta_ms']:+.2f} ms")
    if "extra_peak_GiB" in p:
        parts.append(f"{p['extra_peak_GiB']:.2f} GiB")
    if "logprob_max_abs" in p:
        parts.append(f"max err {p['logprob_max_abs']:.0e}")
    return ", ".join(parts)


def _prediction_notes(rows: list[dict]) -> list[str]:
    """One line per row whose prediction has a basis (the model's terms), for the report's foot."""
    return [f"- {r['case']}, V = {r['V']}: {r['predicted']['basis']}" for r in rows if r.get("predicted", {}).get("basis")]


def write_single_gpu_report(result: dict, out: Path, plot: bool = True) -> None:
    (out / "fused.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Output layer + token log-probs, fused vs. unfused — {result['device']}",
        "",
        f"N = {result['tokens']} tokens, H = {result['hidden']}, bf16, one GPU (torch {result['torch']}). "
        "Median of triton.testing.do_bench; a row's forward+backward against the bare matmuls (and an fp32 row's "
        "against its bf16 row), where the row has interleaved rounds, is the median of the per-round ratios of the "
        "two timed in alternating order in one process (CUDA events; `scripts/measure.py`), with its 95 % interval "
        "in brackets — else the ratio of the two medians. Extra peak: peak of one forward+backward beyond the memory allocated "
        "before it (inputs and the previous step's gradients, which each step frees and allocates again). "
        "mp_grpo rows run with `check_inputs=False`. Liger and `fused_linear_loss` compute the loss's gradients in "
        "forward: their forward and forward+backward are therefore alike. Loss rows: GRPOLoss (PPO clip, or GSPO) on "
        "8 padded sequences, on-policy (every token has a gradient). `logit_dtype=fp32`: logits kept in fp32 from "
        "the same bf16 operands. Log-prob error: max / mean abs. difference from float64 logits of the same bf16 "
        f"operands on the first {result.get('precision_rows', 1024)} tokens (unit-scale logits: std ~0.64; "
        "`docs/benchmarks/precision.md` has trained-model scales). Predicted: written before the first run "
        "(`scripts/fused_predictions.py`; the terms below the targets). Command: "
        f"`{result.get('command', 'python scripts/bench_fused.py --profile --out docs/benchmarks')}`.",
        "",
        "| implementation | V | fwd ms | fwd+bwd ms | fwd+bwd / bare matmul | extra peak GiB | Liger fwd+bwd / this | "
        "log-prob error max / mean | predicted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "fwd_bwd_ms" in r:
            vs_bare = f"{r['fwd_bwd_vs_bare']:.3f}" if "fwd_bwd_vs_bare" in r else "—"
            if "fwd_bwd_vs_bare_interval" in r:
                iv = r["fwd_bwd_vs_bare_interval"]
                vs_bare += f" [{iv['low']:.3f}, {iv['high']:.3f}]"
            vs_liger = f"{r['liger_fwd_bwd_over_this']:.1f}" if "liger_fwd_bwd_over_this" in r else "—"
            lines.append(
                f"| {r['case']} | {r['V']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | {vs_bare} | "
                f"{r['extra_peak_GiB']:.2f} | {vs_liger} | {_precision(r)} | {_predicted(r.get('predicted'))} |"
            )
        else:
            why = r.get("skipped") or r.get("error")
            lines.append(f"| {r['case']} | {r['V']} | — | — | — | — | {NOT_MEASURED}: {why} | — | "
                         f"{_predicted(r.get('predicted'))} |")
    lines += ["", "Targets (the fused output layer + loss, one GPU), one line each:", *_targets(result)]
    notes = _prediction_notes(result["rows"])
    if notes:
        lines += ["", "Predictions' terms:", *notes]
    (out / "fused.md").write_text("\n".join(lines) + "\n")
    if plot:
        plot_single_gpu(result, out / "fused.png")


def plot_single_gpu(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vocabs = sorted({r["V"] for r in result["rows"]}, reverse=True)
    most = max(sum(1 for r in result["rows"] if r["V"] == v and "fwd_bwd_ms" in r) for v in vocabs)
    fig, axes = plt.subplots(2, len(vocabs), figsize=(7 * len(vocabs), 2 * max(4.0, 0.45 * most)), squeeze=False)
    for col, v in enumerate(vocabs):
        rows = [r for r in result["rows"] if r["V"] == v and "fwd_bwd_ms" in r]
        names = [r["case"].replace(" + ", "\n+ ").replace(": ", ":\n") for r in rows]
        colors = ["tab:blue" if r["case"].endswith(FP32) else "tab:green" if r["case"].startswith(WITH_LOSS)
                  else "tab:olive" if r["case"].startswith(FUSED) else "tab:purple" if r["case"].startswith(CCE)
                  else "tab:gray" for r in rows]
        time_ax, mem_ax = axes[0][col], axes[1][col]
        time_ax.barh(names, [r["fwd_bwd_ms"] for r in rows], color=colors)
        bare = next((r for r in rows if r["case"] == BARE), None)
        if bare is not None:
            limit = TARGET_TIME_RATIO * bare["fwd_bwd_ms"]
            time_ax.axvline(limit, color="tab:red", linestyle="--", label=f"{TARGET_TIME_RATIO}x bare matmul = {limit:.1f} ms")
            time_ax.legend(loc="lower right", fontsize=8)
        time_ax.set_xlabel("forward + backward, median ms")
        time_ax.set_title(f"N = {result['tokens']}, H = {result['hidden']}, V = {v}, bf16 ({result['device']})", fontsize=9)
        mem_ax.barh(names, [r["extra_peak_GiB"] for r in rows], color=colors)
        mem_ax.axvline(TARGET_EXTRA_GiB, color="tab:red", linestyle="--", label=f"{TARGET_EXTRA_GiB} GiB")
        mem_ax.legend(loc="lower right", fontsize=8)
        mem_ax.set_xlabel("extra peak memory, GiB")
        for ax in (time_ax, mem_ax):
            ax.invert_yaxis()
            ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_tp_report(result: dict, out: Path) -> None:
    tp = result["tp"]
    (out / f"fused_tp{tp}.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Fused output layer + log-probs, TP = {tp} — {result['device']}",
        "",
        f"N = {result['tokens']}, H = {result['hidden']}, bf16; W's rows split over {tp} ranks (NCCL), the full hidden "
        f"states on every rank. Median of {result['iters']} iterations timed with CUDA events after a barrier. The "
        "all-reduce of the hidden gradient is what Megatron's mapping adds after any column-parallel output layer "
        "(the op leaves it to the mapping); it is not in the op's times. Command: "
        f"`torchrun --nproc_per_node {tp} scripts/bench_fused.py --tp {tp} --out docs/benchmarks`.",
        "",
        "| V | V_local | rank | fused fwd ms | fused fwd+bwd ms | bare matmul fwd / fwd+bwd ms | fused / bare fwd+bwd | "
        "stats all-gather ms (% of fused fwd) | grad-hidden all-reduce ms | fused extra peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in result["rows"]:
        for rank, r in enumerate(entry["per_rank"]):
            lines.append(
                f"| {r['V']} | {r['V_local']} | {rank} | {r['fused_fwd_ms']:.2f} | {r['fused_fwd_bwd_ms']:.2f} | "
                f"{r['bare_fwd_ms']:.2f} / {r['bare_fwd_bwd_ms']:.2f} | {r['fused_fwd_bwd_vs_bare']:.2f} | "
                f"{r['stats_all_gather_ms']:.3f} ({100 * r['all_gather_frac_of_fused_fwd']:.1f} %) | "
                f"{r['grad_hidden_all_reduce_ms']:.2f} | {r['fused_extra_peak_GiB']:.2f} |"
            )
    lines += _tp_side_by_side(result)
    (out / f"fused_tp{tp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _tp_side_by_side(result: dict) -> list[str]:
    """The implementations on the same shards, each figure the largest over the ranks."""
    if not any("impls" in entry["per_rank"][0] for entry in result["rows"]):
        return []
    lines = [
        "",
        "Side by side on the same shards (each figure the largest over the ranks; cut-cross-entropy with "
        "`VocabParallelOptions(reduce_e_grad=False)`: the hidden gradient left partial, as mp_grpo's ops leave it to "
        "Megatron's mapping). Log-prob error: max / mean abs. difference from float64 logits of the same bf16 operands "
        f"on the first {result.get('precision_rows', 1024)} tokens.",
        "",
        "| implementation | V | fwd ms | fwd+bwd ms | fwd+bwd / bare matmul | extra peak GiB | log-prob error max / mean "
        "| predicted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in result["rows"]:
        ranks = entry["per_rank"]
        v = ranks[0]["V"]
        for i, first in enumerate(ranks[0].get("impls", [])):
            per = [r["impls"][i] for r in ranks]
            if "fwd_bwd_ms" not in first:
                why = first.get("skipped") or first.get("error")
                lines.append(f"| {first['case']} | {v} | {NOT_MEASURED}: {why} | | | | | "
                             f"{_predicted(first.get('predicted'))} |")
                continue

            def top(k):
                return max(p[k] for p in per if k in p)

            ratio = f"{top('fwd_bwd_vs_bare'):.2f}" if "fwd_bwd_vs_bare" in first else "—"
            err = _precision({k: top(k) for k in ("logprob_max_abs", "logprob_mean_abs")}) if "logprob_max_abs" in first else "—"
            lines.append(f"| {first['case']} | {v} | {top('fwd_ms'):.2f} | {top('fwd_bwd_ms'):.2f} | {ratio} | "
                         f"{top('extra_peak_GiB'):.2f} | {err} | {_predicted(first.get('predicted'))} |")
    return lines


def print_compact(result: dict) -> None:
    print(f"\n{'implementation':<58} {'V':>7} {'fwd ms':>8} {'fwd+bwd':>8} {'x bare':>7} {'GiB':>6}")
    for r in result["rows"]:
        if "fwd_bwd_ms" in r:
            ratio = f"{r['fwd_bwd_vs_bare']:.2f}" if "fwd_bwd_vs_bare" in r else "—"
            print(f"{r['case'][:58]:<58} {r['V']:>7} {r['fwd_ms']:>8.2f} {r['fwd_bwd_ms']:>8.2f} {ratio:>7} "
                  f"{r['extra_peak_GiB']:>6.2f} {_precision(r):>17}")
        else:
            print(f"{r['case'][:58]:<58} {r['V']:>7} {(r.get('skipped') or r.get('error'))[:60]}")
    print("\n".join(_targets(result)))
