"""Results and reports of ``bench_step.py``: ``step.json`` (resumable), ``step.md`` (tables, targets, predictions
beside the measurements) and ``step.png``.

The targets, on every configuration: in the training and the forward-only passes the fused path takes ≤ 1.01×
the floor's time and fits ≥ 0.95× its tokens and the logits path takes ≤ 1.02× the floor's time; the whole step
is held to the same time targets; the forward-only pass on the logits path fits ≥ 2× the common path's tokens.
The predictions were written before the runs that measured the rows.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field
from pathlib import Path as FilePath

PLAN = [
    ("1.5b", 2048, "selective"), ("1.5b", 2048, "full"), ("0.5b", 2048, "selective"), ("0.5b", 2048, "full"),
    ("1.5b", 8192, "selective"), ("1.5b", 8192, "full"), ("0.5b", 8192, "selective"), ("0.5b", 8192, "full"),
]
"""The order the configurations run in: the headline (1.5B at 2048 tokens) first."""
PATH_ORDER = ["floor", "common", "logits_model_layer", "logits", "fused"]
PATH_NAMES = {
    "floor": "floor: decoder, no output layer, no loss + bare output matmuls timed apart",
    "common": "common: fp32 logits, megatron-core vocab_parallel_cross_entropy, torch PPO loss (verl's Megatron path)",
    "logits_model_layer": "mp_grpo logits path on GPTModel's own output layer (before the batch-major layer)",
    "logits": "mp_grpo logits path (GRPOLoss.on_logits, batch-major output layer)",
    "fused": "mp_grpo fused output layer + loss",
}
KIND_TITLES = {
    "train": "Training pass: forward + loss + backward of one micro-batch (forward_backward_func, finalize_model_grads)",
    "forward": "Forward-only log-prob pass (old / reference policy), no_grad",
    "step": "Whole GRPO step: forward-only pass + training pass + megatron-core Adam step",
}
KIND_NOTES = {
    "train": "The floor's time is its decoder's plus the bare output-layer matmuls' (in brackets); its peak and max "
             "tokens are the decoder's alone. Peaks include the bf16 weights and Megatron DDP's fp32 gradient buffers "
             "(1.5B: 2.9 + 5.8 GiB; 0.5B: 0.9 + 1.9 GiB).",
    "forward": "A no-grad pass recomputes nothing (megatron-core's checkpointing only wraps the forward), so these rows "
               "were measured once per shape and length, with the selective-recompute model. The floor is the decoder's "
               "forward plus the output matmul; its max tokens are the decoder's alone.",
    "step": "Two micro-batches of 8192 tokens: the forward-only pass over both (old log-probs), then the training pass "
            "over both (on-policy: the old log-probs are the current ones), then megatron-core's Adam "
            "(`Float16OptimizerWithFloat16Params`: fp32 master weights, gradient clipping at 1.0). The floor's step runs "
            "the decoder in both passes; its output matmuls (one forward GEMM and three training GEMMs per "
            "micro-batch) are timed apart and added.",
}
TARGET_FUSED_TIME = 1.01
TARGET_FUSED_TOKENS = 0.95
TARGET_LOGITS_TIME = 1.02
TARGET_FORWARD_TOKENS_VS_COMMON = 2.0

# (shape, seq, kind, path, metric) -> predicted value, both recompute modes unless the key names one.
# Written before the first run from the independent harness's table and the change's arithmetic:
# the batch-major layer removes three [N, V] bf16 copies (3 × 2.32 GiB read + written ≈ 5 ms of ~450 ms at
# 8192 tokens) and one [N, V] buffer at the peak (2.32 GiB); the fused path holds the tied weight's [V, H]
# gradient (0.43 GiB) through backward, which the floor has not.
PREDICTIONS = {
    ("1.5b", 2048, "train", "fused", "time_vs_floor"): 1.005,
    ("1.5b", 2048, "train", "logits", "time_vs_floor"): 1.012,
    ("1.5b", 2048, "train", "logits_model_layer", "time_vs_floor"): 1.023,
    ("1.5b", 2048, "train", "common", "time_vs_floor"): 1.07,
    ("1.5b", 2048, "train", "fused", "tokens_vs_floor"): 0.98,
    ("1.5b", 2048, "forward", "common", "time_vs_floor"): 1.10,
    ("1.5b", 2048, "forward", "logits", "time_vs_floor"): 1.02,
    ("1.5b", 2048, "forward", "fused", "time_vs_floor"): 1.01,
    ("1.5b", 2048, "forward", "logits", "tokens_vs_common"): 2.7,
    ("1.5b", 2048, "forward", "logits_model_layer", "tokens_vs_common"): 1.5,
    ("1.5b", 2048, "step", "common", "time_vs_floor"): 1.06,
    ("1.5b", 2048, "step", "logits", "time_vs_floor"): 1.01,
    ("1.5b", 2048, "step", "fused", "time_vs_floor"): 1.005,
}

# Predictions for the last change, written before the run that measured it: (1) both output paths add the output
# weight's gradient into DDP's main_grad (mp_grpo/megatron/main_grad.py), so the tied weight's 0.43 GiB [V, H]
# gradient is no longer held through the decoder's backward — at B = 10 the floor peaks at 75.81 GiB and the
# first run's fused path would have needed ~76.2, over what fits; (2) the forward-only rows build MegatronGRPO
# once, outside the timed pass (the first run built it, its config loaded, in every pass); what remains over the
# floor is the log-prob kernel's one read of the bf16 logits (2.3 GiB at ~3 TB/s ≈ 0.8 ms).
CHANGE_PREDICTIONS = {
    ("1.5b", 2048, "train", "fused", "tokens_vs_floor"): 1.00,
    ("1.5b", 2048, "train", "logits", "tokens_vs_floor"): 1.00,
    ("1.5b", 2048, "forward", "logits", "time_vs_floor"): 1.006,
    ("1.5b", 2048, "forward", "fused", "time_vs_floor"): 1.01,
    ("0.5b", 2048, "forward", "logits", "time_vs_floor"): 1.008,
    ("0.5b", 2048, "forward", "fused", "time_vs_floor"): 1.01,
    ("1.5b", 2048, "step", "logits", "time_vs_floor"): 1.005,
    ("1.5b", 2048, "step", "fused", "time_vs_floor"): 1.007,
}


def row_key(shape: str, seq: int, recompute: str, kind: str, path) -> str:
    return f"{shape}|{seq}|{recompute}|{kind}|{getattr(path, 'value', path)}"


@dataclass
class Results:
    """The rows of ``step.json`` by key, and the runs that measured them."""

    path: FilePath
    meta: dict = field(default_factory=dict)
    rows: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: FilePath) -> Results:
        if not path.exists():
            return cls(path)
        data = json.loads(path.read_text())
        rows = {row_key(r["shape"], r["seq"], r["recompute"], r["kind"], r["path"]): r for r in data["rows"]}
        return cls(path, data.get("meta", {}), rows)

    def start(self, command: str) -> None:
        import torch

        versions = {"torch": torch.__version__, "python": platform.python_version()}
        try:
            import megatron.core
            import triton

            versions.update(megatron_core=megatron.core.__version__, triton=triton.__version__)
        except ImportError:
            pass
        if torch.cuda.is_available():
            versions["device"] = torch.cuda.get_device_name()
        import os

        self.meta.setdefault("runs", []).append({"command": command, **versions,
                                                  "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")})
        self.meta.update(versions)

    def row(self, key: str) -> dict:
        return self.rows.get(key, {})

    def update(self, key: str, values: dict) -> None:
        shape, seq, recompute, kind, path = key.split("|")
        row = self.rows.setdefault(key, {"shape": shape, "seq": int(seq), "recompute": recompute, "kind": kind,
                                         "path": path})
        row.update(values)

    def complete(self, key: str, *, search: bool) -> bool:
        row = self.row(key)
        return "ms" in row and (not search or "max_B" in row)

    def save(self) -> None:
        ordered = sorted(self.rows.values(), key=_order)
        self.path.write_text(json.dumps({"meta": self.meta, "rows": ordered}, indent=1))

    def groups(self):
        """``{(shape, seq, recompute, kind): {path: row}}`` in plan order."""
        out: dict = {}
        for r in sorted(self.rows.values(), key=_order):
            out.setdefault((r["shape"], r["seq"], r["recompute"], r["kind"]), {})[r["path"]] = r
        return out

    def summary(self) -> str:
        lines = []
        for (shape, seq, rec, kind), rows in self.groups().items():
            floor = rows.get("floor", {})
            for name in PATH_ORDER:
                r = rows.get(name)
                if r and "ms" in r:
                    ratio = f"{r['ms'] / floor['ms']:.3f}x" if "ms" in floor else "  —  "
                    tokens = r.get("max_tokens", "—")
                    lines.append(f"{shape:>5} {seq:>5} {rec:<9} {kind:<7} {name:<18} {r['ms']:9.1f} ms {ratio:>7} "
                                 f"{r['peak_GiB']:6.2f} GiB  max tokens {tokens}")
        return "\n".join(lines)


def _order(r: dict):
    plan = [(s, q, c) for s, q, c in PLAN]
    where = (r["shape"], r["seq"], r["recompute"])
    return (plan.index(where) if where in plan else len(plan), r["shape"], r["seq"], r["recompute"],
            list(("train", "forward", "step")).index(r["kind"]), PATH_ORDER.index(r["path"]))


# ------------------------------------------------------------------------------------------------ metrics
def ratios(rows: dict) -> dict:
    """Per path: time / floor, max tokens / floor, max tokens / common (where measured)."""
    floor, common = rows.get("floor", {}), rows.get("common", {})
    out = {}
    for name, r in rows.items():
        x = {}
        if "ms" in r and "ms" in floor:
            x["time_vs_floor"] = r["ms"] / floor["ms"]
        if r.get("max_tokens") and floor.get("max_tokens"):
            x["tokens_vs_floor"] = r["max_tokens"] / floor["max_tokens"]
        if r.get("max_tokens") and common.get("max_tokens"):
            x["tokens_vs_common"] = r["max_tokens"] / common["max_tokens"]
        out[name] = x
    return out


def targets(results: Results) -> list[str]:
    """One line per target and configuration: met or not, by how much."""
    lines = []
    for (shape, seq, rec, kind), rows in results.groups().items():
        r = ratios(rows)
        where = f"{shape} @ {seq}, {rec}"
        checks = [("fused", "time_vs_floor", TARGET_FUSED_TIME, True), ("logits", "time_vs_floor", TARGET_LOGITS_TIME, True)]
        if kind in ("train", "forward"):
            checks.insert(1, ("fused", "tokens_vs_floor", TARGET_FUSED_TOKENS, False))
        if kind == "forward":
            checks.append(("logits", "tokens_vs_common", TARGET_FORWARD_TOKENS_VS_COMMON, False))
        for path, metric, limit, at_most in checks:
            value = r.get(path, {}).get(metric)
            if value is None:
                lines.append(f"- {where}, {kind}, {path} {metric}: not measured")
                continue
            met = value <= limit if at_most else value >= limit
            why = ""
            if not met and metric == "tokens_vs_common" and r.get("common", {}).get("tokens_vs_floor", 0) >= 1:
                why = (" — the common path already fits the floor's own largest micro-batch: the decoder (the local "
                       "spec's S × S attention scores), not the loss, bounds every path")
            lines.append(f"- {where}, {kind}, {path} {metric.replace('_', ' ')} = {value:.4f} "
                         f"(target {'≤' if at_most else '≥'} {limit}): {'met' if met else 'NOT MET'}{why}")
    return lines


# ------------------------------------------------------------------------------------------------ reports
def write_reports(results: Results, out: FilePath, *, plot: bool) -> None:
    results.save()
    (out / "step.md").write_text(markdown(results))
    if plot and results.rows:
        plot_results(results, out / "step.png")


def _fmt_tokens(r: dict) -> str:
    if "max_tokens" not in r:
        return "—"
    capped = r.get("first_failure_B") is None
    return f"{'≥ ' if capped else ''}{r['max_tokens']}"


def markdown(results: Results) -> str:
    meta = results.meta
    commands = "; ".join(f"`{run['command']}`" for run in meta.get("runs", []))
    lines = [
        f"# A GRPO step of a Qwen2.5-shaped model on one GPU — {meta.get('device', '?')}",
        "",
        "megatron-core GPTModel with the **local layer spec** (no Transformer Engine), bf16 (`Float16Module`), Megatron "
        "DDP with fp32 gradient buffers, TP = 1, in the Qwen2.5-1.5B (H 1536, 28 layers, 12 heads, 2 query groups, "
        "FFN 8960) and -0.5B (H 896, 24 layers, 14 heads, 2 query groups, FFN 4864) shapes: SwiGLU, RMSNorm, RoPE, QKV "
        "bias, V = 151936, tied embeddings. Padded rows of S tokens (the first S/8 a prompt, the rest trained on), "
        "random tokens. Every pass runs through megatron-core's `forward_backward_func`. Times: median of a few steps "
        "(CUDA events) of one micro-batch of 8192 tokens (4 × 2048 or 1 × 8192); peak: allocated memory during one "
        "step, weights and gradient buffers included; max tokens: the largest micro-batch (B × S) that runs, found by "
        "probing (out-of-memory caught; between probes and rows the caching allocator is emptied and so is "
        "megatron-core's global memory buffer, which holds the local attention's S × S scores at the largest size "
        "ever asked for; `PYTORCH_CUDA_ALLOC_CONF="
        f"{meta.get('runs', [{}])[-1].get('PYTORCH_CUDA_ALLOC_CONF')}`). The loss is the same objective on every "
        "path (PPO clip 0.2, dual clip 3, token mean, on-policy in the timed rows; no entropy, no KL). "
        f"torch {meta.get('torch')}, triton {meta.get('triton')}, megatron-core {meta.get('megatron_core')}.",
        "",
        "**Caveat.** The local layer spec's attention is unfused (it materializes the S × S scores, softmax in fp32) "
        "and slower than Transformer Engine's fused attention: the decoder here costs more time and more memory "
        "per token than under TE, so every loss path is a *smaller* share of the step than it would be there; the "
        "ratios to the floor understate the gaps a TE user sees. The `common` path calls the model as verl does, "
        "with `Float16Module`'s default fp32 output.",
        "",
        "Paths: " + "; ".join(f"`{k}` = {v}" for k, v in PATH_NAMES.items()) + ".",
        "",
        f"Commands: {commands}",
        "",
    ]
    for kind in ("train", "forward", "step"):
        groups = {k: v for k, v in results.groups().items() if k[3] == kind}
        if not groups:
            continue
        lines += [f"## {KIND_TITLES[kind]}", ""]
        if kind in KIND_NOTES:
            lines += [KIND_NOTES[kind], ""]
        if kind == "step":
            lines += ["| model | S | recompute | path | step ms | × floor | peak GiB |", "|---|---|---|---|---|---|---|"]
        else:
            lines += ["| model | S | recompute | path | ms | × floor | peak GiB | max B | max tokens | × floor | × common |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
        for (shape, seq, rec, _), rows in groups.items():
            r_all = ratios(rows)
            for name in PATH_ORDER:
                r = rows.get(name)
                if not r or "ms" not in r:
                    continue
                x = r_all.get(name, {})
                time_ratio = f"{x['time_vs_floor']:.3f}" if "time_vs_floor" in x else "—"
                ms = f"{r['ms']:.1f}" + (f" ({r['decoder_ms']:.1f} + {r['matmul_ms']:.1f})" if "matmul_ms" in r else "")
                if kind == "step":
                    lines.append(f"| {shape} | {seq} | {rec} | {name} | {ms} | {time_ratio} | {r['peak_GiB']:.2f} |")
                    continue
                tok_f = f"{x['tokens_vs_floor']:.2f}" if "tokens_vs_floor" in x else "—"
                tok_c = f"{x['tokens_vs_common']:.2f}" if "tokens_vs_common" in x else "—"
                lines.append(f"| {shape} | {seq} | {rec} | {name} | {ms} | {time_ratio} | {r['peak_GiB']:.2f} | "
                             f"{r.get('max_B', '—')} | {_fmt_tokens(r)} | {tok_f} | {tok_c} |")
        lines.append("")
    lines += ["## Targets", "", *targets(results), ""]
    lines += _predictions("Predictions (written before the first run) and measurements", PREDICTIONS, results)
    lines += _predictions("Predictions for the last change (the output weight's gradient into `main_grad`; the "
                          "forward-only rows' MegatronGRPO built once), written before the run that measured it",
                          CHANGE_PREDICTIONS, results)
    return "\n".join(lines)


def _predictions(title: str, predictions: dict, results: Results) -> list[str]:
    lines = [f"## {title}", "", "| model | S | row | path | metric | predicted | measured (selective / full) |",
             "|---|---|---|---|---|---|---|"]
    groups = results.groups()
    for (shape, seq, kind, path, metric), predicted in predictions.items():
        measured = []
        for rec in ("selective", "full"):
            value = ratios(groups.get((shape, seq, rec, kind), {})).get(path, {}).get(metric)
            measured.append("—" if value is None else f"{value:.3f}")
        lines.append(f"| {shape} | {seq} | {kind} | {path} | {metric.replace('_', ' ')} | {predicted} | {' / '.join(measured)} |")
    return lines + [""]


def plot_results(results: Results, path: FilePath) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("train", "time_vs_floor", "training pass: time / floor"),
              ("train", "max_tokens", "training pass: max tokens per micro-batch"),
              ("forward", "max_tokens", "forward-only pass: max tokens per micro-batch")]
    groups = results.groups()
    n = max(len([k for k in groups if k[3] == kind]) for kind in ("train", "forward"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 1.6 * n + 3), 11))
    colors = {"floor": "tab:gray", "common": "tab:red", "logits_model_layer": "tab:purple", "logits": "tab:blue",
              "fused": "tab:green"}
    width = 0.16
    for ax, (kind, metric, title) in zip(axes, panels):
        labels = []
        configs = [k for k in groups if k[3] == kind]
        for i, (shape, seq, rec, _) in enumerate(configs):
            rows = groups[(shape, seq, rec, kind)]
            labels.append(f"{shape} S={seq}" + (f"\n{rec} recompute" if kind == "train" else ""))
            x_ratios = ratios(rows)
            for j, name in enumerate(PATH_ORDER):
                r = rows.get(name, {})
                value = x_ratios.get(name, {}).get(metric) if metric == "time_vs_floor" else r.get(metric)
                if value is None:
                    continue
                ax.bar(i + (j - 2) * width, value, width, color=colors[name], label=name if i == 0 else None)
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        if metric == "time_vs_floor":
            ax.axhline(TARGET_FUSED_TIME, color="tab:green", linestyle="--", linewidth=0.8)
            ax.axhline(TARGET_LOGITS_TIME, color="tab:blue", linestyle="--", linewidth=0.8)
            ax.set_ylim(0.95, None)
        ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    fig.suptitle(f"GRPO step, Qwen2.5 shapes, local layer spec, bf16 — {results.meta.get('device', '')}", fontsize=10)
    fig.tight_layout(h_pad=2.5)
    fig.savefig(path, dpi=110)
    plt.close(fig)
