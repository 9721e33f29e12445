"""The learning job's report: the end-of-run verdict on the reward and the picture of the curves."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from mp_grpo.config.job import load_job_config
from mp_grpo.train.report import T_975, curves_figure, plot_records, reward_change, summary

CPU = Path(__file__).resolve().parents[2] / "mp_grpo" / "train" / "configs" / "grpo_cpu.yaml"


def _records(rewards: list[float], **metrics: float) -> list[dict]:
    return [dict(step=i, reward=r, solved=0.0, grad_norm=0.5, skipped=False, seconds=1.0,
                 metrics={"loss": 0.01, "mismatch/k3": 1e-5, "ratio/mean": 1.0, "is_weight/applied/mean": 1.0, **metrics})
            for i, r in enumerate(rewards)]


def _noisy(mean: list[float], std: float, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [m + rng.gauss(0.0, std) for m in mean]


def test_rise_beyond_the_noise_is_learned() -> None:
    rewards = _noisy([0.03 + 0.025 * i for i in range(20)], 0.01)
    change = reward_change(_records(rewards))
    assert change.first_steps == (0, 4) and change.last_steps == (15, 19)
    assert change.first == pytest.approx(sum(rewards[:5]) / 5) and change.last == pytest.approx(sum(rewards[15:]) / 5)
    assert change.verdict == "rose" and change.delta > change.noise
    line = summary(_records(rewards), load_job_config(CPU))
    assert line.startswith("learned successor counting mod 32: mean reward ")
    assert "over steps 0–4 → " in line and "over steps 15–19 (+" in line and "beyond its noise ±" in line


def test_flat_reward_is_not_called_learned() -> None:
    """As the run of a group of one before it was refused: 0.032 → 0.040, in a per-step spread of ~0.007."""
    rewards = [0.03, 0.04, 0.025, 0.035, 0.03, *_noisy([0.036] * 10, 0.007), 0.045, 0.03, 0.04, 0.035, 0.05]
    change = reward_change(_records(rewards))
    assert (round(change.first, 3), round(change.last, 3)) == (0.032, 0.04)
    assert change.noise == pytest.approx(T_975[8] * math.sqrt((32.5e-6 + 62.5e-6) / 5))  # ±0.010 > +0.008
    assert change.verdict == "within noise"
    line = summary(_records(rewards), load_job_config(CPU))
    assert line.startswith("no learning shown: mean reward ") and "learned" not in line and "within its noise ±" in line


def test_the_noise_is_the_95_percent_interval_of_the_difference() -> None:
    rewards = [0.1, 0.2, 0.1, 0.2, 0.5, 0.5, 0.4, 0.6]  # k = 2: windows [0.1, 0.2] and [0.4, 0.6]
    change = reward_change(_records(rewards))
    se = math.sqrt((0.005 + 0.02) / 2)  # sample variances 0.005 and 0.02
    assert change.noise == pytest.approx(T_975[2] * se)
    assert change.verdict == "within noise"  # +0.35 against ±0.48: two steps a window say little


def test_a_fall_and_a_short_run() -> None:
    falling = reward_change(_records(_noisy([0.5 - 0.02 * i for i in range(20)], 0.005)))
    assert falling.verdict == "fell"
    short = reward_change(_records([0.05, 0.09]))
    assert short.noise is None and short.verdict == "too short"
    assert "too few steps to measure the noise" in summary(_records([0.05, 0.09]), load_job_config(CPU))


def test_picture_labels_every_axis_and_draws_every_legend_entry(tmp_path: Path) -> None:
    records = _records([0.05, 0.1, 0.2, 0.3], **{"rejected_frac/rollout": math.nan})
    fig = curves_figure(records, title="on-policy GRPO", chance=1 / 32, clip_grad=1.0)
    assert fig._suptitle.get_text() == "on-policy GRPO"
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
        legend = ax.get_legend()
        drawn = {line.get_label() for line in ax.get_lines()}
        if legend is not None:
            assert {t.get_text() for t in legend.get_texts()} == drawn  # no entry without its line
    reward = fig.axes[0]
    assert "chance: a uniform policy, 0.031" in {line.get_label() for line in reward.get_lines()}
    assert [line.get_ydata()[0] for line in reward.get_lines() if line.get_label().startswith("chance")] == [1 / 32]
    labels = {line.get_label() for line in fig.axes[4].get_lines()}
    assert labels == {"IS weight (applied)", "ratio π / π_old"}  # the never-measured rejected fraction is left out
    plot_records(records, tmp_path / "curves.png", title="t", chance=1 / 32, clip_grad=1.0)
    assert (tmp_path / "curves.png").stat().st_size > 10_000
