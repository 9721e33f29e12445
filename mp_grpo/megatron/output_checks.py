"""Step 1 of :meth:`MegatronGRPO.loss_func <mp_grpo.megatron.loss_func.MegatronGRPO.loss_func>`: the model output
checked against the micro-batch, once (the log-prob ops called after it are their unchecked entries).

- :func:`checked_output`: the logits (``OutputPath.LOGITS``), or the final hidden states and the output layer's
  weight (``OutputPath.FUSED``), cover the micro-batch's positions (or, ``OutputRows.LOSS``, its loss rows alone), on a device the kernels run on, with
  ``V_local · TP`` = the model's (padded) vocabulary — a TP group that does not match the model's vocabulary
  shards fails here, before any collective.
- :func:`check_output_shape`: the one check of the micro-batch's targets against the model output.
"""

from __future__ import annotations

import torch

from mp_grpo.config.job import OutputPath
from mp_grpo.megatron.fused_output import OutputWeight
from mp_grpo.megatron.micro_batch import MicroBatch
from mp_grpo.ops.checks import check_hidden_and_weight, check_logits, check_runs_here
from mp_grpo.ops.loss_rows import LossRows


def checked_output(
    output_path: OutputPath,
    output_tensor: torch.Tensor,
    mb: MicroBatch,
    output_weight: OutputWeight | None,
    vocab_size: int | None,
    tp_size: int,
    rows: LossRows | None = None,
) -> torch.Tensor:
    """The tensor the log-prob op reads: the logits, or the hidden states in the output weight's dtype.

    Checks the model output against the micro-batch on ``output_path`` (see the module docstring); the micro-batch's
    sampling filter was checked when it was set (:meth:`MicroBatch.with_sampling_filter`). With ``rows`` (the loss
    rows the model was asked to compute, ``OutputRows.LOSS``) the output may cover those rows alone, ``[1, K, ...]``."""
    if output_path == OutputPath.FUSED:
        x = checked_hidden_states(output_tensor, mb, output_weight, rows)
        weight = output_weight.weight  # type: ignore[union-attr]
        check_hidden_and_weight(x, weight)
        check_runs_here(x, "hidden")
        v_local, what = weight.shape[0], "output layer's weight holds"
    else:
        if output_weight is not None:
            raise ValueError("output_weight is only used with output_path=OutputPath.FUSED; the logits path reads the logits")
        check_output_shape(output_tensor, mb, "vocab-parallel logits", "V_local",
                           "GPTModel with parallel_output=True, labels=None", rows)
        x = output_tensor
        check_logits(x)
        check_runs_here(x, "logits")
        v_local, what = x.shape[-1], "logits hold"
    check_vocab_shards(v_local, what, vocab_size, tp_size)
    return x


def check_vocab_shards(v_local: int, what: str, vocab_size: int | None, tp_size: int) -> None:
    """``V_local · TP`` must be the model's (padded) vocabulary (not checked when ``vocab_size`` is None)."""
    if vocab_size is not None and v_local * tp_size != vocab_size:
        raise ValueError(
            f"tp_group: the {what} {v_local} vocabulary ids on each of {tp_size} tensor-parallel ranks "
            f"({v_local * tp_size} in all) but the model's vocabulary has {vocab_size}: the TP group does "
            "not match the model's vocabulary shards"
        )


def checked_hidden_states(
    output_tensor: torch.Tensor, mb: MicroBatch, output_weight: OutputWeight | None, rows: LossRows | None = None
) -> torch.Tensor:
    """The fused path: ``output_tensor`` as ``[*targets, H]`` hidden states in the weight's dtype."""
    if not isinstance(output_weight, OutputWeight):
        raise ValueError(
            "output_weight: output_path=OutputPath.FUSED needs the output layer's weight that call_model returns "
            f"with the hidden states, got {type(output_weight).__name__} (a model without an output_layer, "
            "e.g. not the last pipeline stage?)"
        )
    check_output_shape(output_tensor, mb, "the final hidden states", "H",
                       "GPTModel called through MegatronGRPO.call_model with output_path=fused", rows)
    weight = output_weight.weight
    if output_tensor.dtype == torch.float32 and weight.dtype in (torch.bfloat16, torch.float16):
        # Float16Module upcasts the last stage's output unless called with fp32_output=False; the
        # hidden states were computed in the weight's dtype, so casting back is exact (pass
        # model_kwargs={"fp32_output": False} to save the two copies).
        return output_tensor.to(weight.dtype)
    return output_tensor


def check_output_shape(
    output: torch.Tensor, mb: MicroBatch, what: str, last: str, source: str, rows: LossRows | None = None
) -> None:
    """``output`` must be ``[*mb.targets.shape, last]`` — or, with ``rows``, ``[1, K, last]`` (the loss rows alone) —
    on the device of ``mb.targets`` (integer token ids): the one check of the targets against the model output on
    every path of ``MegatronGRPO.loss_func``."""
    shapes = [mb.targets.shape] + ([rows.compact_shape] if rows is not None else [])
    if not isinstance(output, torch.Tensor) or output.shape[:-1] not in shapes or output.dim() < 2:
        got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        expected = " or ".join(f"[{', '.join(map(str, shape))}, {last}]" for shape in shapes)
        raise ValueError(f"model output must be {what} {expected} ({source}), got {got}")
    if mb.targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"mb.targets must be an int64 (or int32) tensor of token ids, got {mb.targets.dtype}")
    if mb.targets.device != output.device:
        raise ValueError(f"model output is on {output.device} but the micro-batch (mb.targets) is on {mb.targets.device}")
