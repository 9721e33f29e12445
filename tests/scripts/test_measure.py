"""scripts/measure.py's interleaved rounds and their statistics on CPU, with a fake timer.

- ``median_interval``: the order statistics of the median for known n (20 rounds: x₍₆₎ … x₍₁₅₎, 95.9 %), the range with
  its smaller coverage when n is too small, and its coverage of a skewed distribution's true median measured over
  many samples (an off-by-one rank fails it: 88.5 % or 98.8 %).
- ``interleaved_ms``: the call order (warm-up, then floor, A, B and B, A, floor in alternate rounds),
  ``before_each`` outside the timed window, bad arguments.
- ``ratio_to`` on a machine whose speed drifts steadily: the per-round ratio recovers the true ratio where the ratio
  of separately timed medians does not, and the alternating order is what keeps the drift inside a round out of it
  (a fixed order fails).
"""

from __future__ import annotations

import math
import random
import sys

import pytest

from tests.distributed import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))

import measure  # noqa: E402


def test_median_interval_order_statistics() -> None:
    values = list(range(20, 0, -1))  # 20 … 1, unsorted on purpose
    iv = measure.median_interval(values)
    assert iv.median == 10.5 and (iv.low, iv.high) == (6.0, 15.0) and iv.n == 20
    assert iv.coverage == pytest.approx(1 - 2 * sum(math.comb(20, i) for i in range(6)) / 2**20)  # 0.9586
    six = measure.median_interval([3.0, 1.0, 2.0, 6.0, 5.0, 4.0])
    assert (six.low, six.high, six.median) == (1.0, 6.0, 3.5) and six.coverage == pytest.approx(1 - 2 / 64)
    five = measure.median_interval([1.0, 2.0, 3.0, 4.0, 5.0])  # too few for 95 %: the range, and what it covers
    assert (five.low, five.high, five.median) == (1.0, 5.0, 3.0) and five.coverage == pytest.approx(1 - 2 / 32)
    assert five.coverage < measure.CONFIDENCE <= iv.coverage
    with pytest.raises(ValueError, match="no values"):
        measure.median_interval([])
    with pytest.raises(ValueError, match="finite"):
        measure.median_interval([1.0, float("nan")])
    with pytest.raises(ValueError, match="confidence"):
        measure.median_interval([1.0], confidence=1.0)


def test_median_interval_covers_a_skewed_median_95_percent_of_the_time() -> None:
    rng = random.Random(42)
    true_median = 1.0  # lognormal(0, 0.5): median e⁰
    trials, covered = 2000, 0
    for _ in range(trials):
        iv = measure.median_interval([rng.lognormvariate(0.0, 0.5) for _ in range(20)])
        covered += iv.low <= true_median <= iv.high
    # exact coverage 0.9586; 3 standard deviations of 2000 trials ≈ ±0.013
    assert 0.945 <= covered / trials <= 0.972, covered / trials


def test_interleaved_rounds_call_order() -> None:
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("floor", "a", "b")}

    def timer(fn) -> float:
        calls.append("start")
        fn()
        return 1.0

    times = measure.interleaved_ms(fns, 3, warmup=2, timer=timer, before_each=lambda: calls.append("barrier"))
    assert calls[:6] == ["floor", "a", "b", "floor", "a", "b"]  # warm-up: every function, in order, untimed
    forward = ["barrier", "start", "floor", "barrier", "start", "a", "barrier", "start", "b"]
    backward = ["barrier", "start", "b", "barrier", "start", "a", "barrier", "start", "floor"]
    assert calls[6:] == forward + backward + forward
    assert times == {"floor": [1.0] * 3, "a": [1.0] * 3, "b": [1.0] * 3}
    with pytest.raises(ValueError, match="rounds"):
        measure.interleaved_ms(fns, 0)
    with pytest.raises(ValueError, match="at least one"):
        measure.interleaved_ms({}, 3)


class DriftingMachine:
    """A fake timer: a call's time is its true cost times the machine's speed factor at that moment, which drifts
    by up to ±10 % over a hundred calls (another job on the machine), plus ±0.2 % noise per call."""

    def __init__(self, costs: dict, seed: int = 7) -> None:
        self.costs, self.calls, self.rng = costs, 0, random.Random(seed)

    def __call__(self, fn) -> float:
        name = fn()
        self.calls += 1
        drift = 1.0 + 0.10 * math.sin(self.calls / 40.0)
        return self.costs[name] * drift * (1.0 + self.rng.uniform(-0.002, 0.002))


def test_per_round_ratio_survives_a_drifting_machine() -> None:
    costs = {"floor": 100.0, "fused": 101.0}  # the truth: 1.010
    fns = {name: (lambda name=name: name) for name in costs}
    machine = DriftingMachine(costs)
    times = measure.interleaved_ms(fns, 20, warmup=0, timer=machine)
    ratio = measure.ratio_to(times["fused"], times["floor"])
    assert ratio.low <= 1.010 <= ratio.high and abs(ratio.median - 1.010) < 0.003, ratio
    assert ratio.high - ratio.low < 0.01 and ratio.n == 20
    # the same machine timed path after path (20 calls of one, then 20 of the other): the drift lands in the ratio
    sequential = DriftingMachine(costs)
    floor = [sequential(fns["floor"]) for _ in range(20)]
    fused = [sequential(fns["fused"]) for _ in range(20)]
    assert abs(measure.median(fused) / measure.median(floor) - 1.010) > 0.03
    # a fixed order (floor, fused in every round): the drift between the two calls of a round biases every ratio
    fixed = DriftingMachine(costs)
    pairs = [(fixed(fns["floor"]), fixed(fns["fused"])) for _ in range(20)]
    biased = measure.ratio_to([b for _, b in pairs], [a for a, _ in pairs])
    assert not biased.low <= 1.010 <= biased.high, biased


def test_ratio_to_rejects_other_rounds() -> None:
    with pytest.raises(ValueError, match="not the same rounds"):
        measure.ratio_to([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="> 0"):
        measure.ratio_to([1.0], [0.0])
    assert measure.ratio_to([2.0, 3.0, 4.0], [1.0, 1.0, 2.0]).median == 2.0
