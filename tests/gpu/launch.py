"""The GPU tests' launcher: a worker script under ``torchrun`` (NCCL ranks), or any command, run from pytest with the
GPU environment; its output returned, a failure raised with the tails of its output.

A GPU test file that needs its own processes doubles as the worker script: its ``__main__`` block calls
:func:`worker_main` with a table of case functions, each of which starts with :func:`init_nccl`; the pytest test
calls :func:`torchrun` with the file, the case name, the number of ranks and the case's keyword arguments.

The environment (:func:`gpu_env`): Triton's interpreter off (real GPU kernels; a CPU test run may have set
``TRITON_INTERPRET``), NVLink multicast off (``NCCL_NVLS_ENABLE=0``), the repository first on ``PYTHONPATH``, and —
unless a test asks otherwise — ``NVIDIA_TF32_OVERRIDE=0``. The GPU tests compare fp32 results at fp32 tolerances
with TF32 off (the workers turn torch's ``allow_tf32`` flags off); Transformer Engine's fp32 GEMMs run on TF32
tensor cores whatever those flags say, and only this variable turns cuBLAS's TF32 off for them (with it unset, an
fp32 comparison under TE's layer spec misses its tolerance by ~10×: ``docs/megatron.md``, "Transformer Engine").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 900
"""A GPU test's processes run at most this long (a hung collective fails the test instead of the whole session)."""
TAIL_CHARS = 10_000
"""How much of a failed command's stdout and stderr the failure shows."""


def gpu_env(*, tf32_off: bool = True) -> dict[str, str]:
    """This process's environment for a GPU test's subprocess (see the module docstring)."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if tf32_off:
        env.setdefault("NVIDIA_TF32_OVERRIDE", "0")
    return env


def gpu_run(cmd: list[str], *, what: str, timeout: float = TIMEOUT_S, tf32_off: bool = True) -> str:
    """Runs ``cmd`` from the repository's root with :func:`gpu_env`; its stdout, or an ``AssertionError`` naming
    ``what`` with the exit code and both streams' tails."""
    proc = subprocess.run(cmd, env=gpu_env(tf32_off=tf32_off), capture_output=True, text=True, timeout=timeout,
                          cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"{what} failed ({proc.returncode})\n--- stdout ---\n{proc.stdout[-TAIL_CHARS:]}\n"
                             f"--- stderr ---\n{proc.stderr[-TAIL_CHARS:]}")
    return proc.stdout


def torchrun_cmd(nproc: int, *args: str) -> list[str]:
    """``torchrun --standalone --nproc_per_node=nproc ARGS`` through this Python."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


def torchrun(script: str | Path, case: str, nproc: int, *, timeout: float = TIMEOUT_S, tf32_off: bool = True,
             **kwargs) -> str:
    """``nproc`` ranks of ``script`` running ``case(**kwargs)`` (its ``__main__`` calls :func:`worker_main`)."""
    return gpu_run(torchrun_cmd(nproc, str(script), case, json.dumps(kwargs)), what=f"{Path(script).name} {case} "
                   f"(nproc={nproc})", timeout=timeout, tf32_off=tf32_off)


def worker_main(cases: dict[str, Callable[..., None]]) -> None:
    """A worker process: ``cases[argv[1]](**json(argv[2]))``, its process group destroyed afterwards (the case
    creates it: :func:`init_nccl`)."""
    import torch.distributed as dist

    case, kwargs = sys.argv[1], json.loads(sys.argv[2])
    try:
        cases[case](**kwargs)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def needs_gpus(count: int):
    """A skip mark for a test that needs ``count`` CUDA GPUs, saying so."""
    import pytest
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(have < count, reason=f"needs {count} CUDA GPU{'s' if count > 1 else ''}, this machine has {have}")


def init_nccl() -> None:
    """A worker's NCCL process group on its ``LOCAL_RANK``'s GPU, with torch's TF32 paths off (fp32 comparisons)."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
