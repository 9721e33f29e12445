"""``python -m mp_grpo.train --config CONFIG [key=value ...]``: the learning job with its table, bar, log and plot.

    torchrun --standalone --nproc_per_node 2 -m mp_grpo.train --config cpu   # the packaged CPU config (TP = 2)
    torchrun --nproc_per_node 1 -m mp_grpo.train --config gpu                 # GPTModel on one GPU

``--config`` takes a YAML path, or ``cpu`` / ``gpu`` for the configs shipped in ``mp_grpo/train/configs``.
Rank 0 prints the description and layout, one table row per step under a tqdm bar, and writes the JSON
log (config, layout, per-step records) and a PNG of reward, loss, grad norm, vllm-kl and IS statistics.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before mp_grpo imports triton
    # The interpreter evaluates masked-off lanes too (log(0), 0/0 there never reach a result); numpy warns.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
# megatron-core announces each fallback when neither transformer-engine nor apex is installed (both optional).
warnings.filterwarnings("ignore", message=r".*(Transformer Engine and Apex are|Apex is) not installed")
warnings.filterwarnings("ignore", category=DeprecationWarning)

import torch.distributed as dist  # noqa: E402
from tqdm import tqdm  # noqa: E402

from mp_grpo.config.job import load_job_config  # noqa: E402
from mp_grpo.train.loop import run  # noqa: E402
from mp_grpo.train.report import format_header, format_row, plot_records, summary  # noqa: E402

PACKAGED = Path(__file__).resolve().parent / "configs"


def config_path(name: str) -> Path:
    """A YAML path, or the name of a packaged config (``cpu``, ``gpu``)."""
    packaged = PACKAGED / f"grpo_{name}.yaml"
    if packaged.exists():
        return packaged
    path = Path(name)
    if not path.exists():
        raise SystemExit(f"--config: {name!r} is neither a file nor one of {sorted(p.stem[5:] for p in PACKAGED.glob('grpo_*.yaml'))}")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="cpu", help="YAML path, or cpu / gpu (mp_grpo/train/configs)")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. train.steps=10 engine.logit_noise_std=0.5")
    args = parser.parse_args(argv)
    cfg = load_job_config(config_path(args.config), args.overrides)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    bar = tqdm(total=cfg.train.steps, desc="grpo", disable=not (rank0 and cfg.output.progress_bar), dynamic_ncols=True)
    info: dict = {}

    def on_start(start: dict) -> None:
        info.update(start)
        if rank0:
            tqdm.write(start["description"])
            tqdm.write("layout: " + ", ".join(f"{k}={v}" for k, v in start["layout"].items()))
            tqdm.write(format_header())

    def on_step(record: dict) -> None:
        if rank0:
            tqdm.write(format_row(record))
        bar.set_postfix(reward=f"{record['reward']:.3f}", loss=f"{record['metrics']['loss']:.4f}")
        bar.update()

    records = run(cfg, on_start=on_start, on_step=on_step)
    bar.close()
    if rank0:
        print(summary(records, cfg), flush=True)
        path = Path(cfg.output.json_log)
        path.parent.mkdir(parents=True, exist_ok=True)
        steps = [{k: v for k, v in r.items() if k not in ("completions", "rewards")} for r in records]
        log = dict(info, config=json.loads(json.dumps(asdict(cfg), default=lambda e: e.value)), steps=_finite(steps))
        path.write_text(json.dumps(log, indent=2))
        print(f"wrote {path}", flush=True)
        if cfg.output.plot:
            where = info.get("description", "").split(":")[0]  # CPU | GPU
            plot_records(records, cfg.output.plot, title=f"mp_grpo: on-policy GRPO, successor counting ({where}, layout {info.get('layout')})")
            print(f"wrote {cfg.output.plot}", flush=True)
    dist.destroy_process_group()


def _finite(x):
    """JSON-safe copy: non-finite floats become null."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


if __name__ == "__main__":
    main()
