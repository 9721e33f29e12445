"""NeMo-RL's asynchronous trainer (split API) on a GPU: the logit input takes the fused path there (the loss's backward
inside the log-prob kernel, the step's account read by the kernels), so the placeholder call's raw sums are the
kernels' with N = S = 1. The split-API step (placeholder counts, NeMo-RL's rescale: tests/integrations/nemo_rl/
split_api.py) against the synchronous step on the same device: loss, each micro-batch's gradient and every metric,
fp32 logits to fp32 rounding and bf16 logits to bf16 rounding. Skipped without CUDA (the CPU runs the torch path:
tests/integrations/nemo_rl/test_split_api.py)."""

from __future__ import annotations

import pytest
import torch

from mp_grpo.integrations.nemo_rl import InputType, MPGRPOLossFn
from mp_grpo.megatron.groups import ParallelGroups
from tests.integrations.nemo_rl.helpers import global_counts
from tests.integrations.nemo_rl.split_api import rescale
from tests.integrations.nemo_rl.test_split_api import EMPTY_SEQS, _logits, _step, compare, split_api, synchronous

CASES = {
    "nemo_rl_grpo": ("nemo_rl_grpo", []),
    "nemo_rl_grpo_entropy_bonus": ("nemo_rl_grpo", ["entropy.bonus_coef=0.01"]),
    "trl_grpo": ("trl_grpo", []),
    "gspo": ("gspo", EMPTY_SEQS),
    "trl_dr_grpo": ("trl_dr_grpo", []),
}


def run_case(case: str, dtype: torch.dtype, device: str) -> None:
    preset, overrides = CASES[case]
    mbs = [{k: v.to(device) for k, v in mb.items()} for mb in _step(torch.float32)]
    logits = [x.to(device) for x in _logits(mbs, dtype, vocab=512)]
    for mb in mbs:
        mb["input_ids"] = mb["input_ids"] * 37 % 512  # spread over the larger vocabulary
    seqs, toks = (c.to(device) for c in global_counts(*mbs))
    loss_fn = MPGRPOLossFn(preset, overrides=overrides, input_type=InputType.LOGIT, groups=ParallelGroups())
    sync = synchronous(loss_fn, mbs, seqs, toks, logits)
    split = split_api(loss_fn, mbs, logits, rescale_fn=rescale)
    compare(sync, split, loss_fn.metric_normalizations, float(toks), dtype, f"{case} {dtype} on {device}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the fused logit path runs on a GPU only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_split_api_fused_logit_path(case: str, dtype: torch.dtype) -> None:
    run_case(case, dtype, "cuda")
