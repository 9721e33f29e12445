"""Megatron-LM's ``calculate_grpo_loss``, taken from its source, and Megatron-LM RL micro-batches built in the test.

``megatron/rl/rl_utils.py`` imports Megatron-LM's whole RL stack (inference engine, agents, wandb, tensorboard,
Transformer Engine, ``megatron.training``) and needs Python 3.12. The function itself is plain torch: the test
compiles only its definition from the file (``ast``), with ``torch`` in its globals and one stub —
``log_single_rank`` (a logging call on a shape mismatch, never reached here); the GPU benchmark takes
``selective_log_softmax`` the same way (stub: ``is_batch_invariant_mode_enabled`` → False). Its source: a checkout named by
``MP_GRPO_MEGATRON_LM_SRC``, or an importable ``megatron.rl``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from mp_grpo.integrations.megatron_rl import RLMicroBatch

SKIP_REASON = ("Megatron-LM's source is not available (set MP_GRPO_MEGATRON_LM_SRC to a checkout of NVIDIA/Megatron-LM): "
               "the parity tests against its calculate_grpo_loss are skipped")


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
