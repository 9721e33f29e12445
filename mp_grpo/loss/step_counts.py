"""The counts and step-level statistics a training framework hands a loss, checked (``GlobalBatch.from_counts``).

Frameworks give a loss **counts** of the step — verl's ``global_batch_info`` (``batch_num_tokens``,
``global_batch_size``), NeMo-RL's ``global_valid_toks`` / ``global_valid_seqs``, Megatron-LM's per-token-loss
counts — not the step's masks. Each value is a Python number or a 0-dim tensor on the batch's device:

* a **Python number** is checked on the host at once: ``TypeError`` / ``ValueError`` naming the argument;
* a **tensor** is checked on the device: its violations are counted into the deferred error ledger
  (``mp_grpo.ops.checks``, one kind for all of them) — raised at once on the CPU, at the next
  ``mp_grpo.check_errors()`` on a GPU (``reduce_metrics`` and ``GlobalBatch.skip_step`` call it); no host read
  here. The message names every rule the latest call broke.

A checked value is a Python float or a float64 0-dim tensor on the device (:data:`Value`), so the rules
between values (:func:`enforce`) are host booleans when every operand is a Python number and device
booleans otherwise.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import NamedTuple, Union

import torch

from mp_grpo.config.loss import Aggregation, LossConfig
from mp_grpo.ops.checks import record_errors

Value = Union[float, torch.Tensor]
"""A checked count or statistic: a Python float, or a float64 0-dim tensor on the batch's device."""

LEDGER_KIND = "GlobalBatch.from_counts input"
"""The deferred error kind of every rule broken by a tensor value."""


class StepStatistic(NamedTuple):
    """A step-level quantity some configs need: computed over the whole step before any micro-batch's loss."""

    name: str
    """Its GlobalBatch field (and ``GlobalBatch.from_counts`` argument)."""
    key: str
    """The config key that needs it."""
    needed: Callable[[LossConfig], bool]
    """Whether a LossConfig needs it."""
    computes: str
    """What the pass computes."""


STEP_STATISTICS = (
    StepStatistic("weight_mean", "rollout_correction.normalize_weights",
                  lambda c: c.rollout_correction.normalize_weights,
                  "the global mean of the truncated IS weights over the step's valid tokens or sequences"),
    StepStatistic("entropy_threshold", "entropy.top_quantile < 1", lambda c: c.entropy.top_quantile < 1.0,
                  "the (1 − top_quantile) quantile of the entropies of all the step's valid tokens"),
    StepStatistic("mismatch_k3", "mismatch.skip_threshold", lambda c: c.mismatch.skip_threshold is not None,
                  "the global mean of k3(old ‖ rollout) over the step's valid tokens"),
    StepStatistic("nonfinite_inputs", "nonfinite.skip_step", lambda c: c.nonfinite.skip_step,
                  "the count, over all ranks, of the step's valid positions with a NaN or ±inf old / rollout / "
                  "reference log-prob, advantage or entropy"),
    StepStatistic("m2po_threshold", "m2po.bound", lambda c: c.m2po.bound is not None,
                  "M2PO's threshold on d² = (old − rollout)² over the step's candidates (mp_grpo.loss.m2po)"),
)
"""The step-level quantities (``GlobalBatch.from_rollouts`` computes them; ``from_counts`` takes them)."""

COUNTS = ("valid_tokens", "valid_sequences", "all_sequences", "micro_batches")
"""The counts ``GlobalBatch.from_counts`` takes (valid_tokens required)."""


def divides_by_tokens(mode: Aggregation) -> bool:
    """Whether ``mode``'s divisor D_t is N (token_mean) rather than a multiple of S (the seq_mean modes)."""
    return mode == Aggregation.TOKEN_MEAN


