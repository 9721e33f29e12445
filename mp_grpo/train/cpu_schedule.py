"""Megatron's no-pipelining schedule on CPU, built from megatron-core's own step functions.

``forward_backward_no_pipelining`` (megatron-core 0.16) allocates its token counter on CUDA, so it
cannot run on a CPU machine. :func:`forward_backward_cpu` is its loop with the counter on CPU; every
step that touches the loss or the gradients is megatron-core's own function, so the loss contract
is exactly the one a GPU run gets:

1. For each micro-batch (all but the last under ``model.no_sync()``): megatron-core's
   ``schedules.forward_step`` — calls ``forward_step_func``, then the returned loss function, and
   applies the schedule's scaling (2-tuple: ×CP/M; 3-tuple: token count collected) — then
   ``schedules.backward_step``.
2. ``config.finalize_model_grads_func`` (megatron-core's ``finalize_model_grads``) with the summed
   token count when ``config.calculate_per_token_loss``: DDP reduction over DP×CP (through
   :class:`~mp_grpo.train.cpu_ddp.CpuDistributedDataParallel`), sequence-parallel parameter
   all-reduce over TP, division by the global token count.

Pipeline parallelism is not covered (p2p communication needs CUDA); the model is one stage.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator

import torch
from megatron.core.pipeline_parallel.schedules import backward_step, forward_step
from megatron.core.utils import get_model_config, get_model_type

from mp_grpo.megatron.groups import ParallelGroups

_BACKWARD_TAKES_MODEL_TYPE = "model_type" in inspect.signature(backward_step).parameters
"""Older megatron-core: ``backward_step(input, output, output_grad, model_type, config)``; 0.19 (and later)
dropped ``model_type``."""


def forward_backward_cpu(
    *,
    forward_step_func: Callable,
    data_iterator: Iterator,
    model: torch.nn.Module,
    num_microbatches: int,
    groups: ParallelGroups,
    forward_only: bool = False,
) -> list:
    """The loss-relevant part of ``forward_backward_no_pipelining`` on CPU; returns the ``loss_reduced`` list."""
    config = get_model_config(model)
    model_type = get_model_type(model)
    forward_data_store: list = []
    total_num_tokens = torch.zeros([], dtype=torch.int)

    def one_micro_batch(i: int) -> None:
        nonlocal total_num_tokens
        output_tensor, num_tokens = forward_step(
            forward_step_func,
            data_iterator,
            model,
            num_microbatches,
            None,
            forward_data_store,
            config,
            groups.cp_size,
            is_first_microbatch=i == 0,
            current_microbatch=i,
            is_last_stage=True,
        )
        total_num_tokens += num_tokens
        if not forward_only:
            if _BACKWARD_TAKES_MODEL_TYPE:
                backward_step(None, output_tensor, None, model_type, config)
            else:
                backward_step(None, output_tensor, None, config)

    # --- 1. micro-batches: forward, loss scaling, backward ---
    with model.no_sync():
        for i in range(num_microbatches - 1):
            one_micro_batch(i)
    one_micro_batch(num_microbatches - 1)

    # --- 2. finalize: DDP reduction, SP all-reduce, per-token division ---
    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func(
            [model], total_num_tokens if config.calculate_per_token_loss else None, pg_collection=_pg_collection(groups)
        )
    return forward_data_store


def _pg_collection(groups: ParallelGroups):
    """The ``ProcessGroupCollection`` finalize_model_grads expects (no embedding groups: one stage)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection()
    pgs.tp = groups.tp
    pgs.pp = groups.pp
    pgs.embd = None
    pgs.pos_embd = None
    pgs.dp_cp = groups.dp_cp
    return pgs
