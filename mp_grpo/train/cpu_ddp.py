"""Megatron DDP's gradient contract on CPU (its ``DistributedDataParallel`` allocates CUDA buffers).

:class:`CpuDistributedDataParallel` wraps a module like ``megatron.core.distributed.
DistributedDataParallel`` and offers the methods ``finalize_model_grads`` and the schedule call
(``no_sync``, ``finish_grad_sync``, ``scale_gradients``, ``zero_grad_buffer``, ``ddp_config``,
``config``). Gradients stay in ``param.grad`` (``finalize_model_grads`` reads ``grad`` when a
parameter has no ``main_grad``) and are reduced once, synchronously, in ``finish_grad_sync``.

With ``main_grad=True`` they are kept as Megatron's DDP keeps them instead: every parameter gets an
fp32 ``main_grad`` (zeroed by ``zero_grad_buffer``) and the flag ``grad_added_to_main_grad``; after
each backward a hook adds ``param.grad`` into ``main_grad`` and drops it — unless a layer with
gradient-accumulation fusion already wrote its gradient into ``main_grad`` and set the flag, and the
parameter has no ``zero_out_wgrad`` (the hook of ``DistributedDataParallel._make_backward_post_hook``). Reduction and scaling then act on ``main_grad``.

The reduction is Megatron's, step for step (``DistributedDataParallel.__init__`` and
``_ParamAndGradBucketGroup.start_grad_sync`` in megatron-core 0.16):

1. Pre-scale by ``gradient_scaling_factor``: 1 with ``calculate_per_token_loss`` or
   ``average_in_collective``, else 1/|DP×CP|.
2. All-reduce over the DP×CP group with ``ReduceOp.AVG`` when ``average_in_collective``, else ``SUM``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig

from mp_grpo.collectives import ProcessGroup, group_size


class CpuDistributedDataParallel(torch.nn.Module):
    """See the module docstring; ``dp_cp_group`` is the group Megatron's DDP would reduce over."""

    def __init__(
        self,
        config: TransformerConfig,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        *,
        dp_cp_group: ProcessGroup | None,
        main_grad: bool = False,
    ) -> None:
        super().__init__()
        if config.calculate_per_token_loss and ddp_config.average_in_collective:
            # Megatron asserts the same: the per-token division happens once, in finalize_model_grads.
            raise ValueError("ddp_config.average_in_collective must be False with config.calculate_per_token_loss")
        self.config = config
        self.ddp_config = ddp_config
        self.module = module
        self.dp_cp_group = dp_cp_group
        world = group_size(dp_cp_group)
        if config.calculate_per_token_loss or ddp_config.average_in_collective:
            self.gradient_scaling_factor = 1.0
        else:
            self.gradient_scaling_factor = 1.0 / world
        self.main_grad = main_grad
        if main_grad:
            for param in self._params():
                param.main_grad = torch.zeros(param.shape, dtype=torch.float32)
                param.grad_added_to_main_grad = False
                param.register_post_accumulate_grad_hook(_move_grad_to_main_grad)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients are reduced only in :meth:`finish_grad_sync`; nothing to turn off."""
        yield

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def _grads(self) -> list[torch.Tensor]:
        if self.main_grad:
            return [p.main_grad for p in self._params()]
        return [p.grad for p in self._params() if p.grad is not None]

    @torch.no_grad()
    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Reduce the gradients over DP×CP as Megatron's DDP does (``force_all_reduce`` changes nothing here)."""
        for grad in self._grads():
            # --- 1. pre-scale ---
            if self.gradient_scaling_factor != 1.0:
                grad.mul_(self.gradient_scaling_factor)
            # --- 2. all-reduce ---
            if group_size(self.dp_cp_group) > 1:
                op = dist.ReduceOp.AVG if self.ddp_config.average_in_collective else dist.ReduceOp.SUM
                dist.all_reduce(grad, op=op, group=self.dp_cp_group)

    @torch.no_grad()
    def scale_gradients(self, scaling_factor: float) -> None:
        for grad in self._grads():
            grad.mul_(scaling_factor)

    def zero_grad_buffer(self) -> None:
        for param in self.module.parameters():
            param.grad = None
            if self.main_grad and param.requires_grad:
                param.main_grad.zero_()
                param.grad_added_to_main_grad = False


def _move_grad_to_main_grad(param: torch.nn.Parameter) -> None:
    """Megatron DDP's backward post-hook: ``grad`` into ``main_grad`` unless a fused layer put it there already
    — or also then, under ``param.zero_out_wgrad`` (GPTModel sets it on a weight shared by the embedding and the
    output layer: the fused layer returned zeros, to which autograd added the embedding lookup's gradient)."""
    if param.grad is not None and (not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False)):
        param.main_grad.add_(param.grad)
    param.grad = None
