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
import warnings
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
NATIVE_ABORT = "terminate called without an active exception"
"""What the C++ runtime prints when it aborts a process (std::terminate outside any exception)."""
WORKER_STOP_S = 45.0
"""How long a timed-out torchrun gets to stop its workers after SIGTERM (it gives them 30 s, then SIGKILL)."""


def _run(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run`` of torchrun, except on a timeout: SIGTERM, so that torchrun stops its workers (they run in
    sessions of their own: the SIGKILL ``subprocess.run`` sends would leave them running), then the timeout."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=WORKER_STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


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
    proc = _run(cmd, env, timeout)
    if proc.returncode != 0 and NATIVE_ABORT in proc.stderr:
        # Seen in 2 of 3 full CI runs, on one case, never alone (21 runs): a worker aborted by the C++ runtime with
        # no Python traceback. A case's own failure raises in Python and is never retried; this abort gets one
        # more run, and the retry is reported as a warning so that it stays visible.
        warnings.warn(f"torchrun {Path(script).name} {case}: a worker aborted ({NATIVE_ABORT!r}, no Python "
                      f"traceback); ran it once more. Its stderr:\n{proc.stderr[-2000:]}", RuntimeWarning)
        proc = _run(cmd, env, timeout)
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
    # The case passed and the group is gone: leave without the interpreter's teardown, where native libraries'
    # static destructors run (the suspected place of the abort that torchrun() retries once).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
