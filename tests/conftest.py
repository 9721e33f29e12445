"""Test-session setup: run Triton kernels under the interpreter when no GPU is present.

``mp_grpo.kernels`` makes the same choice on import; setting it here too keeps workers that
torchrun starts from a test file on the same path.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The hypothesis profiles of the property tests (MP_GRPO_HYPOTHESIS_PROFILE: ci, the default | dev | soak).
from tests.hypothesis_profiles import load_profile  # noqa: E402

load_profile()
