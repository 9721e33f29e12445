"""``python -m mp_grpo.train.mismatch_lab``: run the lab's experiments and write their results.

Schedule
    1. Parse the experiments to run and the output folder.
    2. For each experiment: run it, print its markdown table, write ``<out>/<name>.json``, ``<out>/<name>.md``
       and (a, b, d, f, g, h, i) ``<out>/<name>.png``. (d)–(i) run quick sizes unless ``--full``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from mp_grpo.train.mismatch_lab import is_correction, nan_guard, normalizer, report


def _run_a(args: argparse.Namespace) -> tuple[dict, str]:
    result = is_correction.run()
    return result, report.is_correction_table(result)


def _run_b(args: argparse.Namespace) -> tuple[dict, str]:
    result = normalizer.run()
    return result, report.normalizer_table(result)


def _run_c(args: argparse.Namespace) -> tuple[dict, str]:
    result = nan_guard.run()
    return result, report.nan_guard_table(result)


def _run_d(args: argparse.Namespace) -> tuple[dict, str] | None:
    from mp_grpo.train.mismatch_lab import training
    setup = training.TrainingSetup() if args.full else training.QUICK
    if args.training_steps is not None:
        setup = dataclasses.replace(setup, steps=args.training_steps)
    if args.training_variants is not None:
        unknown = sorted(set(args.training_variants) - set(training.VARIANTS))
        if unknown:
            raise SystemExit(f"--training-variants: unknown {unknown}; allowed: {sorted(training.VARIANTS)}")
        setup = dataclasses.replace(setup, variants=tuple(args.training_variants))
    result = training.run(setup)
    return None if result is None else (result, training.report(result))


def _run_e(args: argparse.Namespace) -> tuple[dict, str]:
    from mp_grpo.train.mismatch_lab import top_p_replay
    result = top_p_replay.run(top_p_replay.TopPReplaySetup() if args.full else top_p_replay.QUICK)
    return result, top_p_replay.table(result)


def _run_f(args: argparse.Namespace) -> tuple[dict, str]:
    from mp_grpo.train.mismatch_lab import top_p_loop
    result = top_p_loop.run(top_p_loop.TopPLoopSetup() if args.full else top_p_loop.QUICK)
    return result, top_p_loop.report(result)


def _run_g(args: argparse.Namespace) -> tuple[dict, str]:
    from mp_grpo.train.mismatch_lab import pairing
    result = pairing.run(pairing.PairingSetup() if args.full else pairing.QUICK)
    return result, pairing.report(result)


def _run_h(args: argparse.Namespace) -> tuple[dict, str]:
    from mp_grpo.train.mismatch_lab import support_replay
    result = support_replay.run(support_replay.SupportReplaySetup() if args.full else support_replay.QUICK)
    return result, support_replay.report(result)


def _run_i(args: argparse.Namespace) -> tuple[dict, str]:
    from mp_grpo.train.mismatch_lab import trust_region_loop
    result = trust_region_loop.run(trust_region_loop.TrustRegionLoopSetup() if args.full else trust_region_loop.QUICK)
    return result, trust_region_loop.report(result)


def _plot_i(result: dict, path: Path) -> None:
    from mp_grpo.train.mismatch_lab import trust_region_loop
    trust_region_loop.plot(result, path)


def _plot_h(result: dict, path: Path) -> None:
    from mp_grpo.train.mismatch_lab import support_replay
    support_replay.plot(result, path)


def _plot_g(result: dict, path: Path) -> None:
    from mp_grpo.train.mismatch_lab import pairing
    pairing.plot(result, path)


def _plot_f(result: dict, path: Path) -> None:
    from mp_grpo.train.mismatch_lab import top_p_loop
    top_p_loop.plot(result, path)


def _plot_d(result: dict, path: Path) -> None:
    from mp_grpo.train.mismatch_lab import training
    training.plot(result, path)


EXPERIMENTS = {"a": ("is_correction", _run_a, report.plot_is_correction),
               "b": ("normalizer", _run_b, report.plot_normalizer),
               "c": ("nan_guard", _run_c, None),
               "d": ("training", _run_d, _plot_d),
               "e": ("top_p_replay", _run_e, None),
               "f": ("top_p_loop", _run_f, _plot_f),
               "g": ("pairing", _run_g, _plot_g),
               "h": ("support_replay", _run_h, _plot_h),
               "i": ("trust_region_loop", _run_i, _plot_i)}
"""Letter → (output name, runner, plotter or None)."""


def main(argv: list[str] | None = None) -> int:
    # --- 1. arguments ---
    parser = argparse.ArgumentParser(prog="python -m mp_grpo.train.mismatch_lab", description=__doc__.splitlines()[0])
    parser.add_argument("--experiments", nargs="+", choices=sorted(EXPERIMENTS), default=sorted(EXPERIMENTS),
                        help="which experiments to run (default: all)")
    parser.add_argument("--out", type=Path, default=Path("docs/mismatch"), help="output folder")
    parser.add_argument("--full", action="store_true",
                        help="(d)–(i): the documented sizes (default: quick runs of a few minutes)")
    parser.add_argument("--training-steps", type=int, default=None, help="(d): optimizer steps per run")
    parser.add_argument("--training-variants", nargs="+", default=None, help="(d): variant names (default: all)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    # --- 2. experiments ---
    for letter in args.experiments:
        name, runner, plotter = EXPERIMENTS[letter]
        start = time.perf_counter()
        out = runner(args)
        if out is None:
            print(f"({letter}) {name}: skipped (see the message above)", flush=True)
            continue
        result, table = out
        result["seconds"] = round(time.perf_counter() - start, 1)
        result["command"] = "python -m mp_grpo.train.mismatch_lab " + " ".join(sys.argv[1:] if argv is None else argv)
        report.write_json(result, args.out / f"{name}.json")
        (args.out / f"{name}.md").write_text(table + "\n")
        if plotter is not None:
            plotter(result, args.out / f"{name}.png")
        print(f"\n({letter}) {name} — {result['seconds']} s, written to {args.out}/{name}.*\n{table}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
