"""Megatron-LM's ``calculate_grpo_loss``, taken from its source, and Megatron-LM RL micro-batches built in the test.

``megatron/rl/rl_utils.py`` imports Megatron-LM's whole RL stack (inference engine, agents, wandb, tensorboard,
Transformer Engine, ``megatron.training``) and needs Python 3.12. The function itself is plain torch: the test
compiles only its definition from the file (``ast``), with ``torch`` in its globals and one stub —
``log_single_rank`` (a logging call on a shape mismatch, never reached here); the GPU benchmark takes
``selective_log_softmax`` the same way (stub: ``is_batch_invariant_mode_enabled`` → False). Its source: a checkout named by
``MP_GRPO_MEGATRON_LM_SRC``, or an importable ``megatron.rl``.

The run's arguments come from Megatron-LM's own parser (:func:`megatron_lm_args`: ``parse_args`` with
``train_rl.py``'s ``add_inference_args``, then ``validate_args``, on the argvs of ``ARGV_CASES``), run once per test
session in a subprocess with the tree first on its path (``scripts/megatron_lm_rl/mlm_source.py``); skipped without
``MP_GRPO_MEGATRON_LM_SRC``.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mp_grpo.integrations.megatron_rl import RLMicroBatch
from tests.distributed import REPO_ROOT

SKIP_REASON = ("Megatron-LM's source is not available (set MP_GRPO_MEGATRON_LM_SRC to a checkout of NVIDIA/Megatron-LM): "
               "the parity tests against its calculate_grpo_loss are skipped")


PARSER_SKIP_REASON = ("Megatron-LM's source is not available (set MP_GRPO_MEGATRON_LM_SRC to a Megatron-LM source tree): "
                      "the tests through its own argument parser are skipped")
PARSER_SCRIPT = REPO_ROOT / "scripts" / "megatron_lm_rl" / "mlm_source.py"
PARSER_TIMEOUT_S = 300.0
"""The parser's subprocess imports Megatron-LM's training package (~5 s alone on 2 cores; more on a busy machine)."""
BASE_ARGV = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
             "--train-iters", "2", "--lr", "1e-4", "--bf16", "--perform-rl-step", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "64"]
"""The smallest ``train_rl.py`` command line Megatron-LM's ``validate_args`` accepts (the model is never built)."""
ARGV_CASES = {
    "defaults": [],
    "entropy_is_truncated": ["--grpo-clamp-eps-lower", "0.2", "--grpo-clamp-eps-upper", "0.28", "--grpo-kl-beta", "0.05",
                             "--grpo-entropy-term-weight", "0.01", "--rl-inference-logprobs-is-correction",
                             "--rl-importance-sampling-truncation-coef", "1.5", "--output-logit-dtype", "fp32",
                             "--rl-use-sequence-packing", "--calculate-per-token-loss"],
    "is_untruncated_no_kl": ["--grpo-clamp-eps-lower", "0.1", "--grpo-clamp-eps-upper", "0.1", "--grpo-kl-beta", "0.0",
                             "--rl-inference-logprobs-is-correction", "--output-logit-dtype", "bf16"],
}
"""Named argvs (after ``BASE_ARGV``): Megatron-LM's defaults, and two sets of the loss's and the logits' arguments."""


