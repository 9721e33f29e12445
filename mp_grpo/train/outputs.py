"""Where the learning job writes: one run directory per config, never silently overwritten.

``output.dir`` null (the default) → ``out/<config name>-seed<seed>-<digest>``, where ``<digest>`` is 8 hex digits of
the SHA-1 of the resolved config without its ``output`` section: runs whose configs differ in any key (an override,
the seed) write to different directories, and running the same config again replaces that config's earlier files
(said on the console). A directory named in ``output.dir`` that holds the log of a run of another config is refused
with a :class:`~mp_grpo.config.ConfigError` unless ``output.overwrite=true``.

Files in the run directory: ``log.json`` (config, its digest, layout, per-step records) and ``curves.png``
(:func:`mp_grpo.train.report.plot_records`), both written by rank 0.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from mp_grpo.config import ConfigError
from mp_grpo.config.job import JobConfig

DEFAULT_ROOT = Path("out")
"""Parent of the derived run directories (relative to the working directory)."""
LOG_NAME = "log.json"
PLOT_NAME = "curves.png"
DIGEST_CHARS = 8
"""Hex digits of the config's SHA-1 in a run directory's name: enough that two configs of one user do not collide."""


@dataclass(frozen=True)
class RunOutputs:
    """The files of one run and, when it replaces an earlier run of the same config, a note saying so."""

    dir: Path
    log: Path
    plot: Path | None
    digest: str
    note: str | None = None


def config_dict(cfg: JobConfig) -> dict:
    """The config as plain JSON types (enums by value)."""
    return json.loads(json.dumps(asdict(cfg), default=lambda e: e.value))


def config_digest(cfg: JobConfig) -> str:
    """SHA-1 (hex, :data:`DIGEST_CHARS` digits) of the config without its ``output`` section."""
    body = {k: v for k, v in config_dict(cfg).items() if k != "output"}
    return hashlib.sha1(json.dumps(body, sort_keys=True).encode()).hexdigest()[:DIGEST_CHARS]


def plan_outputs(cfg: JobConfig, config_name: str) -> RunOutputs:
    """The run directory and files of ``cfg`` (launched as ``config_name``, e.g. ``grpo_cpu``); see the module docstring.

    Reads, never writes: call it on every rank before the run, so a refusal stops all of them alike.
    """
    digest = config_digest(cfg)
    given = cfg.output.dir is not None
    run_dir = Path(cfg.output.dir) if given else DEFAULT_ROOT / f"{config_name}-seed{cfg.train.seed}-{digest}"
    log = run_dir / LOG_NAME
    plot = run_dir / PLOT_NAME if cfg.output.plot else None
    note = None
    if log.exists():
        earlier = _earlier_digest(log)
        if earlier == digest:
            note = f"replacing the files of an earlier run of the same config in {run_dir}"
        elif cfg.output.overwrite:
            note = f"overwriting {run_dir}, which holds a run of another config (output.overwrite=true)"
        else:
            raise ConfigError(
                f"output.dir: {run_dir} holds the log of a run of another config (digest {earlier}, this one {digest}); "
                "allowed: a new directory, null (a directory per config), or output.overwrite=true"
            )
    return RunOutputs(dir=run_dir, log=log, plot=plot, digest=digest, note=note)


def _earlier_digest(log: Path) -> str | None:
    try:
        return json.loads(log.read_text()).get("config_digest")
    except (OSError, ValueError, AttributeError):
        return None


def write_log(outputs: RunOutputs, cfg: JobConfig, info: dict, records: list[dict]) -> None:
    """``log.json``: the start info (description, layout), the config and its digest, and the per-step records
    (without the completions' tokens and rewards; non-finite floats as null)."""
    outputs.dir.mkdir(parents=True, exist_ok=True)
    steps = [{k: v for k, v in r.items() if k not in ("completions", "rewards")} for r in records]
    log = dict(info, config=config_dict(cfg), config_digest=outputs.digest, steps=_finite(steps))
    outputs.log.write_text(json.dumps(log, indent=2))


def _finite(x):
    """JSON-safe copy: non-finite floats become null."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
