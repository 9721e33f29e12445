"""The learning job's output: the per-step table, the closing summary and the PNG of its curves."""

from __future__ import annotations

import math

COLUMNS = [  # (header, metric name(s): the first present is shown, format)
    ("step", None, "{:>4d}"),
    ("reward", None, "{:>6.3f}"),
    ("solved", None, "{:>6.3f}"),
    ("loss", "loss", "{:>9.4f}"),
    ("ratio", "ratio/mean", "{:>7.4f}"),
    ("IS w", ("is_weight/applied/mean", "is_weight/truncated/mean"), "{:>6.3f}"),
    ("rejected", "rejected_frac/rollout", "{:>8.3f}"),
    ("vllm-kl", "mismatch/k3", "{:>9.2e}"),
    ("entropy", "entropy", "{:>7.3f}"),
    ("tokens", "valid_tokens", "{:>6.0f}"),
    ("grad norm", None, "{:>9.3e}"),
    ("skip", None, "{:>4s}"),
    ("s", None, "{:>5.1f}"),
]


def _width(fmt: str) -> int:
    return len(fmt.format(0 if "d" in fmt else 0.0 if ("f" in fmt or "e" in fmt) else ""))


def format_header() -> str:
    return " ".join(f"{h:>{max(_width(fmt), len(h))}}" for h, _, fmt in COLUMNS)


def format_row(record: dict) -> str:
    m = record["metrics"]
    special = {"step": record["step"], "reward": record["reward"], "solved": record["solved"],
               "grad norm": record["grad_norm"], "skip": "yes" if record["skipped"] else "no", "s": record["seconds"]}
    cells = []
    for h, name, fmt in COLUMNS:
        names = (name,) if isinstance(name, str) else name
        value = special[h] if name is None else next((m[n] for n in names if n in m), None)
        width = max(_width(fmt), len(h))
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            cells.append("-".rjust(width))
        else:
            cells.append(fmt.format(value).rjust(width))
    return " ".join(cells)


def summary(records: list[dict], cfg) -> str:
    """What was learned: mean reward of the first and last few steps, and the chance level."""
    k = max(1, min(5, len(records) // 4))
    first = sum(r["reward"] for r in records[:k]) / k
    last = sum(r["reward"] for r in records[-k:]) / k
    modulus = cfg.task.modulus or cfg.model.vocab_size
    return (f"learned successor counting mod {modulus}: mean reward {first:.3f} over the first {k} steps -> {last:.3f} "
            f"over the last {k} (a uniform policy scores {1 / cfg.model.vocab_size:.3f}; 1.0 = every token right); "
            f"{sum(r['seconds'] for r in records):.0f} s")


def plot_records(records: list[dict], path: str, *, title: str = "") -> None:
    """PNG with five panels: reward, loss, grad norm, vllm-kl (k3 of old vs rollout) and IS weight / ratio."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]

    def metric(*names):
        return [next((r["metrics"][n] for n in names if n in r["metrics"]), math.nan) for r in records]

    panels = [
        ("mean reward", {"reward": [r["reward"] for r in records], "solved": [r["solved"] for r in records]}),
        ("loss", {"loss": metric("loss")}),
        ("grad norm", {"grad norm": [r["grad_norm"] for r in records]}),
        ("vllm-kl (k3, old vs rollout)", {"k3": metric("mismatch/k3")}),
        ("IS statistics", {"IS weight mean": metric("is_weight/applied/mean", "is_weight/truncated/mean"),
                           "ratio mean": metric("ratio/mean"), "rejected frac": metric("rejected_frac/rollout")}),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (name, series) in zip(axes, panels):
        for label, ys in series.items():
            ax.plot(steps, ys, label=label, marker=".")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        if len(series) > 1:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
