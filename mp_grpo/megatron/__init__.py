"""Thin adapter between mp_grpo's loss and Megatron-core's training loop (``forward_backward_func``).

- :mod:`.loss_func`: :class:`MegatronGRPO` — the step's GlobalBatch, ``forward_step_func`` and ``loss_func``,
  on the logits or the fused output path (:class:`~mp_grpo.config.job.OutputPath`), on every row or the loss rows
  alone (:class:`~mp_grpo.config.job.OutputRows`).
- :mod:`.output_checks`: the model output checked against the micro-batch, once (``loss_func``'s step 1).
- :mod:`.output_rows`: the model output of the loss rows alone, the ops' inputs from it, their results scattered back.
- :mod:`.fused_output`: GPTModel's final hidden states and output weight instead of its logits (fused path).
- :mod:`.logits_output`: GPTModel's logits written batch-major (logits path).
- :mod:`.main_grad`: whether those paths add the output weight's gradient straight into DDP's ``main_grad``.
- :mod:`.scaling`: :class:`MegatronScaling` — what to return so Megatron's own scaling gives the exact gradient.
- :mod:`.rollouts`, :mod:`.micro_batch`: token-aligned rollout fields → this rank's shifted, packed, CP-split micro-batch.
- :mod:`.context_parallel`, :mod:`.packed`: Megatron's 2·CP chunk layout and THD packing.
- :mod:`.groups`: the process groups (from ``megatron.core.parallel_state`` unless given).

The CPU stand-ins (model, DDP, schedule) and the main job live in :mod:`mp_grpo.train`.
"""

from mp_grpo.config.job import OutputPath, OutputRows
from mp_grpo.megatron.groups import ParallelGroups
from mp_grpo.megatron.loss_func import MegatronGRPO
from mp_grpo.megatron.micro_batch import IGNORE_INDEX, MicroBatch, prepare_micro_batch
from mp_grpo.megatron.rollouts import Rollouts
from mp_grpo.megatron.scaling import MegatronScaling

__all__ = [
    "IGNORE_INDEX",
    "MegatronGRPO",
    "MegatronScaling",
    "MicroBatch",
    "OutputPath",
    "OutputRows",
    "ParallelGroups",
    "Rollouts",
    "prepare_micro_batch",
]
