"""Hypothesis profiles of the property tests (tests/loss/test_properties*.py), chosen by the environment variable
``MP_GRPO_HYPOTHESIS_PROFILE``; loaded by tests/conftest.py and by the torchrun workers of the CP property.

* ``ci`` (the default: ``python -m pytest`` and CI): ``derandomize=True`` — the same examples on every run, so a
  failure reproduces by running the test again; about 3 minutes for the property files on 2 cores.
* ``dev``: the CI counts with fresh random examples (and hypothesis' example database in ``.hypothesis/``).
* ``soak``: 50× the CI counts, fresh random examples — for local runs (``nice -n 19``) and
  scripts/soak_properties.py.
* ``gpu``: the soak counts, on CUDA (``MP_GRPO_PROPERTY_DEVICE`` defaults to ``cuda`` under it): the single-call,
  split and ``on_logits`` properties and the log-prob op's on the compiled Triton kernels, at sizes that span the
  GPU kernels' blocks (tests/loss/test_properties.py, tests/ops/test_logprob_properties.py).

Every profile has no deadline (the Triton interpreter's timings vary, a GPU profile's first draws compile kernels)
and prints the falsifying example and its ``@reproduce_failure`` blob.

Three variables steer the property tests (any profile):

* ``MP_GRPO_PROPERTY_DEVICE``: ``cpu`` (default; ``cuda`` under ``gpu``) or ``cuda``: where the tests that support
  it (:func:`property_device`) run GRPOLoss and the log-prob op; the float64 references stay on the CPU. ``cuda``
  without a GPU skips them, saying so.
* ``MP_GRPO_PROPERTY_COMPUTE``: ``float32`` or ``float64`` — only steps whose log-probs make the loss compute in
  that dtype (:func:`forced_compute_dtype`); unset, both are drawn.
* ``MP_GRPO_PROPERTY_STATS``: a directory where each process writes how many examples it ran
  (tests/property_stats.py).
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

ENV = "MP_GRPO_HYPOTHESIS_PROFILE"
DEVICE_ENV = "MP_GRPO_PROPERTY_DEVICE"
COMPUTE_ENV = "MP_GRPO_PROPERTY_COMPUTE"
CI_EXAMPLES = 20
"""``max_examples`` of the ci and dev profiles: the unit the property tests scale their example counts by."""
SOAK_FACTOR = 50

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", max_examples=CI_EXAMPLES, deadline=None, derandomize=True, database=None,
                          print_blob=True, suppress_health_check=_QUIET)
settings.register_profile("dev", max_examples=CI_EXAMPLES, deadline=None, print_blob=True, suppress_health_check=_QUIET)
settings.register_profile("soak", max_examples=CI_EXAMPLES * SOAK_FACTOR, deadline=None, print_blob=True,
                          suppress_health_check=_QUIET)
settings.register_profile("gpu", max_examples=CI_EXAMPLES * SOAK_FACTOR, deadline=None, print_blob=True,
                          suppress_health_check=_QUIET)
_COMPUTE = {"float32": torch.float32, "float64": torch.float64}


def profile_name() -> str:
    return os.environ.get(ENV, "ci")


def load_profile() -> None:
    """Load the profile ``MP_GRPO_HYPOTHESIS_PROFILE`` names (ci when unset; an unknown name is an error), and count
    the examples run when ``MP_GRPO_PROPERTY_STATS`` asks for it (tests/property_stats.py)."""
    settings.load_profile(profile_name())
    from tests.property_stats import install

    install()


def property_device() -> torch.device:
    """Where the device-aware property tests run: ``MP_GRPO_PROPERTY_DEVICE``, else cuda under the gpu profile,
    else cpu. ValueError for another name."""
    name = os.environ.get(DEVICE_ENV) or ("cuda" if profile_name() == "gpu" else "cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV} must be cpu or cuda, got {name!r}")
    return torch.device(name)


def needs_property_device():
    """A pytest mark: skip the test when :func:`property_device` is cuda and torch sees no GPU (decided when the
    test module is imported, before hypothesis runs anything)."""
    import pytest

    return pytest.mark.skipif(property_device().type == "cuda" and not torch.cuda.is_available(),
                              reason=f"{DEVICE_ENV}=cuda (or the gpu profile) but torch sees no CUDA device")


def forced_compute_dtype() -> torch.dtype | None:
    """``MP_GRPO_PROPERTY_COMPUTE`` as a dtype (None when unset). ValueError for another name."""
    name = os.environ.get(COMPUTE_ENV)
    if not name:
        return None
    if name not in _COMPUTE:
        raise ValueError(f"{COMPUTE_ENV} must be float32 or float64, got {name!r}")
    return _COMPUTE[name]


def on_gpu() -> bool:
    """Whether the device-aware property tests run on CUDA (they then draw sizes that span the kernels' blocks)."""
    return property_device().type == "cuda"


SOAK_TORCHRUN_TIMEOUT_S = 6 * 3600.0
"""The torchrun timeout of a property test under a profile other than ci: a soak runs as long as its examples take
(scripts/soak_properties.py stops it at its own time limit)."""


def torchrun_timeout(ci_seconds: float) -> float:
    """A torchrun property test's timeout: ``ci_seconds`` under the ci profile, else :data:`SOAK_TORCHRUN_TIMEOUT_S`."""
    return ci_seconds if profile_name() == "ci" else SOAK_TORCHRUN_TIMEOUT_S


def examples(weight: float) -> int:
    """A test's example count: ``weight`` × the loaded profile's ``max_examples`` (ci: 20)."""
    return max(1, round(settings.default.max_examples * weight))
