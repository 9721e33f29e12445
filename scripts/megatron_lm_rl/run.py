"""Megatron-LM's own RL loop (``train_rl.py``) on one GPU with mp_grpo's forward step — or Megatron-LM's own.

    MP_GRPO_MEGATRON_LM_SRC=<Megatron-LM tree> torchrun --standalone --nproc-per-node 1 \\
        scripts/megatron_lm_rl/run.py --forward-step mp_grpo [--packing] --out OUT
    python scripts/megatron_lm_rl/run.py --dry-run --out OUT          # CPU: argv, Megatron-LM's parser, imports

What it runs: ``train_rl.py``'s ``__main__`` in this file's words (:func:`train`) — Megatron-LM's ``parse_and_validate_args``
with its ``add_inference_args``, the GPT config, ``pretrain`` with no dataset — with the forward step of
``--forward-step``: ``mp_grpo`` (``GRPOForwardStep.from_args(args)``, checked against Megatron-LM's own loss on its
first micro-batch: ``mlm_parity``) or ``megatron_lm`` (``train_rl.forward_step``). The run's command line:
``mlm_argv`` (tiny GPT, successor-counting agent, ``--output-logit-dtype``, packing on or off). What is patched
in Megatron-LM's process and why: ``mlm_patches``. Rollouts come from Megatron-LM's dynamic inference engine behind
its coordinator and OpenAI-style server, on 127.0.0.1 only; their attention is flash-attn's, or — with
``--flash-attn stand-in`` (``auto``: when flash-attn is not importable) — the plain-torch stand-in in
``flash_attn_standin/`` (the rollout engine's attention only).

Writes to ``--out``: ``argv.json`` (the command line, the patches, the flash-attn choice), ``env_config.yaml``,
``rewards.jsonl`` (each step's rollouts: mean reward, its standard error, group means), ``parity.json`` (mp_grpo
only). ``--dry-run`` writes ``dry_run.json``: the argv, what Megatron-LM's parser made of it (the arguments the
forward step reads, the logit dtype ``from_args`` picks) and which of the run's modules import here.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import sys
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for path in (str(HERE), str(REPO)):
    if path not in sys.path:
        sys.path.insert(0, path)

from mlm_argv import ForwardStep, RunSpec, build_argv, env_config_yaml  # noqa: E402
from mlm_patches import STAND_IN_ENV, apply_process_patches, apply_run_patches  # noqa: E402
from mlm_source import MEGATRON_LM_SRC_ENV, megatron_lm_src, parse_megatron_args, use_source  # noqa: E402

if __name__ == "__mp_main__":  # a process Megatron-LM spawned (its coordinator): the same tree and patches
    _src = megatron_lm_src()
    if _src is not None:
        use_source(_src)
        apply_process_patches()

IMPORTS = ("torch", "transformer_engine.pytorch", "flash_attn", "zmq", "msgpack", "quart", "hypercorn", "openai",
           "aiohttp", "httpx", "yaml", "einops", "tqdm", "pydantic", "omegaconf", "tensorboard", "megatron.training",
           "megatron.rl.rl_utils", "megatron.rl.inference.megatron", "train_rl", "mp_grpo.integrations.megatron_rl")
"""What the run imports (``megatron.rl.rl_utils`` first: ``megatron.training`` hides its import error behind "RL
cannot run without the megatron.rl package")."""


def parse_cli(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forward-step", type=ForwardStep, choices=list(ForwardStep), default=ForwardStep.MP_GRPO)
    parser.add_argument("--packing", action=argparse.BooleanOptionalAction, default=False,
                        help="--rl-use-sequence-packing")
    parser.add_argument("--logit-dtype", choices=["fp32", "bf16"], default="fp32", help="--output-logit-dtype")
    parser.add_argument("--train-iters", type=int, default=RunSpec.train_iters)
    parser.add_argument("--lr", type=float, default=RunSpec.lr)
    parser.add_argument("--seed", type=int, default=RunSpec.seed)
    parser.add_argument("--flash-attn", choices=["auto", "stand-in", "installed"], default="auto",
                        help="the rollout engine's attention: flash-attn, or the plain-torch stand-in")
    parser.add_argument("--megatron-lm-src", type=Path, help=f"Megatron-LM's tree (default: ${MEGATRON_LM_SRC_ENV})")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU: build the argv, parse it, check the imports")
    return parser.parse_args(argv)


def flash_attn_choice(choice: str) -> str:
    """``stand-in`` or ``installed`` for ``--flash-attn`` (``auto``: the stand-in when flash-attn is not importable)."""
    installed = importlib.util.find_spec("flash_attn") is not None
    if choice == "installed" and not installed:
        raise SystemExit("--flash-attn installed: flash_attn is not importable (use --flash-attn stand-in)")
    return "installed" if choice == "installed" or (choice == "auto" and installed) else "stand-in"


def import_report() -> dict[str, str]:
    """Each of ``IMPORTS``: ``ok`` or the error's first line."""
    report = {}
    for name in IMPORTS:
        try:
            importlib.import_module(name)
            report[name] = "ok"
        except Exception as err:  # noqa: BLE001 - every failure is reported by name, none hidden
            report[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return report


def agent_report(env_config: Path) -> str:
    """The agent tree Megatron-LM builds from the environment config (``rl_utils.get_agent``), or the error."""
    try:
        from megatron.rl import rl_utils
        from mlm_patches import register_agent

        register_agent()
        agents = [type(a).__name__ for a in rl_utils.get_agent(str(env_config)).agents]
        return f"ok: {agents}"
    except Exception as err:  # noqa: BLE001 - reported, the dry run's reader decides
        return f"{type(err).__name__}: {err}"


def dry_run(spec: RunSpec, argv: list[str], out: Path, setup: dict) -> dict:
    """Megatron-LM's parser on the run's argv, the forward step's reading of it, and the import report."""
    from mp_grpo.integrations.megatron_rl import GRPOForwardStep, loss_config_from_args
    from mp_grpo.integrations.megatron_rl.forward_step import logit_dtype_from_args

    args = parse_megatron_args(argv, validate=True)
    cfg = loss_config_from_args(args)
    read = {name: str(getattr(args, name)) for name in (
        "logit_dtype", "grpo_clamp_eps_lower", "grpo_clamp_eps_upper", "grpo_kl_beta", "grpo_entropy_term_weight",
        "rl_inference_logprobs_is_correction", "rl_importance_sampling_truncation_coef", "rl_use_sequence_packing",
        "rl_sequence_packing_max_sequences_per_bin", "calculate_per_token_loss", "bf16", "fp16", "perform_rl_step",
        "padded_vocab_size", "inference_max_seq_length", "cuda_graph_impl")}
    summary = {"run": spec.name, "argv": argv, "setup": setup, "parsed": read,
               "from_args": {"logit_dtype": logit_dtype_from_args(args).value,
                             "eps": [cfg.policy.eps_low, cfg.policy.eps_high], "kl_coef": cfg.kl.coef}}
    GRPOForwardStep.from_args(args)  # builds: the loss config and the logit dtype are accepted
    summary["imports"] = import_report()
    summary["agent"] = agent_report(out / "env_config.yaml")
    (out / "dry_run.json").write_text(json.dumps(summary, indent=1))
    return summary


def record_rewards(path: Path) -> None:
    """Wrap ``rl_utils.get_environment_rollouts`` so that each step's rewards go to ``path`` (JSON lines, rank 0)."""
    import torch

    from megatron.rl import rl_utils
    from megatron.training import get_args

    collect = rl_utils.get_environment_rollouts

    def get_environment_rollouts(*args, **kwargs):
        rollouts, ledger = collect(*args, **kwargs)
        if torch.distributed.get_rank() == 0:
            groups = [[float(r.reward) for r in group] for group in rollouts]
            flat = [r for group in groups for r in group]
            mean = sum(flat) / len(flat)
            sem = math.sqrt(sum((r - mean) ** 2 for r in flat) / max(len(flat) - 1, 1) / len(flat))
            row = {"iteration": int(get_args().curr_iteration), "mean_reward": mean, "sem": sem, "n": len(flat),
                   "group_means": [sum(g) / len(g) for g in groups]}
            with path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"[mp_grpo rewards] {json.dumps({k: v for k, v in row.items() if k != 'group_means'})}", flush=True)
        return rollouts, ledger

    rl_utils.get_environment_rollouts = get_environment_rollouts


def train(spec: RunSpec, argv: list[str], out: Path) -> None:
    """``train_rl.py``'s ``__main__``, in this file's words, with the forward step of ``spec``."""
    sys.argv = ["train_rl.py", *argv]
    import train_rl  # Megatron-LM's entry module: its forward_step, dataset provider and GPT builder
    from megatron.core.enums import ModelType
    from megatron.inference.utils import add_inference_args
    from megatron.training import pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.utils import is_hybrid_model
    from model_provider import model_provider

    apply_run_patches()
    (out / "rewards.jsonl").unlink(missing_ok=True)
    record_rewards(out / "rewards.jsonl")
    train_rl.train_valid_test_datasets_provider.is_distributed = True
    args = parse_and_validate_args(extra_args_provider=add_inference_args, args_defaults={})
    if args.reset_attention_mask:
        raise SystemExit("--reset-attention-mask is not supported in RL training (train_rl.py refuses it too)")
    if is_hybrid_model(args):
        raise SystemExit("the launcher builds GPT models only")
    full_config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))

    def model_builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
        return train_rl._gpt_builder(args, pre_process, post_process, vp_stage, config=config,
                                     pg_collection=pg_collection)

    if spec.forward_step is ForwardStep.MP_GRPO:
        from mlm_parity import ParityCheckedForwardStep

        forward_step = ParityCheckedForwardStep.from_args(args)
        forward_step.parity_path = out / "parity.json"
        print(f"[mp_grpo] forward step: GRPOForwardStep.from_args (logit dtype {forward_step.logit_dtype.value})",
              flush=True)
    else:
        forward_step = train_rl.forward_step
        print("[mp_grpo] forward step: Megatron-LM's train_rl.forward_step", flush=True)
    # pretrain ends in rl_inference_interface_shutdown, which calls os._exit(0): every output is written before.
    pretrain(full_config, None, ModelType.encoder_or_decoder, forward_step, partial(model_provider, model_builder))


