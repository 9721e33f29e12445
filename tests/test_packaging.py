"""The package as a user installs it: build a wheel, install it into a scratch directory and use it from outside
the checkout (pyproject.toml: package data, the presets by name, ``python -m mp_grpo.demo``).

The wheel is built from a copy of the files that make the package (so no ``build/`` of an earlier run and
no untracked file of the checkout leaks in), with ``pip wheel --no-deps`` as a user would; it is installed
with ``pip install --no-deps --target``, and the checks run in a fresh interpreter whose working directory
and ``PYTHONPATH`` hold no trace of the checkout. Its dependencies come from the running environment.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE_FILES = ["pyproject.toml", "README.md"]

CHECK = """
import sys
from pathlib import Path

import importlib.metadata

import mp_grpo
from mp_grpo.config import LossConfig, load_config, preset_names

site = Path(sys.argv[1]).resolve()
assert Path(mp_grpo.__file__).resolve().is_relative_to(site), f"mp_grpo imported from {mp_grpo.__file__}, not {site}"
shipped = sorted(str(p.relative_to(site)) for p in (site / "mp_grpo").rglob("*.yaml"))
expected = sys.argv[2].split(",")
assert shipped == expected, f"the wheel ships {shipped}, the checkout has {expected}"
installed = importlib.metadata.version("mp_grpo")
assert installed == mp_grpo.__version__, f"the wheel's metadata says {installed}, mp_grpo.__version__ {mp_grpo.__version__}"
names = preset_names()
assert names and all(isinstance(load_config(name), LossConfig) for name in names)
print("presets", " ".join(names))
"""


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode})\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.packaging
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in PACKAGE_FILES:
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "mp_grpo", src / "mp_grpo", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    yamls = sorted(str(p.relative_to(REPO)) for p in (REPO / "mp_grpo").rglob("*.yaml"))
    assert any(y.startswith("mp_grpo/presets/") for y in yamls)

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(src)], src, env)
    (wheel,) = wheels.glob("mp_grpo-*.whl")
    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)],
         tmp_path, env)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env["PYTHONPATH"] = str(site)
    out = _run([sys.executable, "-c", CHECK, str(site), ",".join(yamls)], elsewhere, env)
    assert "trl_dapo" in out
    demo = _run([sys.executable, "-m", "mp_grpo.demo"], elsewhere, env)
    assert "max |difference| from the float64 reference" in demo, demo
