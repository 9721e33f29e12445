"""mp_grpo's verl plugin: the entry point ``mp_grpo`` of the group ``verl.plugins`` (pyproject.toml).

``import verl`` imports this module in every process that imports verl (unless ``VERL_USE_EXTERNAL_PLUGINS``
excludes it): it registers every shipped preset as the policy loss ``mp_grpo:<preset>``
(:func:`~mp_grpo.integrations.verl.registration.register_presets`) and applies the LM-head switch
(:data:`~mp_grpo.integrations.verl.lm_head.ENV_SWITCH`). verl logs a failing plugin only at debug level, so a
failure is logged here as a warning before it propagates.
"""

from __future__ import annotations

import logging

from mp_grpo.integrations.verl.lm_head import switch_from_env
from mp_grpo.integrations.verl.registration import register_presets

try:
    REGISTERED = register_presets()
    LOGPROBS_SWITCHED_ON = switch_from_env()
except Exception as error:
    logging.getLogger(__name__).warning("mp_grpo's verl plugin failed: %s: %s", type(error).__name__, error)
    raise
