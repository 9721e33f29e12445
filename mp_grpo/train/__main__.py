"""``python -m mp_grpo.train --config CONFIG [key=value ...]``: the learning job with its table, bar, log and plot.

    torchrun --standalone --nproc_per_node 2 -m mp_grpo.train --config cpu   # the packaged CPU config (TP = 2)
    torchrun --nproc_per_node 1 -m mp_grpo.train --config gpu                 # GPTModel on one GPU

``--config`` takes a YAML path, or ``cpu`` / ``gpu`` for the configs shipped in ``mp_grpo/train/configs``.
Rank 0 prints the description, the layout and the run directory, one table row per step under a tqdm bar,
and the measured change of the reward; it writes ``log.json`` (config, layout, per-step records) and
``curves.png`` into the run directory (:mod:`mp_grpo.train.outputs`).

A bad config or layout — an unknown key, a bad value, a layout that does not fit the processes launched —
stops the job before it starts: rank 0 prints one line naming the key, the value and what is allowed, and
every rank exits with status 2. ``--traceback`` (or the environment variable ``MP_GRPO_TRACEBACK=1``) adds
the Python traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

ON_CPU = not torch.cuda.is_available()
if ON_CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before mp_grpo imports triton
    # The interpreter evaluates masked-off lanes too (log(0), 0/0 there never reach a result); numpy warns.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
    # megatron-core's advice to set CUDA_DEVICE_MAX_CONNECTIONS: a CUDA stream setting, meaningless on CPU.
    warnings.filterwarnings("ignore", message=r"When using async grad allreduce it is recommended to set the environment "
                            r"variable CUDA_DEVICE_MAX_CONNECTIONS", category=UserWarning)
# megatron-core announces each fallback when neither transformer-engine nor apex is installed (both optional).
warnings.filterwarnings("ignore", message=r".*(Transformer Engine and Apex are|Apex is) not installed")
# megatron-core's TransformerConfig warns about its own default value of cuda_graph_scope ("full").
warnings.filterwarnings("ignore", message=r"full scope is deprecated\. Use empty cuda_graph_scope", category=UserWarning)

import torch.distributed as dist  # noqa: E402
from tqdm import tqdm  # noqa: E402

from mp_grpo.config import ConfigError  # noqa: E402
from mp_grpo.config.job import JobConfig, load_job_config  # noqa: E402
from mp_grpo.config.loading import did_you_mean  # noqa: E402
from mp_grpo.train.loop import check_layout, run, world_size  # noqa: E402
from mp_grpo.train.outputs import RunOutputs, plan_outputs, write_log  # noqa: E402
from mp_grpo.train.report import describe_run, format_header, format_row, plot_records, summary  # noqa: E402

PACKAGED = Path(__file__).resolve().parent / "configs"
TRACEBACK_ENV = "MP_GRPO_TRACEBACK"
"""Set to 1 for the Python traceback of a config or layout error (as ``--traceback``)."""
USAGE_ERROR = 2
"""Exit status of a config or layout error (as argparse's for a bad command line)."""
PEER_EXIT_WAIT_S = 10.0
"""Under torchrun, how long a rank other than 0 waits after a config error for torchrun to stop it (once rank 0
has exited with the error), so that rank 0's error is the one torchrun reports."""


def packaged_names() -> list[str]:
    return sorted(p.stem.removeprefix("grpo_") for p in PACKAGED.glob("grpo_*.yaml"))


def config_path(name: str) -> Path:
    """A YAML path, or the name of a packaged config (``cpu``, ``gpu``)."""
    packaged = PACKAGED / f"grpo_{name}.yaml"
    if packaged.exists():
        return packaged
    path = Path(name)
    if not path.is_file():
        names = packaged_names()
        hint = did_you_mean(name, names)
        raise ConfigError(f"--config: got {name!r}, neither a packaged config nor a YAML file{f' ({hint})' if hint else ''}; "
                          f"allowed: {' | '.join(names)} | a YAML path")
    return path


def launch_command(cfg: JobConfig, argv: list[str]) -> str:
    """The torchrun command that runs this job's command line on TP·CP processes."""
    target = "-m mp_grpo.train" if Path(sys.argv[0]).name == "__main__.py" else shlex.quote(sys.argv[0])
    n = cfg.parallel.tensor_model_parallel_size * cfg.parallel.context_parallel_size
    return f"torchrun --standalone --nproc_per_node {n} {target} {shlex.join(argv)}".rstrip()


def check_launch(cfg: JobConfig, argv: list[str]) -> None:
    """Without torchrun the job is one process: a layout of TP·CP > 1 gets the command that launches it."""
    tp, cp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.context_parallel_size
    if "RANK" in os.environ or dist.is_initialized() or tp * cp == 1:
        return
    sizes = [(k, v) for k, v in (("tensor_model_parallel_size", tp), ("context_parallel_size", cp)) if v > 1]
    raise ConfigError(
        f"parallel.{sizes[0][0]}: got {sizes[0][1]}, which needs {tp * cp} processes, but this is one process (not "
        f"launched by torchrun); run `{launch_command(cfg, argv)}`, or add "
        + " ".join(f"parallel.{k}=1" for k, _ in sizes) + " to run on one process"
    )


def prepare(args: argparse.Namespace, argv: list[str]) -> tuple[JobConfig, RunOutputs]:
    """Everything that can fail before the job starts: the config, the layout on this launch, the run directory."""
    path = config_path(args.config)
    cfg = load_job_config(path, args.overrides)
    check_launch(cfg, argv)
    check_layout(cfg, world_size(), torch.cuda.is_available())
    return cfg, plan_outputs(cfg, path.stem)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="cpu", help=f"a YAML path, or {' / '.join(packaged_names())} (mp_grpo/train/configs)")
    parser.add_argument("--traceback", action="store_true",
                        help=f"show the Python traceback of a config or layout error (or set {TRACEBACK_ENV}=1)")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. train.steps=10 engine.logit_noise_std=0.5")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    try:
        cfg, outputs = prepare(args, argv)
        train(cfg, outputs, rank0)  # a check inside the loop's set-up (the loss, the adapter) may still refuse
    except ConfigError as exc:
        _exit_on_error(exc, rank0, args.traceback or os.environ.get(TRACEBACK_ENV, "0") not in ("", "0"))