def nonlinear_in_counts(config: LossConfig) -> list[str]:
    """The settings of ``config`` whose objective is not one sum over tokens divided by N alone or by S alone —
    each ``"key: reason"``. Without any, the share with N = S = 1 times 1/N (token_mean) or 1/S (the seq_mean
    modes) is the share with the step's counts (:meth:`GlobalBatch.unnormalized`)."""
    found = [f"{stat.key}: needs {stat.name}, a pass over the whole step ({stat.computes})"
             for stat in STEP_STATISTICS if stat.needed(config)]
    if config.nll.positive_coef != 0.0:
        found.append(f"nll.positive_coef={config.nll.positive_coef}: the NLL term is divided by the positive "
                     "examples' valid-token count, not by N or S")
    agg = config.aggregation
    regularized = config.kl.coef != 0.0 or config.entropy.bonus_coef != 0.0 or config.entropy.adaptive
    if regularized and divides_by_tokens(agg.mode) != divides_by_tokens(agg.regularizer):
        def divisor(mode: Aggregation) -> str:
            return "N" if divides_by_tokens(mode) else "S"
        found.append(f"aggregation.regularizer_mode={agg.regularizer.value}: the KL / entropy terms divide by "
                     f"{divisor(agg.regularizer)}, the policy term (aggregation.mode={agg.mode.value}) by "
                     f"{divisor(agg.mode)}")
    return found


def check_linear_in_counts(config: LossConfig, caller: str) -> None:
    """Raise ``ValueError`` (one line, ``caller`` first) naming each setting of :func:`nonlinear_in_counts`."""
    found = nonlinear_in_counts(config)
    if found:
        raise ValueError(f"{caller}: unnormalized sums rescaled once per step by 1/N or 1/S need an objective linear "
                         f"in that one count; not so with {'; '.join(found)} — switch it off on this path")


def check_counts(given: dict[str, object], device: torch.device, config: LossConfig | None) -> dict[str, torch.Tensor]:
    """``GlobalBatch.from_counts``' values (name → Python number or 0-dim tensor; None = not given), checked,
    as float64 0-dim tensors on ``device`` (the ones not given left out).

    Schedule: 1. types; 2. each statistic given exactly when ``config`` needs it; 3. the rules on the values —
    broken host rules raise now, device rules are counted into the ledger (:func:`enforce`); 4. conversion.
    """
    # --- 1. each value's type, converted once (a float, or a float64 tensor on device) ---
    if given.get("valid_tokens") is None:
        raise TypeError("valid_tokens must be given: the step's valid-token count N over all ranks of the group")
    values = {name: scalar(name, v, device) for name, v in given.items() if v is not None}

    # --- 2. the statistics the config needs: each given exactly when needed ---
    for stat in STEP_STATISTICS:
        needed = config is not None and stat.needed(config)
        if needed and stat.name not in values:
            raise ValueError(
                f"{stat.name} must be given: config {stat.key} needs a step-level pass over the whole step "
                f"({stat.computes}); pass {stat.name}= computed by your loop, or build the batch with "
                "GlobalBatch.from_rollouts")
        if stat.name in values and config is None:
            raise ValueError(f"{stat.name} is given without config=: pass the LossConfig it was computed for")
        if stat.name in values and not needed:
            raise ValueError(f"{stat.name} is given but config does not use it ({stat.key} is off)")

    # --- 3. the rules on the values ---
    rules = [rule for name in COUNTS if name in values for rule in count_rules(name, values[name])]
    n, s_valid, s_all = values["valid_tokens"], values.get("valid_sequences"), values.get("all_sequences")
    if s_valid is not None:
        rules.append(Rule("valid_sequences ≤ valid_tokens (each has a valid token)", s_valid <= n))
        rules.append(Rule("valid_sequences ≥ 1 when valid_tokens > 0", implies(n > 0, s_valid >= 1)))
    if s_all is not None:
        rules.append(Rule("all_sequences ≥ 1 when valid_tokens > 0", implies(n > 0, s_all >= 1)))
    if s_valid is not None and s_all is not None:
        rules.append(Rule("valid_sequences ≤ all_sequences", s_valid <= s_all))
    if "micro_batches" in values:
        rules.append(Rule("micro_batches ≥ 1", values["micro_batches"] >= 1))
    if "weight_mean" in values:
        rules += statistic_rules("weight_mean", values["weight_mean"], positive=True)
    if "entropy_threshold" in values:
        rules += statistic_rules("entropy_threshold", values["entropy_threshold"])
    if "mismatch_k3" in values:
        rules += statistic_rules("mismatch_k3", values["mismatch_k3"], non_negative=True)
    if "nonfinite_inputs" in values:
        rules += count_rules("nonfinite_inputs", values["nonfinite_inputs"])
    if "m2po_threshold" in values:  # +inf (nothing dropped) is a valid threshold
        tau = values["m2po_threshold"]
        rules.append(Rule("m2po_threshold ≥ 0 (not NaN; +inf: nothing dropped)", tau >= 0))
    enforce(rules, values, "GlobalBatch.from_counts")

    # --- 4. float64 0-dim tensors on device ---
    return {name: as_tensor(v, device) for name, v in values.items()}


