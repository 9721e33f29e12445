"""verl's policy-loss registry: every shipped preset as ``mp_grpo:<preset>``, and your own configs by name.

verl looks a policy loss up by ``actor_rollout_ref.actor.policy_loss.loss_mode`` in an exact-name registry
(``core_algos.POLICY_LOSS_REGISTRY``), and its ``ActorConfig`` rejects unknown keys: the preset travels in
the name. Overrides travel the same way — as a name of your own: ``register("mp_grpo:my_dapo",
load_config("trl_dapo", ["policy.eps_high=0.3"]))`` in a module verl imports in every process
(``VERL_USE_EXTERNAL_MODULES=my_module``, or an entry point of your package in the group ``verl.plugins``).
A syntax inside the name (``mp_grpo:trl_dapo,policy.eps_high=0.3``) is not offered: a name must be in the
registry before verl looks it up, and Hydra reads ``,`` and ``=`` in an override's value as its own syntax.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from mp_grpo.config import load_config, preset_names
from mp_grpo.config.loss import LossConfig
from mp_grpo.integrations.verl.policy_loss import VerlPolicyLoss

PREFIX = "mp_grpo:"
"""The loss-mode prefix of the shipped presets: ``loss_mode=mp_grpo:<preset>``."""

logger = logging.getLogger(__name__)


class RefusedPolicyLoss:
    """A shipped preset verl cannot run, registered under its name so that choosing it says why (at the first
    policy-loss call) instead of verl's "Unsupported loss mode"."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason

    def __call__(self, *args, **kwargs):
        raise ValueError(self.reason)


def register(name: str, config: LossConfig) -> VerlPolicyLoss:
    """Register ``config`` as the verl policy loss ``name`` (``actor.policy_loss.loss_mode=<name>``).

    Raises ``ValueError`` if ``config`` holds what verl cannot feed a policy loss
    (:func:`~mp_grpo.integrations.verl.policy_loss.verl_refusals`) or if ``name`` is one of verl's own loss modes.
    Call it in every process that trains (a module verl imports: see the module docstring).
    """
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss

    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    existing = POLICY_LOSS_REGISTRY.get(name)
    if existing is not None and not isinstance(existing, (VerlPolicyLoss, RefusedPolicyLoss)):
        raise ValueError(f"name {name!r} is one of verl's own loss modes; register mp_grpo configs under another "
                         f"name (the convention: {PREFIX}<name>)")
    loss = VerlPolicyLoss(name, config)
    register_policy_loss(name)(loss)
    return loss


def register_presets(load: Callable[[str], LossConfig] = load_config) -> list[str]:
    """Register every shipped preset as ``mp_grpo:<preset>``; return the names. A preset verl cannot run is
    registered as a :class:`RefusedPolicyLoss` that raises the reason when verl calls it."""
    from verl.trainer.ppo.core_algos import register_policy_loss

    names = []
    for preset in preset_names():
        name = PREFIX + preset
        try:
            register(name, load(preset))
        except ValueError as refusal:
            register_policy_loss(name)(RefusedPolicyLoss(name, str(refusal)))
        names.append(name)
    return names