def _exit_on_error(exc: ConfigError, rank0: bool, show_traceback: bool) -> None:
    """Rank 0's one line (after the traceback when asked), shown once; status 2 on every rank.

    Without torchrun rank 0 prints the line on stderr. Under torchrun it goes into rank 0's error file
    (``TORCHELASTIC_ERROR_FILE``) instead, and torchrun prints it as the root cause at the end of its failure
    report, below its own traceback, where it is not buried. Rank 0 exits first (so it is that root cause); the
    other ranks wait for the SIGTERM torchrun then sends them and exit with the same status.
    """
    signal.signal(signal.SIGTERM, lambda *_: os._exit(USAGE_ERROR))
    if dist.is_initialized():
        dist.destroy_process_group()
    line = f"error: {exc}"
    if rank0 and show_traceback:
        traceback.print_exception(exc)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if rank0 and error_file:
        stamp = str(int(time.time()))  # torchrun's format: the message, and the "callstack" it prints
        Path(error_file).write_text(json.dumps({"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": stamp}}}))
    elif rank0:
        print(line, file=sys.stderr, flush=True)
    elif error_file:
        time.sleep(PEER_EXIT_WAIT_S)  # torchrun's SIGTERM ends this sleep with status 2
    raise SystemExit(USAGE_ERROR)


def train(cfg: JobConfig, outputs: RunOutputs, rank0: bool) -> None:
    """Run the job; rank 0 prints the table and the summary and writes the run directory."""
    bar = tqdm(total=cfg.train.steps, desc="grpo", disable=not (rank0 and cfg.output.progress_bar), dynamic_ncols=True)
    info: dict = {}

    def on_start(start: dict) -> None:
        info.update(start)
        if rank0:
            tqdm.write(start["description"])
            tqdm.write("layout: " + ", ".join(f"{k}={v}" for k, v in start["layout"].items()))
            tqdm.write(f"outputs: {outputs.dir}/" + (f" ({outputs.note})" if outputs.note else ""))
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
        write_log(outputs, cfg, info, records)
        print(f"wrote {outputs.log}", flush=True)
        if outputs.plot is not None:
            plot_records(records, outputs.plot, title=describe_run(cfg, info), chance=1 / cfg.model.vocab_size,
                         clip_grad=cfg.train.clip_grad)
            print(f"wrote {outputs.plot}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