def check_within_counts(loss_mask: torch.Tensor, name: str, bounds: dict[str, torch.Tensor], error: type[Exception]) -> None:
    """A micro-batch's ``loss_mask`` fits in the step's counts ``bounds`` (``valid_tokens``, and
    ``valid_sequences`` / ``all_sequences`` where known): its valid tokens at most ``valid_tokens``; its rows
    with a valid token (a 2-D mask) at most each sequence count. Counted on the device, reported through the
    deferred ledger as ``error``."""
    valid = loss_mask != 0
    checks = [("valid tokens", valid.sum(dtype=torch.float64), "valid_tokens")]
    if valid.dim() == 2:
        rows = valid.any(dim=-1).sum(dtype=torch.float64)
        checks += [("rows with a valid token", rows, field) for field in ("valid_sequences", "all_sequences")
                   if field in bounds]
    over = torch.stack([mine > bounds[field] for _, mine, field in checks])

    def message(_: int) -> str:  # read only when the error is raised
        broken = [f"{what} {int(mine)} > the step's {field} {bounds[field].item():g}"
                  for (what, mine, field), b in zip(checks, over.tolist()) if b]
        return (f"{name} does not fit in this GlobalBatch's counts ({'; '.join(broken) or 'a count exceeded'}): "
                "counts of another step, or counted over fewer ranks or micro-batches than the step has?")

    record_errors("micro-batch beyond the GlobalBatch counts", over.sum(), message, error)


class Rule(NamedTuple):
    """One requirement on the values: ``ok`` is a host bool or a 0-dim bool tensor on the device."""

    text: str
    """What must hold, naming the arguments (``"valid_tokens ≥ 0"``)."""
    ok: bool | torch.Tensor


def check_sequence_count(config: LossConfig, missing: Sequence[str], error: type[Exception]) -> None:
    """A batch built from counts without ``missing`` holds the sequence count S ``config``'s aggregation divides by
    (every mode but token_mean divides by S, see :mod:`mp_grpo.loss.aggregation`); ``error`` naming the count to pass
    otherwise."""
    agg = config.aggregation
    modes = [f"aggregation.mode={agg.mode.value}"] if agg.mode != Aggregation.TOKEN_MEAN else []
    if agg.regularizer != agg.mode and agg.regularizer != Aggregation.TOKEN_MEAN:
        modes.append(f"aggregation.regularizer_mode={agg.regularizer.value}")
    name = "all_sequences" if agg.count_empty_sequences else "valid_sequences"
    if modes and name in missing:
        meaning = "every sequence" if agg.count_empty_sequences else "the sequences with a valid token"
        raise error(
            f"batch: {' and '.join(modes)} divides by the step's sequence count — {meaning} (aggregation."
            f"count_empty_sequences={str(agg.count_empty_sequences).lower()}) — but this GlobalBatch was built "
            f"from counts without {name}: pass {name}= to GlobalBatch.from_counts"
        )


