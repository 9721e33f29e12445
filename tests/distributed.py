"""Run multi-rank test cases under ``torchrun`` (gloo) from plain pytest.

A test file that needs several ranks doubles as the worker script: its ``__main__`` block calls
:func:`worker_main` with a table of case functions; the pytest test calls :func:`torchrun` with the
file, the case name and the number of ranks. Every rank builds the same full inputs from a shared
seed, runs its shard and asserts against the single-process reference; any failing rank makes
torchrun exit non-zero, and the test fails with the workers' output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def torchrun(script: str | Path, case: str, nproc: int, timeout: float = 600.0, **kwargs) -> str:
    """Launch ``nproc`` ranks of ``script`` running ``case`` with keyword arguments ``kwargs``."""
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        str(script), case, json.dumps(kwargs),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun {Path(script).name} {case} (nproc={nproc}) failed with exit code {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-8000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
        )
    return proc.stdout


def worker_main(cases: dict[str, Callable[..., None]]) -> None:
    """Entry point of a worker process: init gloo, run ``cases[argv[1]](**json(argv[2]))``."""
    import torch.distributed as dist

    case, kwargs = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    try:
        cases[case](**kwargs)
    finally:
        dist.barrier()
        dist.destroy_process_group()
