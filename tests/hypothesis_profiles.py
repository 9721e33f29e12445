"""Hypothesis profiles of the property tests (tests/loss/test_properties*.py), chosen by the environment variable
``MP_GRPO_HYPOTHESIS_PROFILE``; loaded by tests/conftest.py and by the torchrun workers of the CP property.

* ``ci`` (the default: ``python -m pytest`` and CI): ``derandomize=True`` — the same examples on every run, so a
  failure reproduces by running the test again; about 3 minutes for the property files on 2 cores.
* ``dev``: the CI counts with fresh random examples (and hypothesis' example database in ``.hypothesis/``).
* ``soak``: 50× the CI counts, fresh random examples — for local runs (``nice -n 19``).

Every profile has no deadline (the Triton interpreter's timings vary) and prints the falsifying example and its
``@reproduce_failure`` blob.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

ENV = "MP_GRPO_HYPOTHESIS_PROFILE"
CI_EXAMPLES = 20
"""``max_examples`` of the ci and dev profiles: the unit the property tests scale their example counts by."""
SOAK_FACTOR = 50

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", max_examples=CI_EXAMPLES, deadline=None, derandomize=True, database=None,
                          print_blob=True, suppress_health_check=_QUIET)
settings.register_profile("dev", max_examples=CI_EXAMPLES, deadline=None, print_blob=True, suppress_health_check=_QUIET)
settings.register_profile("soak", max_examples=CI_EXAMPLES * SOAK_FACTOR, deadline=None, print_blob=True,
                          suppress_health_check=_QUIET)


def profile_name() -> str:
    return os.environ.get(ENV, "ci")


def load_profile() -> None:
    """Load the profile ``MP_GRPO_HYPOTHESIS_PROFILE`` names (ci when unset); an unknown name is an error."""
    settings.load_profile(profile_name())


def examples(weight: float) -> int:
    """A test's example count: ``weight`` × the loaded profile's ``max_examples`` (ci: 20)."""
    return max(1, round(settings.default.max_examples * weight))