def check_device(device: object) -> torch.device:
    """``device`` as a :class:`torch.device` with its index (``"cuda"`` is the current CUDA device)."""
    if not isinstance(device, (torch.device, str)):
        raise TypeError(f"device must be a torch.device or a string such as 'cuda:0', got {type(device).__name__}")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device: {error}") from None
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def scalar(name: str, value: object, device: torch.device) -> Value:
    """A Python real number (not a bool) as a float, or a real 0-dim tensor on ``device`` as a float64 tensor
    (detached); anything else is a ``TypeError`` / ``ValueError`` naming ``name``."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise ValueError(f"{name} must be a Python number or a 0-dim tensor, got a tensor of shape "
                             f"{tuple(value.shape)}")
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must be a real number, got a {value.dtype} tensor")
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but device is {device}: pass the count on the batch's "
                             "device (or as a Python number)")
        return value.detach().to(torch.float64)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a Python number or a 0-dim tensor, got {type(value).__name__}")
    return float(value)


def count_rules(name: str, value: Value) -> list[Rule]:
    """A count is finite, ≥ 0 and integral."""
    if isinstance(value, torch.Tensor):
        finite = torch.isfinite(value)
        return [Rule(f"{name} is finite", finite), Rule(f"{name} ≥ 0", value >= 0),
                Rule(f"{name} is a whole number", value == torch.floor(value))]
    finite = math.isfinite(value)
    return [Rule(f"{name} is finite", finite), Rule(f"{name} ≥ 0", value >= 0),
            Rule(f"{name} is a whole number", finite and value == math.floor(value))]


def statistic_rules(name: str, value: Value, *, positive: bool = False, non_negative: bool = False) -> list[Rule]:
    """A step-level statistic is finite (and > 0 / ≥ 0 where asked)."""
    finite = torch.isfinite(value) if isinstance(value, torch.Tensor) else math.isfinite(value)
    rules = [Rule(f"{name} is finite", finite)]
    if positive:
        rules.append(Rule(f"{name} > 0", value > 0))
    if non_negative:
        rules.append(Rule(f"{name} ≥ 0", value >= 0))
    return rules


def implies(premise: bool | torch.Tensor, conclusion: bool | torch.Tensor) -> bool | torch.Tensor:
    """``premise ⇒ conclusion`` for host or device booleans."""
    if isinstance(premise, torch.Tensor) or isinstance(conclusion, torch.Tensor):
        return torch.logical_or(torch.logical_not(torch.as_tensor(premise)), torch.as_tensor(conclusion))
    return (not premise) or conclusion


def enforce(rules: Sequence[Rule], values: dict[str, Value], caller: str) -> None:
    """Raise ``ValueError`` for the first broken host rule; count the device rules into the ledger.

    ``values`` (name → value) are quoted in the messages; ``caller`` names the constructor.
    """
    device_rules = []
    for rule in rules:
        if isinstance(rule.ok, torch.Tensor):
            device_rules.append(rule)
        elif not rule.ok:
            raise ValueError(f"{caller}: {rule.text} must hold ({_quote(values)})")
    if not device_rules:
        return
    broken = torch.logical_not(torch.stack([r.ok.reshape(()) for r in device_rules]))

    def message(_: int) -> str:  # read only when the error is raised
        failed = [r.text for r, b in zip(device_rules, broken.tolist()) if b]
        which = "; ".join(failed) if failed else "the rules on its counts and statistics"
        return f"{caller}: a tensor argument broke {which} ({_quote(values)})"

    record_errors(LEDGER_KIND, broken.sum(), message)


def as_tensor(value: Value, device: torch.device) -> torch.Tensor:
    """A checked value as a float64 0-dim tensor on ``device`` (a fill for a Python number: no host copy)."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.full((), value, dtype=torch.float64, device=device)


def _quote(values: dict[str, Value]) -> str:
    parts = []
    for name, v in values.items():
        shown = v.item() if isinstance(v, torch.Tensor) else v
        parts.append(f"{name}={shown:g}" if isinstance(shown, float) else f"{name}={shown}")
    return ", ".join(parts)
