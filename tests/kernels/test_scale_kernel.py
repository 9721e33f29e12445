"""The scale kernel (mp_grpo/kernels/scale.py) compiles for an H100 / H200 (sm_90) on a machine without a GPU:
every pairing of x and out dtypes the with-loss op's backward uses (and the rest), with and without
accumulation, a scale of each float dtype, int32 and int64 element counts (a [V_local, H] weight gradient may
pass 2^31 elements), at the block the launcher uses on a GPU. With 16-byte aligned pointers and an element
count divisible by 16 (how Triton's launcher specializes the with-loss op's buffers) every access of x and out
is a 16-byte vector access.

The compilation runs in a subprocess with ``TRITON_INTERPRET=0`` (this file is its script; see ``sm90.py``).
"""

from __future__ import annotations

import itertools
import re

from tests.kernels.sm90 import Sm90Compiler, needs_nvidia_backend, run_compile_script

_DTYPES = ("*fp32", "*bf16", "*fp16")


@needs_nvidia_backend
def test_scale_kernel_compiles_for_sm90() -> None:
    assert "compiled 38 kernels" in run_compile_script(__file__)


def _compile_all() -> None:
    from mp_grpo.kernels.scale import scale_kernel
    from mp_grpo.ops.scale import SCALE_BLOCK, SCALE_WARPS

    compiler = Sm90Compiler(num_warps=SCALE_WARPS)
    for x, out, accumulate, n in itertools.product(_DTYPES, _DTYPES, (False, True), ("i32", "i64")):
        for scale in (("*fp32", "*bf16", "*fp16") if (x, out, accumulate, n) == ("*bf16", "*bf16", False, "i32")
                      else ("*fp32",)):
            compiled = compiler.compile(scale_kernel, dict(x_ptr=x, out_ptr=out, scale_ptr=scale, n=n),
                                        dict(ACCUMULATE=accumulate, BLOCK=SCALE_BLOCK),
                                        aligned=("x_ptr", "out_ptr", "scale_ptr", "n"))
            # The one scalar load (the scale) aside, loads and stores of x and out move 16 bytes each.
            accesses = re.findall(r"\b(ld|st)\.global(\.v\d)?\.b(\d+)", compiled.asm["ptx"])
            wide = [a for a in accesses if a[1] == ".v4" and a[2] == "32"]
            narrow = [a for a in accesses if a not in wide]
            assert len(narrow) <= 1 and wide, f"{x} -> {out} (accumulate {accumulate}): accesses {accesses}"
    print(f"compiled {compiler.count} kernels for sm_90")


if __name__ == "__main__":
    _compile_all()
