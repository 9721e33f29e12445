"""A NeMo-RL GRPO micro-batch data dict built in the test (NeMo-RL's layout, no NeMo-RL needed)."""

from __future__ import annotations

import importlib

import pytest
import torch

SKIP_REASON = ("NeMo-RL's source is not importable (set MP_GRPO_NEMO_RL_SRC to a checkout of NVIDIA-NeMo/RL with "
               "its loss module's imports installed): the parity tests against its ClippedPGLossFn are skipped")


def nemo_rl_or_skip():
    """``nemo_rl.algorithms.loss`` (and the modules the tests call), or skip the test saying why."""
    try:
        loss = importlib.import_module("nemo_rl.algorithms.loss")
        importlib.import_module("nemo_rl.distributed.batched_data_dict")
    except ImportError as err:  # the checkout or one of its imports is missing
        pytest.skip(f"{SKIP_REASON} ({err})")
    return loss


def data_dict(seed: int, lengths: list[int], prompt: list[int], S: int, *, sample_mask: list[float] | None = None,
              dtype: torch.dtype = torch.float32, vocab: int = 11, far: bool = False) -> dict[str, torch.Tensor]:
    """Row b: ``prompt[b]`` prompt tokens then completion tokens up to ``lengths[b]`` (token_mask 1 on the
    completion), padding after. Token-aligned ``[B, S]`` fields as NeMo-RL's GRPO data dict, advantages
    constant per row; ``far``: prev log-probs far from the current ones (|log-ratio| up to ~60)."""
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths)
    pos = torch.arange(S).unsqueeze(0)
    token_mask = ((pos >= torch.tensor(prompt).unsqueeze(1)) & (pos < torch.tensor(lengths).unsqueeze(1))).float()

    def rnd(scale=1.0):
        return torch.randn(B, S, generator=gen, dtype=torch.float64) * scale

    current = -rnd().abs() - 0.1
    prev = current + rnd(0.15) + (rnd(25.0) if far else 0.0)
    out = {
        "input_ids": torch.randint(0, vocab, (B, S), generator=gen),
        "token_mask": token_mask,
        "sample_mask": torch.tensor(sample_mask if sample_mask is not None else [1.0] * B),
        "advantages": torch.randn(B, 1, generator=gen, dtype=torch.float64).expand(B, S).clone(),
        "prev_logprobs": prev,
        "generation_logprobs": prev + rnd(0.1),
        "reference_policy_logprobs": current + rnd(0.3),
        "_current": current,  # the log-probs a test may feed as next_token_logprobs (shifted: [:, 1:])
    }
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in out.items()}


def global_counts(*micro_batches: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """NeMo-RL's ``global_valid_seqs`` and ``global_valid_toks`` of a step (``process_global_batch``)."""
    seqs = sum(mb["sample_mask"].sum() for mb in micro_batches)
    toks = sum((mb["token_mask"][:, 1:] * mb["sample_mask"].unsqueeze(-1)).sum() for mb in micro_batches)
    return torch.as_tensor(seqs, dtype=torch.float32), torch.as_tensor(toks, dtype=torch.float32)
