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

**Logit precision** (``MP_GRPO_VERL_LOGIT_DTYPE=fp32``, or ``use_vocab_parallel_logprobs(logit_dtype=
LogitDtype.FP32)``; ``bf16``, the default, leaves the logits as verl's model makes them): the switch also runs the
engine's ``forward_step`` with the model's output layer answered by mp_grpo's fp32-output GEMM
(:func:`mp_grpo.megatron.logits_output.call_for_logits`), so the processor gets the GEMM's fp32 accumulator of the
bf16 operands, never rounded to bf16. Refused (never a silent bf16 head): an output layer that path cannot compute,
a second output-layer call in one forward (multi-token prediction), verl's ``use_fused_kernels=True`` (its kernel
makes the head itself), and ``fp32`` without the log-prob switch.

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

from mp_grpo.config.precision import LogitDtype
from mp_grpo.ops.vocab_parallel_logprobs import vocab_parallel_logprobs

ENV_SWITCH = "MP_GRPO_VERL_LOGPROBS"
"""The environment variable read by mp_grpo's verl plugin: ``1`` / ``true`` turns the switch on."""
ENV_LOGIT_DTYPE = "MP_GRPO_VERL_LOGIT_DTYPE"
"""The environment variable of the logits' precision under the switch: ``bf16`` (default) | ``fp32``."""

_ORIGINAL: dict[str, Callable[..., Any]] = {}


def use_vocab_parallel_logprobs(enable: bool = True, logit_dtype: LogitDtype = LogitDtype.BF16) -> None:
    """Replace (``enable``) or restore verl's Megatron LM-head log-prob + entropy processor, in this process; with
    ``logit_dtype=FP32`` also the engine's ``forward_step`` (:func:`with_fp32_logits`; module docstring)."""
    if not isinstance(logit_dtype, LogitDtype):
        raise TypeError(f"logit_dtype must be a LogitDtype (BF16 or FP32), got {logit_dtype!r}")
    if not enable and logit_dtype is not LogitDtype.BF16:
        raise ValueError("logit_dtype=fp32 needs the switch on (enable=True): the processor it feeds is mp_grpo's")
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead as Engine

    original = verl_processor()  # recorded before the first replacement
    if "forward_step" not in _ORIGINAL:
        _ORIGINAL["forward_step"] = Engine.__dict__["forward_step"]
    Engine._lm_head_logits_processor = lm_head_logprobs if enable else original
    forward_step = _ORIGINAL["forward_step"]
    Engine.forward_step = with_fp32_logits(forward_step) if logit_dtype is LogitDtype.FP32 else forward_step


def with_fp32_logits(forward_step: Callable[..., Any]) -> Callable[..., Any]:
    """verl's engine ``forward_step`` run with the model's output layer computing fp32 logits: the model is called
    through :func:`~mp_grpo.megatron.logits_output.call_for_logits` (``logit_dtype=FP32``) for the duration of the
    step's forward."""
    from mp_grpo.megatron.logits_output import call_for_logits

    def fp32_forward_step(engine: Any, batch_iter: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        engine_config = getattr(engine, "engine_config", None)
        if getattr(engine_config, "use_fused_kernels", False):
            raise ValueError(f"{ENV_LOGIT_DTYPE}=fp32 with verl's use_fused_kernels=True: its fused kernel makes the "
                             "output layer's logits itself, in the model's dtype; turn one of them off")
        step = _ForwardStep(model, lambda: forward_step(engine, batch_iter, model, *args, **kwargs))
        return call_for_logits(step, logit_dtype=LogitDtype.FP32)

    fp32_forward_step.__wrapped__ = forward_step  # type: ignore[attr-defined]
    return fp32_forward_step


class _ForwardStep(torch.nn.Module):
    """What :func:`call_for_logits` calls: it finds the output layer through ``module`` (verl's model chunk), and
    calling it runs verl's ``forward_step`` (whose model call then meets the replaced output layer)."""

    def __init__(self, model: Any, run: Callable[[], Any]) -> None:
        super().__init__()
        self.module = model
        self._run = run

    def forward(self) -> Any:
        return self._run()


def verl_processor() -> Callable[..., Any]:
    """verl's own processor (recorded before the switch replaces it)."""
    if "processor" not in _ORIGINAL:
        from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead as Engine

        _ORIGINAL["processor"] = Engine.__dict__["_lm_head_logits_processor"]
    return _ORIGINAL["processor"]


def switch_from_env() -> bool:
    """Apply :data:`ENV_SWITCH` (unset, ``0`` or ``false``: off; ``1`` or ``true``: on) and :data:`ENV_LOGIT_DTYPE`
    (:func:`logit_dtype_from_env`); whether the switch is on. Both are checked before verl is touched."""
    value = os.environ.get(ENV_SWITCH, "").strip().lower()
    logit_dtype = logit_dtype_from_env()
    if value in ("", "0", "false"):
        if logit_dtype is not LogitDtype.BF16:
            raise ValueError(f"{ENV_LOGIT_DTYPE}=fp32 needs {ENV_SWITCH}=1: the fp32 logits feed mp_grpo's processor")
        return False
    if value not in ("1", "true"):
        raise ValueError(f"{ENV_SWITCH}={os.environ[ENV_SWITCH]!r}: allowed 1 | true | 0 | false")
    use_vocab_parallel_logprobs(logit_dtype=logit_dtype)
    return True


def logit_dtype_from_env() -> LogitDtype:
    """:data:`ENV_LOGIT_DTYPE` as a :class:`LogitDtype` (unset: ``BF16``); another value is a one-line error naming it."""
    value = os.environ.get(ENV_LOGIT_DTYPE, "").strip().lower()
    if not value:
        return LogitDtype.BF16
    try:
        return LogitDtype(value)
    except ValueError:
        allowed = " | ".join(d.value for d in LogitDtype)
        raise ValueError(f"{ENV_LOGIT_DTYPE}={os.environ[ENV_LOGIT_DTYPE]!r}: allowed {allowed}") from None


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
