"""The learning job's output: the per-step table, the closing summary and the PNG of its curves."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

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


MAX_WINDOW = 5
"""Steps in each of the first and last windows compared by :func:`reward_change` (fewer in short runs)."""
T_975 = {2: 4.303, 4: 2.776, 6: 2.447, 8: 2.306}
"""Student's t 97.5 % quantile by degrees of freedom 2·(k − 1), k = 2 … MAX_WINDOW steps a window: the half-width
of a 95 % confidence interval of a difference of two means with k samples each, in standard errors."""


@dataclass(frozen=True)
class RewardChange:
    """Mean reward over the first and the last steps, their difference and its noise (see :func:`reward_change`)."""

    first_steps: tuple[int, int]
    last_steps: tuple[int, int]
    first: float
    last: float
    noise: float | None
    """Half-width of the 95 % confidence interval of ``last - first``; None when a window has fewer than 2 steps."""

    @property
    def delta(self) -> float:
        return self.last - self.first

    @property
    def verdict(self) -> str:
        """``rose`` / ``fell`` beyond the noise, ``within noise``, or ``too short`` to tell."""
        if self.noise is None:
            return "too short"
        if abs(self.delta) <= self.noise:
            return "within noise"
        return "rose" if self.delta > 0 else "fell"


def reward_change(records: list[dict]) -> RewardChange:
    """The first and last ``k = min(5, n // 4)`` steps' mean rewards (at least 2 steps each when n ≥ 4) and the
    noise of their difference.

    The noise is measured, not assumed: each window's per-step rewards have a sample variance s²; the standard
    error of the difference of the two means is sqrt((s_first² + s_last²) / k), and the noise is the half-width of
    its 95 % confidence interval, Student's t with 2·(k − 1) degrees of freedom times that standard error. A trend
    inside a window widens its spread, so on a rising curve the noise is, if anything, overestimated.
    """
    n = len(records)
    rewards = [float(r["reward"]) for r in records]
    k = min(MAX_WINDOW, max(2, n // 4)) if n >= 4 else max(1, n // 2)
    first, last = rewards[:k], rewards[n - k:]
    noise = None
    if k >= 2:
        se = math.sqrt((statistics.variance(first) + statistics.variance(last)) / k)
        noise = T_975[2 * (k - 1)] * se
    steps = [r["step"] for r in records]
    return RewardChange(first_steps=(steps[0], steps[k - 1]), last_steps=(steps[n - k], steps[-1]),
                        first=statistics.fmean(first), last=statistics.fmean(last), noise=noise)


def _span(steps: tuple[int, int]) -> str:
    return f"step {steps[0]}" if steps[0] == steps[1] else f"steps {steps[0]}–{steps[1]}"


def summary(records: list[dict], cfg) -> str:
    """One line: the measured change of the mean reward, its noise, and what it means ("learned" only when the
    reward rose beyond its noise)."""
    change = reward_change(records)
    modulus = cfg.task.modulus or cfg.model.vocab_size
    delta = f"{change.delta:+.3f}"
    if change.noise is None:
        noise = f"{delta}; too few steps to measure the noise: run 4 or more"
    else:
        beyond = "beyond" if change.verdict in ("rose", "fell") else "within"
        noise = f"{delta}, {beyond} its noise ±{change.noise:.3f}: the 95 % interval from the per-step spread"
    meaning = {"rose": f"learned successor counting mod {modulus}",
               "fell": "the reward fell",
               "within noise": "no learning shown",
               "too short": "no verdict"}[change.verdict]
    return (f"{meaning}: mean reward {change.first:.3f} over {_span(change.first_steps)} → {change.last:.3f} over "
            f"{_span(change.last_steps)} ({noise}); chance {1 / cfg.model.vocab_size:.3f}, 1.0 = every token right; "
            f"{sum(r['seconds'] for r in records):.0f} s")


def describe_run(cfg, info: dict) -> str:
    """A title in words: the task, the machine and the layout of the run."""
    layout = info.get("layout", {})
    where = "CPU stand-in model" if str(info.get("description", "")).startswith("CPU") else "megatron-core GPTModel"
    modulus = cfg.task.modulus or cfg.model.vocab_size
    processes = f"{layout['world']} process" + ("es" if layout.get("world") != 1 else "") if layout else ""
    shape = (f"TP={layout['tp']}, DP={layout['dp']}, CP={layout['cp']} on {processes}, "
             f"{layout['global_batch']} completions a step" if layout else "")
    return (f"on-policy GRPO learning successor counting mod {modulus} ({where}; {shape}; "
            f"{cfg.rollout.group_size} completions per prompt, seed {cfg.train.seed})")


def plot_records(records: list[dict], path, *, title: str = "", chance: float | None = None,
                 clip_grad: float | None = None) -> None:
    """Write :func:`curves_figure` to the PNG ``path``."""
    import matplotlib.pyplot as plt

    fig = curves_figure(records, title=title, chance=chance, clip_grad=clip_grad)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def curves_figure(records: list[dict], *, title: str = "", chance: float | None = None, clip_grad: float | None = None):
    """A matplotlib figure of five panels: reward (with the chance level), loss, grad norm (with the clipping
    threshold), vllm-kl (k3 of old vs rollout log-probs) and the IS weight / policy ratio. A series with no finite
    value (a metric the run's loss does not produce) is left out, legend entry included."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in records]

    def metric(*names):
        return [next((r["metrics"][n] for n in names if n in r["metrics"]), math.nan) for r in records]

    panels = [  # (title, y label, {legend label: values}, reference lines [(y, label)])
        ("reward", "mean reward (fraction of tokens right)",
         {"mean reward": [r["reward"] for r in records],
          "completions with every token right (fraction)": [r["solved"] for r in records]},
         [(chance, f"chance: a uniform policy, {chance:.3f}")] if chance is not None else []),
        ("loss", "GRPO loss", {"loss": metric("loss")}, []),
        ("gradient norm", "gradient norm (before clipping)", {"grad norm": [r["grad_norm"] for r in records]},
         [(clip_grad, f"clipping threshold {clip_grad:g}")] if clip_grad is not None else []),
        ("trainer vs rollout engine", "vllm-kl: KL(old ‖ rollout), k3, nats/token", {"vllm-kl": metric("mismatch/k3")}, []),
        ("importance sampling", "mean over tokens",
         {"IS weight (applied)": metric("is_weight/applied/mean", "is_weight/truncated/mean"),
          "ratio π / π_old": metric("ratio/mean"), "rejected fraction": metric("rejected_frac/rollout")}, []),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (name, ylabel, series, lines) in zip(axes, panels):
        drawn = {label: ys for label, ys in series.items() if any(math.isfinite(y) for y in ys)}
        for label, ys in drawn.items():
            ax.plot(steps, ys, label=label, marker=".")
        for y, label in lines:
            ax.axhline(y, color="gray", linestyle=":", linewidth=1.2, label=label)
        if not drawn:
            ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel, fontsize=8)
        ax.ticklabel_format(axis="y", useOffset=False)
        if len(drawn) + len(lines) > 1:
            ax.legend(fontsize=7)
    axes[0].set_ylim(-0.02, 1.0)  # the reward lies in [0, 1]
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
