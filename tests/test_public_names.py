"""The names a user looks for at the top level of ``mp_grpo`` (``mp_grpo/__init__.py``), and the one version."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

import mp_grpo

REPO = Path(__file__).resolve().parents[1]


def test_all_names_exist_and_are_the_implementations() -> None:
    from mp_grpo.config.loss import ConfigError
    from mp_grpo.config.loading import preset_names
    from mp_grpo.ops.fused_linear_loss import fused_linear_loss

    assert len(set(mp_grpo.__all__)) == len(mp_grpo.__all__)
    for name in mp_grpo.__all__:
        assert hasattr(mp_grpo, name), name
    for name in ("fused_linear_loss", "ConfigError", "preset_names", "__version__"):
        assert name in mp_grpo.__all__, name
    assert mp_grpo.fused_linear_loss is fused_linear_loss
    assert mp_grpo.ConfigError is ConfigError
    assert mp_grpo.preset_names is preset_names


def test_config_error_and_presets_from_the_top_level() -> None:
    assert "trl_dapo" in mp_grpo.preset_names()
    with pytest.raises(mp_grpo.ConfigError, match="policy.objectiv"):
        mp_grpo.load_config(None, ["policy.objectiv=gspo"])


def test_fused_linear_loss_from_the_top_level() -> None:
    """The top-level name runs: a token-separable loss (the mean log-prob) and its gradient."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 4, generator=gen, requires_grad=True)
    weight = torch.randn(8, 4, generator=gen)
    target = torch.randint(0, 8, (2, 3), generator=gen)
    loss, aux = mp_grpo.fused_linear_loss(hidden, weight, target, lambda lp, ent: (-lp.sum() / lp.numel(), None))
    expected = torch.log_softmax(hidden.detach() @ weight.t(), -1).gather(-1, target.unsqueeze(-1)).mean().neg()
    torch.testing.assert_close(loss.detach(), expected)
    loss.backward()
    assert hidden.grad is not None and aux is None


def test_version_is_written_once() -> None:
    """pyproject.toml has no version of its own: setuptools reads ``mp_grpo.__version__`` (the wheel's metadata
    is checked against it in tests/test_packaging.py)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "mp_grpo.__version__"}
    pyprojecttoml = pytest.importorskip("setuptools.config.pyprojecttoml")  # a venv of Python ≥ 3.12 may lack it
    read_configuration = pyprojecttoml.read_configuration
    assert read_configuration(REPO / "pyproject.toml")["project"]["version"] == mp_grpo.__version__
    assert isinstance(mp_grpo.__version__, str) and mp_grpo.__version__.count(".") >= 2
