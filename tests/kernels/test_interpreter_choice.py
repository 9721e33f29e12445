"""``import mp_grpo`` chooses Triton's interpreter on a machine without a GPU, and leaves the environment alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import os, subprocess, sys
import torch
import mp_grpo
from mp_grpo import vocab_parallel_logprobs
from mp_grpo.kernels.launch_config import INTERPRETER
assert INTERPRETER == (not torch.cuda.is_available()), INTERPRETER
# the process's environment, and so its children's, is what it was before the import
assert "TRITON_INTERPRET" not in os.environ, os.environ["TRITON_INTERPRET"]
child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('TRITON_INTERPRET'))"],
                       capture_output=True, text=True, check=True)
assert child.stdout.strip() == "None", child.stdout
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
x = torch.randn(6, 40, dtype=torch.float64, device=device)
t = torch.randint(0, 40, (6,), device=device)
got = vocab_parallel_logprobs(x.float(), t).double()
want = torch.log_softmax(x, -1).gather(-1, t[:, None]).squeeze(-1)
assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()
print("ok")
"""


def test_import_leaves_environment_alone_and_kernels_run():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", _CHILD], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok"), proc.stdout
