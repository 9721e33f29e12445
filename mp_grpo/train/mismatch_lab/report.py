"""Writing the lab's results: one JSON, one markdown table and (where useful) one PNG per experiment.

The markdown tables are the ones ``docs/mismatch.md`` shows; every number in them is formatted here from
the experiment's result dict.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path


def _json_default(value: object) -> object:
    if isinstance(value, Enum):
        return value.value
    raise TypeError(f"not JSON-serializable: {value!r}")


def write_json(result: dict, path: Path) -> None:
    """``result`` as indented JSON (enums by value; NaN / inf as JSON's NaN / Infinity)."""
    path.write_text(json.dumps(result, indent=1, default=_json_default) + "\n")


def _g(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}g}"


def is_correction_table(result: dict) -> str:
    """Experiment (a): one row per mismatch level."""
    head = ("| logit noise σ | vllm-kl (k3) | seq IS ratio: mean raw | median raw | **mean applied** | rejected seqs "
            "| loss with IS | loss without | grad norm with IS | grad norm without | **ratio without/with** |")
    lines = [head, "|" + "---|" * 11]
    for r in result["rows"]:
        lines.append(
            f"| {r['noise_std']:g} | {_g(r['vllm_kl_k3'])} | {_g(r['is_raw_mean'])} | {_g(r['is_raw_median'])} "
            f"| **{_g(r['is_applied_mean'])}** | {r['rejected_sequences']:.1%} | {r['loss_with']:.4g} "
            f"| {r['loss_without']:.4g} | {_g(r['grad_norm_with'])} | {_g(r['grad_norm_without'])} "
            f"| **{r['grad_norm_ratio']:.3g}×** |")
    return "\n".join(lines)


def normalizer_table(result: dict) -> str:
    """Experiment (b): one row per (order, micro-batches), both normalizers side by side."""
    rows: dict[tuple[str, int], dict] = {}
    for r in result["rows"]:
        entry = rows.setdefault((r["order"], r["micro_batches"]), {"tokens": r["tokens_per_micro_batch"]})
        entry["global" if r["normalizer"].startswith("global") else "bug"] = r
    lines = ["| order | micro-batches | valid tokens per micro-batch | rel. grad change, global (mp_grpo) "
             "| rel. grad change, per-micro-batch (bug) | loss global | loss per-micro-batch |", "|" + "---|" * 7]
    for (order, k), e in rows.items():
        lines.append(f"| {order} | {k} | {', '.join(map(str, e['tokens']))} | {e['global']['relative_grad_change']:.2g} "
                     f"| {e['bug']['relative_grad_change']:.2%} | {e['global']['loss']:.6g} | {e['bug']['loss']:.6g} |")
    return "\n".join(lines)


def nan_guard_table(result: dict) -> str:
    """Experiment (c): one row per case, both implementations."""
    lines = ["| case | unguarded loss | unguarded non-finite grads | mp_grpo loss | mp_grpo non-finite grads "
             "| mp_grpo max \\|grad\\| at masked positions |", "|" + "---|" * 6]
    for r in result["rows"]:
        u, m = r["unguarded"], r["mp_grpo"]
        lines.append(f"| {r['case']} | {u['loss']:.6g} | {u['grad_nonfinite']} / {u['grad_elements']} | {m['loss']:.6g} "
                     f"| {m['grad_nonfinite']} / {m['grad_elements']} | {m['masked_grad_max']:g} |")
    return "\n".join(lines)


def plot_is_correction(result: dict, path: Path) -> None:
    """Grad norm with and without the correction, and their ratio, against the applied IS mean."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(result["rows"], key=lambda r: r["is_applied_mean"])
    x = [r["is_applied_mean"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.loglog(x, [r["grad_norm_with"] for r in rows], "o-", label="IS correction applied (mp_grpo)")
    ax1.loglog(x, [r["grad_norm_without"] for r in rows], "s-", label="IS correction omitted (Liger #1082)")
    ax1.set_xlabel("mean applied sequence IS weight")
    ax1.set_ylabel("grad norm")
    ax1.legend()
    ax2.loglog(x, [r["grad_norm_ratio"] for r in rows], "o-", label="measured ratio without / with")
    ax2.loglog(x, [1 / v for v in x], "--", color="gray", label="1 / mean IS weight")
    ax2.set_xlabel("mean applied sequence IS weight")
    ax2.set_ylabel("grad-norm ratio")
    ax2.legend()
    fig.suptitle("(a) same batch, rollout IS correction applied vs omitted")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_normalizer(result: dict, path: Path) -> None:
    """Relative gradient change against the number of micro-batches, per order and normalizer."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in result["rows"]:
        if r["micro_batches"] > 1:
            series.setdefault((r["order"], r["normalizer"]), []).append((r["micro_batches"], r["relative_grad_change"]))
    for (order, name), pts in series.items():
        ks, vals = zip(*pts)
        # a change of exactly 0 cannot be drawn on a log axis: drawn at the bottom, as 1e-9
        ax.semilogy(ks, [max(v, 1e-9) for v in vals], "o-", label=f"{name}, {order}")
    ax.set_xlabel("micro-batches in the step")
    ax.set_ylabel("relative L2 change of the gradient vs 1 micro-batch")
    ax.set_xticks(sorted({r["micro_batches"] for r in result["rows"]}))
    ax.legend(fontsize=8)
    ax.set_title("(b) per-micro-batch vs global normalizer (0 drawn at 1e-9)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
