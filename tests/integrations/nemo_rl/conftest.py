"""NeMo-RL's source for the parity tests: importable already, or a checkout named by MP_GRPO_NEMO_RL_SRC.

Added to ``sys.path`` here, before the test modules import ``mp_grpo.integrations.nemo_rl`` (whose enums are
NeMo-RL's own when NeMo-RL is importable). Without it the parity tests skip and say so; the protocol tests run.
"""

import os
import sys

_SRC = os.environ.get("MP_GRPO_NEMO_RL_SRC")
if _SRC and _SRC not in sys.path:
    sys.path.insert(0, _SRC)
