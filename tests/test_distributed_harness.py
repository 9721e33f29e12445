"""The torchrun harness (tests/distributed.py): a case that outlives its timeout raises TimeoutExpired and leaves no
worker behind (torchrun's workers run in sessions of their own; the harness stops torchrun with SIGTERM, which
stops them)."""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.distributed import torchrun, worker_main


def _processes_with(token: str) -> list[int]:
    out = []
    for pid in (p for p in Path("/proc").iterdir() if p.name.isdigit()):
        try:
            if token in (pid / "cmdline").read_bytes().decode(errors="replace"):
                out.append(int(pid.name))
        except OSError:
            continue
    return out


def case_sleep(token: str) -> None:
    time.sleep(600)


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc (Linux)")
def test_timed_out_case_leaves_no_worker() -> None:
    token = f"harness-{uuid.uuid4().hex}"
    with pytest.raises(subprocess.TimeoutExpired):
        torchrun(__file__, "case_sleep", nproc=2, timeout=15, token=token)
    deadline = time.time() + 15
    while _processes_with(token) and time.time() < deadline:
        time.sleep(0.5)
    assert not _processes_with(token), "a worker outlived its timed-out torchrun"


if __name__ == "__main__":
    worker_main({"case_sleep": case_sleep})
