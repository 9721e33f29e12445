"""NeMo-RL's asynchronous (split-API) training step, emulated on CPU: placeholder counts, then the rescale.

NeMo-RL's ``MegatronPolicyWorker`` (``nemo_rl/models/policy/workers/megatron_policy_worker.py``):

* ``train_microbatch`` calls the loss of every micro-batch with ``global_valid_seqs = global_valid_toks =
  torch.tensor(1.0)`` and accumulates the raw gradients, its local valid sequences and tokens
  (Σ sample_mask, Σ token_mask[:, 1:]·sample_mask) and the metric dicts;
* ``finish_train_step`` all-reduces the local counts over DP, multiplies the gradients by 1/N
  (``model.scale_gradients``; N = ``global_valid_toks`` for ``TOKEN_LEVEL``, ``global_valid_seqs`` otherwise),
  leaves every metric whose name holds ``_min`` / ``_max`` as it is, multiplies the others by 1 / the count the
  loss's ``metric_normalizations`` names (NONE: unchanged; not advertised: 1/N), and sums the ``loss`` metrics
  × 1/N into the step's loss.

:func:`rescale` is that arithmetic written out; :func:`nemo_rl_rescale` compiles NeMo-RL's own statements of
``_finish_train_step_body`` that do it (the rest of the method needs a GPU, Megatron's DDP model and an
optimizer), so a test can run NeMo-RL's code where its source is present and pin the emulation to it.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from mp_grpo.integrations.nemo_rl.interfaces import LossType, MetricNormalizer

PLACEHOLDER = 1.0
"""NeMo-RL's ``placeholder_n``."""

WORKER = "nemo_rl/models/policy/workers/megatron_policy_worker.py"
"""The file of the split API, in NeMo-RL's source tree."""

RUNTIME = ("self.", "torch.distributed", "torch.cuda.synchronize", "finalize_model_grads_func", "get_pg_collection",
           "update_successful", "grad_norm", "num_zeros_in_grad", "log.")
"""Statements of ``_finish_train_step_body`` naming any of these need the worker's runtime: left out."""


class Rescaled(NamedTuple):
    """What ``finish_train_step`` makes of the step's micro-batches."""

    metrics: list[dict[str, Any]]
    """Each micro-batch's metric dict, rescaled."""
    loss: float
    """Σ over micro-batches of ``loss`` × 1/N (this rank's; NeMo-RL all-reduces it over DP), summed in float32 as
    NeMo-RL does (``torch.tensor`` of Python floats)."""
    inv_n: float
    """The gradients' factor."""


def local_counts(data: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's (Σ sample_mask, Σ token_mask[:, 1:]·sample_mask) in float64, as ``train_microbatch``."""
    sample_mask = data["sample_mask"]
    seqs = torch.sum(sample_mask).to(torch.float64)
    toks = torch.sum(data["token_mask"][:, 1:] * sample_mask.unsqueeze(-1)).to(torch.float64)
    return seqs, toks


def rescale(loss_type: Any, normalizations: Mapping[str, Any], metrics: Sequence[Mapping[str, Any]],
            seqs: torch.Tensor, toks: torch.Tensor) -> Rescaled:
    """``finish_train_step``'s arithmetic (module docstring) on the DP-reduced counts ``seqs`` / ``toks``."""
    n_true = toks if loss_type == LossType.TOKEN_LEVEL else seqs
    inv_n = 1.0 / (n_true.item() if n_true.item() > 0 else 1.0)
    inv_toks = 1.0 / (toks.item() if toks.item() > 0 else 1.0)
    inv_seqs = 1.0 / (seqs.item() if seqs.item() > 0 else 1.0)
    out = []
    for m in metrics:
        scaled = {}
        for k, v in m.items():
            kind = normalizations.get(k)
            if "_min" in k or "_max" in k or kind is MetricNormalizer.NONE:
                scaled[k] = v
            else:
                scaled[k] = v * (inv_toks if kind is MetricNormalizer.TOKENS else
                                 inv_seqs if kind is MetricNormalizer.SEQUENCES else inv_n)
        out.append(scaled)
    loss = torch.tensor([m["loss"] * inv_n for m in metrics]).sum().item()  # NeMo-RL's: a float32 sum
    return Rescaled(out, loss, inv_n)


def nemo_rl_rescale() -> Callable[..., Rescaled] | None:
    """:func:`rescale` as NeMo-RL's own code, or None without its source (``MP_GRPO_NEMO_RL_SRC``).

    The statements of ``MegatronPolicyWorker._finish_train_step_body`` before its
    ``aggregate_training_statistics`` call, less those of :data:`RUNTIME`, compiled as they are and run on a
    namespace holding the open step's ``state`` (counts already DP-reduced)."""
    root = os.environ.get("MP_GRPO_NEMO_RL_SRC")
    if not root or not (Path(root) / WORKER).is_file():
        return None
    tree = ast.parse((Path(root) / WORKER).read_text())
    body = next(node.body for node in ast.walk(tree)
                if isinstance(node, ast.FunctionDef) and node.name == "_finish_train_step_body")
    statements = []
    for statement in body:
        text = ast.unparse(statement)
        if "aggregate_training_statistics" in text:
            break
        if not any(name in text for name in RUNTIME):
            statements.append(statement)
    code = compile(ast.Module(body=statements, type_ignores=[]), f"<{WORKER} rescale>", "exec")

    def run(loss_type: Any, normalizations: Mapping[str, Any], metrics: Sequence[Mapping[str, Any]],
            seqs: torch.Tensor, toks: torch.Tensor) -> Rescaled:
        state = {"local_valid_seqs": seqs, "local_valid_toks": toks, "loss_type": loss_type,
                 "metric_normalizations": dict(normalizations), "all_mb_metrics": [dict(m) for m in metrics],
                 "mb_losses": [m["loss"] for m in metrics]}
        namespace: dict[str, Any] = {"torch": torch, "state": state, "Any": Any, "curr_lr": None, "curr_wd": None}
        exec(code, namespace)
        for name in ("inv_n", "rescaled_metrics", "losses_to_aggregate"):
            assert name in namespace, f"NeMo-RL's _finish_train_step_body no longer defines {name}: update {__name__}"
        dropped = ("lr", "wd", "global_valid_seqs", "global_valid_toks")  # added by NeMo-RL, not the loss's
        rescaled = [{k: v for k, v in m.items() if k not in dropped} for m in namespace["rescaled_metrics"]]
        return Rescaled(rescaled, float(namespace["losses_to_aggregate"][0]), float(namespace["inv_n"]))

    return run
