#!/usr/bin/env python
"""The main job from a checkout: on-policy GRPO that learns a verifiable task (``python -m mp_grpo.train``).

    torchrun --standalone --nproc_per_node 2 scripts/grpo_step.py --config cpu     # CPU, gloo, TP = 2
    torchrun --nproc_per_node 1 scripts/grpo_step.py --config gpu                   # GPTModel on one GPU
    ... [key=value ...]   # dotlist overrides, e.g. train.steps=10 engine.logit_noise_std=1.0

See :mod:`mp_grpo.train.loop` for the schedule and ``mp_grpo/train/configs/`` for the configs.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout without install

from mp_grpo.train.__main__ import main  # noqa: E402

if __name__ == "__main__":
    main()
