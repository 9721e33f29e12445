"""mp_grpo's log-prob kernel in verl's Megatron engine: one switch replaces the engine's LM-head processor.

verl's ``MegatronEngineWithLMHead._lm_head_logits_processor`` turns this rank's vocabulary shard of the
logits (``[B, S, V/TP]``, or ``[1, nnz/CP, V/TP]`` packed) into per-token log-probs and entropy: it divides
the logits by the temperature in place, clones them for the entropy (``vocab_parallel_entropy``: three
all-reduces over TP and an ``[N, V/TP]`` fp32 softmax kept for backward) and takes the log-probs with
megatron-core's ``vocab_parallel_cross_entropy`` (three more all-reduces). :func:`lm_head_logprobs` computes
both with :func:`mp_grpo.vocab_parallel_logprobs` instead: one read of the shard, one all-gather of
``[N + 1, 4]`` fp32 statistics over TP, the temperature inside the kernel (no pass, no in-place change of
the logits), no clone, and one backward pass that writes the shard's gradient.

The switch, either of:

* ``MP_GRPO_VERL_LOGPROBS=1`` in the environment of verl's processes — mp_grpo's verl plugin reads it when
  ``import verl`` loads the plugin, in every process (on one node, ``export`` it before launching; on a Ray
  cluster add ``+ray_kwargs.ray_init.runtime_env.env_vars.MP_GRPO_VERL_LOGPROBS=1`` to the trainer's
  command line);
* :func:`use_vocab_parallel_logprobs` called in each worker process (your own worker classes).

What stays verl's (the call is handed to verl's processor): ``calculate_sum_pi_squared`` (the optimal-token
baseline's Σπ²), top-k distillation (``distillation_use_topk`` / ``distillation_only``), per-token
temperatures that differ across the micro-batch's positive entries (the logits are then divided as verl does
and the kernel runs at temperature 1), and a nested (jagged) temperature tensor. The engine's
``use_fused_kernels=True`` path does not call this processor at all.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from mp_grpo.ops.vocab_parallel_logprobs import vocab_parallel_logprobs

ENV_SWITCH = "MP_GRPO_VERL_LOGPROBS"
"""The environment variable read by mp_grpo's verl plugin: ``1`` / ``true`` turns the switch on."""

_ORIGINAL: dict[str, Callable[..., Any]] = {}


def use_vocab_parallel_logprobs(enable: bool = True) -> None:
    """Replace (``enable``) or restore verl's Megatron LM-head log-prob + entropy processor, in this process."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead as Engine

    original = verl_processor()  # recorded before the first replacement
    Engine._lm_head_logits_processor = lm_head_logprobs if enable else original


def verl_processor() -> Callable[..., Any]:
    """verl's own processor (recorded before the switch replaces it)."""
    if "processor" not in _ORIGINAL:
        from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead as Engine

        _ORIGINAL["processor"] = Engine.__dict__["_lm_head_logits_processor"]
    return _ORIGINAL["processor"]


def switch_from_env() -> bool:
    """Apply :data:`ENV_SWITCH` (unset, ``0`` or ``false``: off; ``1`` or ``true``: on); whether it is on."""
    value = os.environ.get(ENV_SWITCH, "").strip().lower()
    if value in ("", "0", "false"):
        return False
    if value not in ("1", "true"):
        raise ValueError(f"{ENV_SWITCH}={os.environ[ENV_SWITCH]!r}: allowed 1 | true | 0 | false")
    use_vocab_parallel_logprobs()
    return True


def lm_head_logprobs(
    engine: Any,
    logits: torch.Tensor,
    label: torch.Tensor,
    temperature: torch.Tensor,
    *,
    calculate_sum_pi_squared: bool,
    calculate_entropy: bool,
    distillation_use_topk: bool,
    distillation_only: bool,
    logits_processor_func: Callable,
    batch: Any,
    data_format: str,
) -> dict[str, torch.Tensor]:
    """verl's ``_lm_head_logits_processor`` (same arguments, same outputs: ``log_probs`` and, with
    ``calculate_entropy``, ``entropy``, shaped like ``label``; fp32) through :func:`vocab_parallel_logprobs`.

    Schedule: 1. the temperature — one float when every positive entry is the same (one host read; verl
    reads one too), else the logits divided in place as verl does; 2. one kernel call over this rank's shard
    and the TP group of megatron-core's parallel_state (its one all-gather). Everything else is handed to
    verl's processor (module docstring).
    """
    if calculate_sum_pi_squared or distillation_use_topk or distillation_only or temperature.is_nested:
        return verl_processor()(
            engine, logits, label, temperature, calculate_sum_pi_squared=calculate_sum_pi_squared,
            calculate_entropy=calculate_entropy, distillation_use_topk=distillation_use_topk,
            distillation_only=distillation_only, logits_processor_func=logits_processor_func, batch=batch,
            data_format=data_format)
    if logits.shape[:-1] != label.shape:
        raise ValueError(f"logits shape {tuple(logits.shape)} must be label shape {tuple(label.shape)} + (V/TP,)")
    # --- 1. the temperature ---
    scale = _uniform_temperature(temperature)
    if scale is None:  # per-position temperatures: divide as verl does (its non-positive entries at 1e-8)
        logits.div_(temperature.clamp(min=_PADDING_TEMPERATURE).unsqueeze(-1).to(logits.dtype))
        scale = 1.0
    # --- 2. log-probs and entropy in one pass, one all-gather over TP ---
    out = vocab_parallel_logprobs(logits, label, tp_group=_tp_group(), temperature=scale,
                                  with_entropy=calculate_entropy)
    if calculate_entropy:
        log_probs, entropy = out
        return {"entropy": entropy, "log_probs": log_probs}
    return {"log_probs": out}


_PADDING_TEMPERATURE = 1e-8
"""verl's stand-in for a non-positive temperature (padding positions) when it divides the logits."""


def _uniform_temperature(temperature: torch.Tensor) -> float | None:
    """The one temperature of every positive entry (1.0 when none is positive: padding only), else None.
    Non-positive entries are padding in verl; their outputs are masked out of every loss."""
    positive = temperature > 0
    inf = torch.tensor(float("inf"), dtype=temperature.dtype, device=temperature.device)
    low = torch.where(positive, temperature, inf).amin()
    high = torch.where(positive, temperature, -inf).amax()
    low_value, high_value = torch.stack([low, high]).tolist()
    if low_value == float("inf"):
        return 1.0
    return float(low_value) if low_value == high_value else None


def _tp_group():
    """megatron-core's tensor-parallel group, or None when model parallelism is not initialized."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()
