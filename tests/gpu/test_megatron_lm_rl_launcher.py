"""Megatron-LM's own RL loop on one GPU with mp_grpo's forward step: ``scripts/megatron_lm_rl/run.py`` for a few
steps (skipped without a CUDA GPU, without ``MP_GRPO_MEGATRON_LM_SRC`` or without Transformer Engine).

Run on the GPU machine after Transformer Engine (``../shared/tools/te_gpu_parts.sh``) and ``.mlm_carry/install.sh``::

    PYTHONPATH=$PYTHONPATH:/root/te/site:/root/mlm/site NVTE_FRAMEWORK=pytorch \\
    MP_GRPO_MEGATRON_LM_SRC=/root/mlm/megatron-lm python -m pytest tests/gpu/test_megatron_lm_rl_launcher.py -v -s

For each layout (packing off, on) the launcher runs ``STEPS`` GRPO steps of the real loop — rollouts from
Megatron-LM's dynamic inference engine behind its coordinator and text server, Megatron-LM's data iterator, its
schedule and optimizer, ``GRPOForwardStep.from_args`` with ``--output-logit-dtype fp32`` — and must write one reward
row per step and a passed loss-parity check (mp_grpo's loss and gradient against Megatron-LM's own on its first
micro-batch). ``pretrain`` ends the process with ``os._exit(0)``: the exit status and the files are the verdict.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from tests.gpu.launch import REPO_ROOT, gpu_run, torchrun_cmd

STEPS = 3
TIMEOUT_S = 900

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not os.environ.get("MP_GRPO_MEGATRON_LM_SRC"),
                       reason="Megatron-LM's source is not available (set MP_GRPO_MEGATRON_LM_SRC)"),
    pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                       reason="Transformer Engine is not installed (the run uses its layer spec)"),
]


@pytest.mark.parametrize("packing", [False, True])
def test_real_loop_runs_with_mp_grpo(packing: bool, tmp_path) -> None:
    out = tmp_path / "run"
    cmd = torchrun_cmd(1, str(REPO_ROOT / "scripts" / "megatron_lm_rl" / "run.py"), "--forward-step", "mp_grpo",
                       "--packing" if packing else "--no-packing", "--train-iters", str(STEPS), "--out", str(out))
    # TF32 as Megatron-LM runs it (the parity check compares two losses of the same run, not fp32 rounding)
    log = gpu_run(cmd, what=f"Megatron-LM's RL loop (packing {packing})", timeout=TIMEOUT_S, tf32_off=False)[-6000:]
    rows = [json.loads(line) for line in (out / "rewards.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(STEPS)), log
    assert all(r["n"] == 128 and 0.0 <= r["mean_reward"] <= 1.0 for r in rows)
    parity = json.loads((out / "parity.json").read_text())
    assert parity["passed"] and parity["logits_dtype"] == "float32" and parity["packed"] == packing, parity
