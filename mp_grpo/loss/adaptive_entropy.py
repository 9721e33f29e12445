"""Adaptive entropy-bonus coefficient (Skywork-OR1, arXiv 2505.22312; TRL ``use_adaptive_entropy``).

The coefficient changes from step to step, so it is state outside the (pure) loss: one
:class:`AdaptiveEntropyCoefficient` per training run, on every rank, read once per step and updated once
per step from the step's global mean entropy.

Schedule (TRL ``GRPOTrainer._compute_loss``, f2cd577)
    1. Before the step: ``applied`` = coefficient if the previous step's mean entropy ≤ ``entropy.target``,
       else 0 (the first step: no previous entropy → 0). Pass it to every call of the step as
       ``GRPOLoss(...)(..., entropy_coef=controller.applied)``.
    2. After the step: :meth:`update` with the step's global mean entropy over the tokens the policy term
       uses (the ``entropy/selected`` metric with ``top_quantile`` < 1, else ``entropy``, after
       :func:`~mp_grpo.reduce_metrics`): coefficient += ``coef_delta`` (at most ``coef_max``) when it is ≤ the
       target, −= ``coef_delta`` (at least ``coef_min``) otherwise.
Save and restore it with the checkpoint (:meth:`state_dict` / :meth:`load_state_dict`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from mp_grpo.config.loss import EntropyConfig


class AdaptiveEntropyCoefficient:
    """The adaptive entropy coefficient of ``entropy.adaptive`` (see the module docstring)."""

    def __init__(self, config: EntropyConfig) -> None:
        if not isinstance(config, EntropyConfig):
            raise TypeError(f"config must be an EntropyConfig (LossConfig.entropy), got {type(config).__name__}")
        if not config.adaptive:
            raise ValueError("config: entropy.adaptive is false; a fixed bonus needs no controller")
        self.config = config
        self.coefficient = float(config.bonus_coef)
        """The current coefficient (TRL ``entropy_coef``), starting at ``bonus_coef``."""
        self.last_entropy = math.inf
        """The last step's global mean entropy (TRL ``_last_world_entropy``); inf before the first update."""

    @property
    def applied(self) -> float:
        """Step 1: the coefficient this step's loss applies."""
        return self.coefficient if self.last_entropy <= self.config.target else 0.0

    def update(self, mean_entropy: float) -> None:
        """Step 2: after the optimizer step, with the step's global mean entropy (a float, same on every rank)."""
        mean_entropy = float(mean_entropy)
        if not math.isfinite(mean_entropy):
            raise ValueError(f"mean_entropy must be finite, got {mean_entropy}")
        c = self.config
        if mean_entropy <= c.target:
            self.coefficient = min(self.coefficient + c.coef_delta, c.coef_max)
        else:
            self.coefficient = max(self.coefficient - c.coef_delta, c.coef_min)
        self.last_entropy = mean_entropy

    def update_from_metrics(self, reduced: Mapping[str, float]) -> None:
        """:meth:`update` from the output of :func:`~mp_grpo.reduce_metrics` over the step's calls."""
        name = "entropy/selected" if self.config.top_quantile < 1.0 else "entropy"
        if name not in reduced:
            raise KeyError(f"reduced: no '{name}' metric (the calls must get entropy=)")
        self.update(reduced[name])

    def state_dict(self) -> dict[str, float]:
        return {"coefficient": self.coefficient, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.coefficient = float(state["coefficient"])
        self.last_entropy = float(state["last_entropy"])
