"""Megatron's bf16 optimizer contract on CPU: fp32 main parameters behind a bf16 model.

Under ``model.params_dtype = bf16`` Megatron trains ``Float16Module``'s bf16 parameters through
``Float16OptimizerWithFloat16Params``: Megatron DDP sums every gradient into an fp32 ``main_grad``, the optimizer
keeps an fp32 copy of every parameter (its "main" parameters), steps those and copies them back into the bf16
model. :class:`CpuMixedPrecisionAdam` is that contract with ``torch.optim.Adam`` on CPU, for the CPU stand-in in
bf16 (:class:`~mp_grpo.train.cpu_ddp.CpuDistributedDataParallel` with ``main_grad=True`` gives the fp32 gradients).

Schedule of :meth:`CpuMixedPrecisionAdam.step` (after the caller's gradient clipping, which scales ``main_grad``)

1. Each main parameter's gradient is its model parameter's ``main_grad`` (fp32, reduced over DP×CP).
2. Adam steps the fp32 main parameters.
3. Each model parameter is its main parameter rounded to the model's dtype (as Megatron's
   ``_copy_main_params_to_model_params``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class CpuMixedPrecisionAdam:
    """Adam on fp32 copies of a bf16 model's parameters; see the module docstring."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float) -> None:
        """``params``: the model's trainable parameters, each with an fp32 ``main_grad`` (Megatron DDP's buffer)."""
        self.params = [p for p in params if p.requires_grad]
        for p in self.params:
            if not isinstance(getattr(p, "main_grad", None), torch.Tensor) or p.main_grad.dtype != torch.float32:
                raise ValueError("CpuMixedPrecisionAdam: every parameter needs an fp32 main_grad "
                                 "(CpuDistributedDataParallel(..., main_grad=True))")
        # Megatron's main parameters: the model's values upcast (exact), not re-drawn.
        self.main = [p.detach().float().clone() for p in self.params]
        self.adam = torch.optim.Adam(self.main, lr=lr)

    def zero_grad(self) -> None:
        for m in self.main:
            m.grad = None

    @torch.no_grad()
    def step(self) -> None:
        # --- 1. gradients ---
        for p, m in zip(self.params, self.main):
            m.grad = p.main_grad
        # --- 2. the fp32 step ---
        self.adam.step()
        # --- 3. back into the model, rounded to its dtype ---
        for p, m in zip(self.params, self.main):
            p.copy_(m)