def main(argv: list[str] | None = None) -> dict | None:
    opts = parse_cli(argv)
    if opts.megatron_lm_src is not None:
        os.environ[MEGATRON_LM_SRC_ENV] = str(opts.megatron_lm_src.resolve())
    src = megatron_lm_src()
    if src is None:
        raise SystemExit(f"Megatron-LM's tree is not given: --megatron-lm-src or ${MEGATRON_LM_SRC_ENV}")
    use_source(src)
    spec = RunSpec(forward_step=opts.forward_step, packing=opts.packing, logit_dtype=opts.logit_dtype,
                   train_iters=opts.train_iters, lr=opts.lr, seed=opts.seed)
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    env_config = out / "env_config.yaml"
    env_config.write_text(env_config_yaml(spec.seed))
    argv_run = build_argv(spec, env_config.resolve())
    flash = flash_attn_choice(opts.flash_attn)
    os.environ[STAND_IN_ENV] = "1" if flash == "stand-in" else "0"
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    setup = {"megatron_lm_src": str(src), "commit": _commit(src), "flash_attn": flash, **apply_process_patches()}
    (out / "argv.json").write_text(json.dumps({"run": spec.name, "argv": argv_run, "setup": setup}, indent=1))
    print(f"[mp_grpo] {spec.name}: {json.dumps(setup)}", flush=True)
    if opts.dry_run:
        summary = dry_run(spec, argv_run, out, setup)
        print(json.dumps(summary, indent=1))
        return summary
    train(spec, argv_run, out)
    return None


def _commit(src: Path) -> str | None:
    marker = src / "COMMIT"
    return marker.read_text().strip() if marker.is_file() else None


if __name__ == "__main__":
    main()