@functools.cache
def _parsed_cases() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "args.pkl"
        cases = {name: BASE_ARGV + argv for name, argv in ARGV_CASES.items()}
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run([sys.executable, str(PARSER_SCRIPT), str(out), json.dumps(cases)], env=env,
                              capture_output=True, text=True, timeout=PARSER_TIMEOUT_S, cwd=REPO_ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"Megatron-LM's parser failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return pickle.loads(out.read_bytes())


def megatron_lm_args(case: str, *, validated: bool = True) -> SimpleNamespace:
    """The namespace Megatron-LM's own parser gives for ``ARGV_CASES[case]`` (``validated``: after ``validate_args``,
    dtypes mapped to torch dtypes; else after ``parse_args`` alone, their string form) — or skip, saying why."""
    if not os.environ.get("MP_GRPO_MEGATRON_LM_SRC"):
        pytest.skip(PARSER_SKIP_REASON)
    return SimpleNamespace(**_parsed_cases()[case]["validated" if validated else "parsed"])


def rl_utils_path() -> Path | None:
    src = os.environ.get("MP_GRPO_MEGATRON_LM_SRC")
    if src:
        path = Path(src) / "megatron" / "rl" / "rl_utils.py"
        return path if path.is_file() else None
    spec = importlib.util.find_spec("megatron.rl")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "rl_utils.py"
    return path if path.is_file() else None


def megatron_lm_functions(path: Path, names: tuple[str, ...]) -> dict:
    """Functions of ``megatron/rl/rl_utils.py`` compiled alone from its source, with ``torch`` in their globals and
    two stubs: ``log_single_rank`` (a warning on a shape mismatch) and ``is_batch_invariant_mode_enabled`` (False:
    Megatron-LM's default, no batch-invariant kernels)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in nodes}
    if missing:
        raise LookupError(f"{path} has no {sorted(missing)}")
    namespace = {"torch": torch, "logging": __import__("logging"), "logger": None,
                 "log_single_rank": lambda *args, **kwargs: None, "is_batch_invariant_mode_enabled": lambda: False}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)
    return {name: namespace[name] for name in names}


def calculate_grpo_loss_or_skip():
    """Megatron-LM's ``calculate_grpo_loss`` compiled from its source, or skip the test saying why."""
    path = rl_utils_path()
    if path is None:
        pytest.skip(SKIP_REASON)
    return megatron_lm_functions(path, ("calculate_grpo_loss",))["calculate_grpo_loss"]


def unpacked(seed: int, B: int, S: int, *, vocab: int = 13, far: bool = False, with_inference: bool = True,
             dtype=torch.float64) -> tuple[RLMicroBatch, torch.Tensor]:
    """Padded rows as Megatron-LM's unpacked iterator gives them, and current log-probs ``[B, S-1]``."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, S), generator=gen)
    prompt = torch.randint(1, S // 2, (B,), generator=gen)
    length = torch.randint(S // 2, S + 1, (B,), generator=gen)
    pos = torch.arange(S).unsqueeze(0)
    mask = ((pos >= prompt.unsqueeze(1)) & (pos < length.unsqueeze(1)))[:, 1:].to(dtype)
    current = -torch.rand(B, S - 1, generator=gen, dtype=torch.float64) * 3 - 0.05
    old = current + torch.randn(B, S - 1, generator=gen, dtype=torch.float64) * (3.0 if far else 0.05)
    ref = current + torch.randn(B, S - 1, generator=gen, dtype=torch.float64) * 0.3
    inference = old + torch.randn(B, S - 1, generator=gen, dtype=torch.float64) * 0.2
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    mb = RLMicroBatch(tokens, pos.expand(B, S).clone(), adv.to(dtype), mask, old.to(dtype), ref.to(dtype),
                      inference.to(dtype) if with_inference else None)
    return mb, current.to(dtype)


def packed_bin(seed: int, lengths: list[int], slot_multiple: int, bin_size: int, *, vocab: int = 13,
               dtype=torch.float64) -> tuple[RLMicroBatch, torch.Tensor]:
    """One packed bin: sequences at ``slot_multiple``-aligned starts (Megatron-LM's packer), padding after."""
    gen = torch.Generator().manual_seed(seed)
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += -(-n // slot_multiple) * slot_multiple
    assert at <= bin_size
    tokens = torch.randint(0, vocab, (1, bin_size), generator=gen)
    full_mask = torch.zeros(1, bin_size, dtype=torch.bool)
    for s, n in zip(starts, lengths):
        prompt = int(torch.randint(1, max(2, n // 2), (1,), generator=gen))
        full_mask[0, s + prompt:s + n] = True
    current = -torch.rand(1, bin_size - 1, generator=gen, dtype=torch.float64) * 3 - 0.05
    old = current + torch.randn(1, bin_size - 1, generator=gen, dtype=torch.float64) * 0.05
    ref = current + torch.randn(1, bin_size - 1, generator=gen, dtype=torch.float64) * 0.3
    inference = old + torch.randn(1, bin_size - 1, generator=gen, dtype=torch.float64) * 0.2
    adv = torch.randn(len(lengths), generator=gen, dtype=torch.float64)
    mb = RLMicroBatch(tokens, torch.arange(bin_size).unsqueeze(0), adv.to(dtype), full_mask[:, 1:].to(dtype),
                      old.to(dtype), ref.to(dtype), inference.to(dtype), seq_starts=tuple(starts) + (at,),
                      seq_lengths=tuple(lengths))
    return mb, current.to(dtype)
