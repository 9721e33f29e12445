"""Compile Triton kernels for an H100 / H200 (sm_90) on a machine without a GPU.

Triton's real compiler (to PTX and, with the ptxas shipped in the triton wheel, to a cubin) rejects code
that the interpreter the CPU suite runs accepts (types that differ between branches, globals that are not
``tl.constexpr``, …). Triton picks the interpreter when a kernel is defined, and the test session has it on,
so a compile test runs its own file as a script in a subprocess with ``TRITON_INTERPRET=0``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

needs_nvidia_backend = pytest.mark.skipif(
    importlib.util.find_spec("triton.backends.nvidia") is None, reason="no NVIDIA Triton backend"
)


def run_compile_script(script: str | Path) -> str:
    """Run ``script`` (a test file's ``__main__``) with the compiler, not the interpreter; its stdout."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600,
                          cwd=REPO_ROOT)
    assert proc.returncode == 0, f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
    return proc.stdout


class Sm90Compiler:
    """``compile(kernel, types, constexprs)`` for sm_90, counting the kernels it compiled."""

    def __init__(self, num_warps: int = 4) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)
        self.num_warps = num_warps
        self.count = 0

    def compile(self, kernel, types: dict[str, str], constexprs: dict, aligned: tuple[str, ...] = ()):
        """The compiled kernel (its ``.asm["ptx"]``). ``aligned``: arguments declared divisible by 16 (pointers
        16-byte aligned, integers multiples of 16), as Triton's launcher specializes them at run time."""
        import triton
        from triton.compiler import ASTSource

        signature = {name: "constexpr" if name in constexprs else types[name] for name in kernel.arg_names}
        attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                                  target=self.target, options={"num_warps": self.num_warps})
        self.count += 1
        return compiled
