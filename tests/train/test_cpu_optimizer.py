"""Megatron's bf16 optimizer contract on CPU (mp_grpo/train/cpu_optimizer.py): fp32 main parameters behind bf16 ones."""

from __future__ import annotations

import pytest
import torch

from mp_grpo.train.cpu_optimizer import CpuMixedPrecisionAdam


def _bf16_params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=gen).bfloat16()), torch.nn.Parameter(torch.randn(4, generator=gen).bfloat16())]
    for p in params:
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    return params


def test_steps_fp32_main_parameters_and_rounds_them_into_the_model() -> None:
    params = _bf16_params(0)
    opt = CpuMixedPrecisionAdam(params, lr=1e-2)
    reference = [p.detach().float().clone().requires_grad_(True) for p in params]  # Adam on fp32 copies
    ref_opt = torch.optim.Adam(reference, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, r in zip(params, reference):
            p.main_grad.copy_(torch.randn(p.shape, generator=gen))
            r.grad = p.main_grad.clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        for p, m, r in zip(params, opt.main, reference):
            assert torch.equal(m, r.detach())  # the same fp32 arithmetic
            assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), m.bfloat16())
    # three steps of 1e-2 move the fp32 main parameters by less than most bf16 steps: the model lags, the main ones do not
    assert any(not torch.equal(m, p.detach().float()) for p, m in zip(params, opt.main))


def test_needs_fp32_main_grad() -> None:
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="main_grad"):
        CpuMixedPrecisionAdam([p], lr=1e-3)
