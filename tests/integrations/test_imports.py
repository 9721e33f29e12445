"""``import mp_grpo`` imports no training framework: the adapters in mp_grpo.integrations import theirs only when
they are imported (verl's plugin is imported by ``import verl``, not the other way round)."""

from __future__ import annotations

import subprocess
import sys

from tests.distributed import REPO_ROOT


def test_import_mp_grpo_imports_no_framework() -> None:
    code = ("import sys, mp_grpo, mp_grpo.integrations; "
            "loaded = sorted(m for m in ('verl', 'nemo_rl', 'ray') if m in sys.modules); "
            "assert not loaded, loaded")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
