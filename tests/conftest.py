"""Test-session setup: run Triton kernels under the interpreter when no GPU is present.

``mp_grpo.kernels`` makes the same choice on import; setting it here too keeps workers that
torchrun starts from a test file on the same path.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# --- hypothesis profiles of the property tests (tests/loss/test_properties*.py), chosen by
# MP_GRPO_HYPOTHESIS_PROFILE: ci (the default: fixed examples, ~3 minutes on 2 cores), dev (fresh random
# examples, the CI counts) or soak (fresh random examples, 50× the CI counts: local runs). Every profile
# prints the failing example and its @reproduce_failure blob; see tests/loss/test_properties.py.
from hypothesis import HealthCheck, settings  # noqa: E402

_SLOW_CHECKS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", max_examples=20, deadline=None, derandomize=True, database=None,
                          print_blob=True, suppress_health_check=_SLOW_CHECKS)
settings.register_profile("dev", max_examples=20, deadline=None, print_blob=True, suppress_health_check=_SLOW_CHECKS)
settings.register_profile("soak", max_examples=1000, deadline=None, print_blob=True,
                          suppress_health_check=_SLOW_CHECKS)
settings.load_profile(os.environ.get("MP_GRPO_HYPOTHESIS_PROFILE", "ci"))
