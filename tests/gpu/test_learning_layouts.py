"""The learning job in fp32 takes the same trajectory at TP = 1 and TP = 2 on GPUs (needs 2 CUDA GPUs; skipped
otherwise).

    NCCL_NVLS_ENABLE=0 python -m pytest tests/gpu/test_learning_layouts.py -v -s

The main job's GPU config (``--config gpu``: megatron-core GPTModel through ``forward_backward_func``, Megatron DDP
and Adam, a rollout engine that samples with its own copy of the weights, 256 sequences of 16 completion tokens a
step) with trainer and engine in fp32 (``model.params_dtype=fp32 engine.dtype=fp32``), the same seed, ``STEPS`` steps
at TP = 1 (one GPU) and at TP = 2 (two), through ``scripts/learning_layouts.py``'s launcher (both at once on a
machine with 3 GPUs or more). At every step both runs must sample the same completions (the digest of their token
ids; hence the same rewards), and their loss and gradient norm may differ only by fp32 reduction order — TP splits
the row-parallel layers' sums and the vocabulary's log-sum-exp over two GPUs —, compounded over the steps:
``TOL_LOSS_ABS`` and ``TOL_GRAD_NORM_REL``.

The sampler's noise is keyed by (seed, step, sequence, position, token id) and its TP merge is exact, so only a
near-tie could change a sampled token: two candidates whose noisy logits lie within that rounding (~1e-6) of each
other. On a mismatch the failure names the step and the number of tokens that differ. bf16 is not asserted: its
rounding (2⁻⁸ relative) moves the sampled tokens from the first steps, and the runs go apart
(``scripts/learning_layouts.py`` measures both dtypes; README).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

STEPS = 8
TOL_LOSS_ABS = 1e-5
"""fp32 reduction order on a loss that is a mean over the step's ~4096 trained tokens of terms of size ≲ 1."""
TOL_GRAD_NORM_REL = 1e-4
"""fp32 reduction order over the TP shards, compounded over ``STEPS`` Adam steps (a different sampled token changes
the gradient norm by ≳ 1e-4: one of ~4096 trained tokens and the advantages of its group)."""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fp32_learning_same_trajectory_at_tp1_and_tp2(tmp_path: Path) -> None:
    from learning_layouts import Run, _over_same_steps, compare, launch, overrides

    runs = [Run("fp32_tp2", 2, overrides("fp32", 2, STEPS)), Run("fp32_tp1", 1, overrides("fp32", 1, STEPS))]
    results = launch(runs, tmp_path, config="gpu", keep_completions=True)
    base, other = results["fp32_tp1"]["steps"], results["fp32_tp2"]["steps"]
    assert len(base) == len(other) == STEPS
    c = compare(base, other)
    print(f"\nfp32, TP = 2 vs TP = 1 over {STEPS} steps: the same completions for {c['same_completions_steps']} steps, "
          f"max |Δloss| = {_over_same_steps(c, 'max_abs_loss_difference', '.2e')}, max rel. Δ grad norm = "
          f"{_over_same_steps(c, 'max_rel_grad_norm_difference', '.2e')}; wall {results['fp32_tp1']['wall_s']} s (TP = 1), "
          f"{results['fp32_tp2']['wall_s']} s (TP = 2)")
    assert c["first_different_step"] is None, (
        f"step {c['first_different_step']}: TP = 2 sampled other completions than TP = 1 ({c['tokens_different']} "
        f"token ids differ; steps before it agreed: max rel. Δ grad norm "
        f"{_over_same_steps(c, 'max_rel_grad_norm_difference', '.2e')})")
    assert c["max_abs_reward_difference"] == 0.0
    assert c["max_abs_loss_difference"] <= TOL_LOSS_ABS, c
    assert c["max_rel_grad_norm_difference"] <= TOL_GRAD_NORM_REL, c
    # the run moves: a trajectory of a constant would agree trivially
    assert len({round(s["grad_norm"], 9) for s in base if s["grad_norm"] is not None}) > STEPS // 2
