"""mp_grpo.ops.launcher on the CPU: the specialization key, the interpreter fallback, and the fast path's
bookkeeping against a stand-in kernel (the real direct launch is compared bitwise on a GPU in
tests/gpu/test_fast_launch.py)."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl

from mp_grpo.ops import launcher
from mp_grpo.ops.launcher import launch, specialization_key
from mp_grpo.ops.scale import scale_into


def _key(*args, **kwargs):
    return specialization_key(args, kwargs)


def test_key_tensor_dtype_and_alignment():
    buf = torch.zeros(64, dtype=torch.float32)
    assert _key(buf) == _key(torch.zeros(8, dtype=torch.float32))
    assert _key(buf) != _key(buf.to(torch.bfloat16))
    assert _key(buf) != _key(buf[1:])  # 4 bytes off: not 16-byte aligned
    assert _key(buf) == _key(buf[4:])  # 16 bytes off: aligned again
    assert _key(buf[1:]) == _key(buf[2:])  # both misaligned


def test_key_int_specializations():
    assert _key(32) == _key(48)  # both divisible by 16
    assert _key(32) != _key(33)
    assert _key(33) == _key(35)
    assert _key(1) != _key(3)  # == 1 is its own specialization
    assert _key(2**31 - 1) != _key(2**31 + 15)  # i32 vs i64, neither % 16
    assert _key(2**32) == _key(2**33)  # i64, % 16
    assert _key(2**63) != _key(2**62)  # u64 vs i64
    assert _key(-16) == _key(16)


def test_key_types_and_constexprs():
    assert _key(1.0) == _key(2.5)  # floats are not specialized
    assert _key(1.0) != _key(1)  # but a float is not an int
    assert _key(True) != _key(1)
    assert _key(None) != _key(0)
    assert _key(BLOCK=16) != _key(BLOCK=32)
    assert _key(FLAG=True) != _key(FLAG=1)  # equal values of different types
    assert _key(COMPUTE=tl.float32) != _key(COMPUTE=tl.float64)
    assert _key(num_warps=4) != _key(num_warps=8)
    assert _key(torch.zeros(4)) != _key(torch.zeros(4), num_warps=4)


def test_key_device():
    assert specialization_key((), {}, 0) != specialization_key((), {}, 1)


def test_interpreter_falls_back():
    assert not launcher.FAST_LAUNCH_AVAILABLE
    assert "interpreter" in launcher.FAST_LAUNCH_REASON.lower()
    with pytest.raises(RuntimeError, match="unavailable"):
        launcher.set_fast_launch(True)
    launcher.set_fast_launch(False)
    x = torch.randn(100)
    out = scale_into(x, torch.tensor(3.0))  # goes through launch() -> kernel[grid]
    torch.testing.assert_close(out, 3.0 * x, rtol=0, atol=0)
    assert not launcher._compiled


class _FakeCompiled:
    def __init__(self, log):
        self.log = log
        self.function = "fn"
        self.packed_metadata = "meta"

    @property
    def run(self):
        return lambda *a: self.log.append(("direct", a))


class _FakeKernel:
    """Stands in for a JITFunction: ``kernel[grid](...)`` records the call and returns a compiled stand-in."""

    arg_names = ["x_ptr", "n", "FLAG", "BLOCK"]
    pre_run_hooks: list = []

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.log.append(("normal", grid, args, kwargs))
            return _FakeCompiled(self.log)

        return call


@pytest.fixture
def fast_path(monkeypatch):
    monkeypatch.setattr(launcher, "_enabled", True)
    monkeypatch.setattr(launcher, "_device_fns", (lambda: 0, lambda device: 1234))
    monkeypatch.setattr(launcher, "_compiled", {})


def test_fast_path_bookkeeping(fast_path):
    kernel = _FakeKernel()
    x = torch.zeros(32)
    launch(kernel, (3,), x, 5, FLAG=True, BLOCK=16, num_warps=4)
    launch(kernel, (7, 2), x, 7, FLAG=True, BLOCK=16, num_warps=4)  # same specialization: direct
    launch(kernel, (7,), x, 16, FLAG=True, BLOCK=16, num_warps=4)  # n % 16 == 0: new key, normal
    launch(kernel, (7,), x[1:], 5, FLAG=True, BLOCK=16, num_warps=4)  # misaligned: new key, normal
    launch(kernel, (7,), x, 5, FLAG=False, BLOCK=16, num_warps=4)  # other constexpr: normal
    kinds = [entry[0] for entry in kernel.log]
    assert kinds == ["normal", "direct", "normal", "normal", "normal"]
    direct = kernel.log[1][1]
    # grid (7, 2, 1), stream, function, packed metadata, no launch metadata / hooks, args, constexpr tail
    assert direct == (7, 2, 1, 1234, "fn", "meta", None, None, None, x, 7, True, 16)


def test_fast_path_convention_violation_stays_normal(fast_path):
    kernel = _FakeKernel()
    x = torch.zeros(32)
    for _ in range(2):
        launch(kernel, (1,), x, 5, FLAG=True)  # BLOCK not given (a default): never direct
    assert [entry[0] for entry in kernel.log] == ["normal", "normal"]
