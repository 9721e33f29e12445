"""Megatron-LM's source tree for the launcher and the tests: where it is, how it is imported, its own argument parser.

The launcher runs Megatron-LM from a source tree (``megatron/`` and the entry files of one commit: core, training
and rl agree), not from the megatron-core wheel. The tree is named by ``MP_GRPO_MEGATRON_LM_SRC``.

:func:`parse_megatron_args` is ``train_rl.py``'s own parse: Megatron-LM's ``parse_args`` with
``add_inference_args`` (``train_rl.py``'s ``extra_args_provider``) on an argv, then, with ``validate=True``, its
``validate_args`` — which maps the dtype arguments to torch dtypes (``args.logit_dtype``: ``"fp32"`` →
``torch.float32``). Both run on a CPU-only machine.

Run as a script it writes the namespaces of several argvs to a pickle (the tests call it in a subprocess, so that
the source tree's ``megatron`` never meets the megatron-core installed in the test's own interpreter)::

    python scripts/megatron_lm_rl/mlm_source.py OUT.pkl '{"name": ["--flag", ...], ...}'
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import sys
import typing
from pathlib import Path

import torch

MEGATRON_LM_SRC_ENV = "MP_GRPO_MEGATRON_LM_SRC"
"""The environment variable naming Megatron-LM's source tree (a checkout, or ``git archive`` of one)."""
ENTRY = "train_rl.py"
"""Megatron-LM's RL entry point, whose ``__main__`` the launcher follows."""
PICKLED_TYPES = (type(None), bool, int, float, str, torch.dtype)
"""The argument values a namespace keeps when pickled for the tests (every argument the forward step reads is one
of these; Megatron-LM's enums and callables would need its package to unpickle)."""


def megatron_lm_src() -> Path | None:
    """The tree ``MP_GRPO_MEGATRON_LM_SRC`` names, or None when unset; an error naming the variable when it is set to
    something that is not a Megatron-LM tree."""
    src = os.environ.get(MEGATRON_LM_SRC_ENV)
    if not src:
        return None
    path = Path(src).resolve()
    if not (path / ENTRY).is_file() or not (path / "megatron" / "rl").is_dir():
        raise FileNotFoundError(f"{MEGATRON_LM_SRC_ENV}={src}: no {ENTRY} and megatron/rl/ there (expected the root "
                                "of a Megatron-LM source tree)")
    return path


def use_source(src: Path) -> None:
    """Import Megatron-LM from ``src``: the tree first on ``sys.path``. Megatron-LM's training package needs Python
    3.12 for one name only, ``typing.override`` (a decorator that marks a method and changes nothing at run time);
    on an older Python (this CPU machine's 3.11) it is given typing_extensions' identical one."""
    loaded = sys.modules.get("megatron")
    if loaded is not None and not any(str(p).startswith(str(src)) for p in loaded.__path__):
        raise RuntimeError(f"megatron is already imported from {list(loaded.__path__)}, not from {src}: import "
                           "Megatron-LM's tree before anything imports megatron-core")
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]


def parse_megatron_args(argv: list[str], *, validate: bool = True, quiet: bool = True) -> argparse.Namespace:
    """``train_rl.py``'s arguments for ``argv`` (without the program name) through Megatron-LM's own parser (module
    docstring). Megatron-LM's tree must be importable (:func:`use_source`). ``quiet`` drops the table of every
    argument ``validate_args`` prints."""
    from megatron.inference.utils import add_inference_args
    from megatron.training.arguments import parse_args, validate_args

    saved = sys.argv
    sys.argv = [ENTRY, *argv]
    try:
        args = parse_args(extra_args_provider=add_inference_args)
        if validate:
            with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
                validate_args(args, {})
    finally:
        sys.argv = saved
    return args


def picklable(args: argparse.Namespace) -> dict:
    """The namespace's plain values (``PICKLED_TYPES``, lists / tuples of them)."""
    def plain(v) -> bool:
        return isinstance(v, PICKLED_TYPES) or (isinstance(v, (list, tuple)) and all(isinstance(x, PICKLED_TYPES)
                                                                                      for x in v))
    return {k: v for k, v in vars(args).items() if plain(v)}


def main(out: str, cases_json: str) -> None:
    src = megatron_lm_src()
    if src is None:
        raise SystemExit(f"{MEGATRON_LM_SRC_ENV} is not set")
    use_source(src)
    cases = json.loads(cases_json)
    result = {name: {"parsed": picklable(parse_megatron_args(argv, validate=False)),
                     "validated": picklable(parse_megatron_args(argv, validate=True))}
              for name, argv in cases.items()}
    with open(out, "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
