"""CpuDistributedDataParallel (mp_grpo/train/cpu_ddp.py) on one rank.

Its reduction over several ranks (both average_in_collective settings, with and without per-token loss) is
exercised under torchrun by test_loss_func.py.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.distributed import DistributedDataParallelConfig

from mp_grpo.train.cpu_ddp import CpuDistributedDataParallel
from mp_grpo.train.cpu_model import cpu_model_config


def test_single_rank_sync_and_scaling() -> None:
    config = cpu_model_config(hidden_size=4)
    module = torch.nn.Linear(2, 2)
    ddp = CpuDistributedDataParallel(config, DistributedDataParallelConfig(), module, dp_cp_group=None)
    assert ddp.gradient_scaling_factor == 1.0  # 1/|DP×CP| with |DP×CP| = 1
    module(torch.ones(1, 2)).sum().backward()
    before = module.weight.grad.clone()
    ddp.finish_grad_sync()
    ddp.scale_gradients(0.5)
    torch.testing.assert_close(module.weight.grad, before * 0.5)
    ddp.zero_grad_buffer()
    assert module.weight.grad is None


def test_per_token_loss_cannot_average_in_collective() -> None:
    config = cpu_model_config(hidden_size=4, calculate_per_token_loss=True)
    with pytest.raises(ValueError, match="average_in_collective"):
        CpuDistributedDataParallel(config, DistributedDataParallelConfig(average_in_collective=True),
                                   torch.nn.Linear(2, 2), dp_cp_group=None)
