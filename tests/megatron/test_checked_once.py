"""A micro-batch is checked once, at the boundary it enters (``MegatronGRPO.loss_func``); the layers below trust it.

Every check function of the package is wrapped by a counting spy (wherever a module holds it: ``from … import``
binds it in the importer), then one micro-batch goes through ``loss_func`` along each path it can take — the
logits through ``GRPOLoss.on_logits`` (its fused autograd Function, or the two ops one after the other), the
logits with the rollout's sampling filter, the fused output layer with the loss in forward, and the fused output
layer's log-probs then the loss. Each check runs at most once per path, the targets' shape exactly once, and
the sampling filter not at all (it was checked when the MicroBatch was made). The public entry points the
adapter bypasses still check their own arguments (their errors name the argument).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from mp_grpo.config.job import OutputPath
from mp_grpo.loss import GRPOLoss, LossBackend
from mp_grpo.megatron import MegatronGRPO, ParallelGroups, prepare_micro_batch
from mp_grpo.megatron.fused_output import OutputWeight
from mp_grpo.ops.checks import CheckInputs
from tests.megatron import helpers as H

CHECKS: dict[str, tuple[str, ...]] = {
    "mp_grpo.ops.checks": (
        "check_logits_and_target", "check_logits", "check_target", "check_temperature", "check_runs_here",
        "check_inputs_mode", "check_hidden_weight_and_target", "check_hidden_and_weight", "check_chunk_size",
        "check_main_grad",
    ),
    "mp_grpo.ops.sampling_filter": ("check_sampling_filter",),
    "mp_grpo.loss.input_checks": ("check_token_inputs", "check_loss_call", "check_batch"),
    "mp_grpo.megatron.output_checks": ("check_output_shape",),
}
"""The check functions counted: ``ops/checks.py``'s argument checks, the sampling filter's, GRPOLoss's input
checks and the adapter's model-output check."""

TARGET_SHAPE_CHECKS = ("check_target", "check_output_shape")
"""The checks that compare the targets' shape with the model output's."""


def spy_checks(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Wrap every function of :data:`CHECKS` in every ``mp_grpo`` module that binds it; return the call counter."""
    calls: Counter = Counter()
    originals: dict[int, tuple[str, Callable]] = {}
    for module_name, names in CHECKS.items():
        module = sys.modules[module_name]
        for name in names:
            fn = getattr(module, name, None)
            if fn is not None:
                originals[id(fn)] = (name, fn)

    def spy(name: str, fn: Callable) -> Callable:
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return counted

    spies = {key: spy(name, fn) for key, (name, fn) in originals.items()}
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("mp_grpo"):
            continue
        for attr, value in list(vars(module).items()):
            if id(value) in spies and value is originals[id(value)][1]:
                monkeypatch.setattr(module, attr, spies[id(value)])
    return calls


PATHS = ["on_logits_fused", "on_logits_two_ops", "logits_sampling_filter", "fused_output_loss_in_forward",
         "fused_output_logprobs_then_loss"]


def _run_path(path: str, monkeypatch: pytest.MonkeyPatch) -> Counter:
    """``loss_func`` on one micro-batch along ``path``; the check calls it made (MicroBatch and GlobalBatch built
    before the spies)."""
    loss = "sequence_level" if path == "fused_output_logprobs_then_loss" else "ppo_token_tis"
    fused_output = path.startswith("fused_output")
    grpo = MegatronGRPO(H.loss_config(loss), temperature=H.TEMPERATURE, num_microbatches=1,
                        calculate_per_token_loss=False, groups=ParallelGroups(), vocab_size=H.VOCAB,
                        output_path=OutputPath.FUSED if fused_output else OutputPath.LOGITS,
                        # A target outside the filter is -inf, not an error, here (the weights are random).
                        check_inputs=CheckInputs.OFF if path == "logits_sampling_filter" else CheckInputs.SYNC)
    if path == "on_logits_fused":
        grpo.loss = GRPOLoss(grpo.config, backend=LossBackend.TRITON)  # the fused Function on CPU tensors
    mb = prepare_micro_batch(H.make_rollouts(2, seed=31))
    if path == "logits_sampling_filter":
        mb = mb.with_sampling_filter(top_k=H.VOCAB // 2, top_p=0.9)
    batch = grpo.global_batch([mb], step=0)
    gen = torch.Generator().manual_seed(32)
    hidden = torch.randn(*mb.targets.shape, H.HIDDEN, generator=gen, requires_grad=True)
    weight = (torch.randn(H.VOCAB, H.HIDDEN, generator=gen) * H.HIDDEN**-0.5).requires_grad_()
    calls = spy_checks(monkeypatch)
    if fused_output:
        loss_value, _ = grpo.loss_func(mb, batch, hidden, output_weight=OutputWeight(weight, False))
    else:
        loss_value, _ = grpo.loss_func(mb, batch, hidden @ weight.t())
    loss_value.backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
    return calls


@pytest.mark.parametrize("path", PATHS)
def test_loss_func_checks_each_thing_once(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _run_path(path, monkeypatch)
    repeated = {name: n for name, n in calls.items() if n > 1}
    assert not repeated, f"{path}: checks run more than once: {dict(calls)}"
    assert sum(calls[name] for name in TARGET_SHAPE_CHECKS) == 1, f"{path}: {dict(calls)}"
    assert calls["check_sampling_filter"] == 0, f"{path}: the MicroBatch's filter was checked again: {dict(calls)}"
    assert calls["check_loss_call"] == 1, f"{path}: the loss inputs are checked once: {dict(calls)}"
    assert calls["check_batch"] == 1, f"{path}: the GlobalBatch is checked once: {dict(calls)}"


def test_spy_counts_the_public_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spy sees checks where they run: the public op, called directly, checks its arguments."""
    from mp_grpo import vocab_parallel_logprobs

    calls = spy_checks(monkeypatch)
    logits = torch.randn(2, 3, 8)
    vocab_parallel_logprobs(logits, torch.zeros(2, 3, dtype=torch.int64))
    assert calls["check_logits_and_target"] == 1 and calls["check_temperature"] == 1 and calls["check_runs_here"] == 1


def test_public_entry_points_still_check_their_arguments() -> None:
    """What the adapter checks for the layers below, each public entry point still checks itself, naming the
    argument."""
    from mp_grpo import fused_linear_logprobs, vocab_parallel_logprobs
    from mp_grpo.ops.fused_linear_loss import fused_linear_loss
    from mp_grpo.ops.sampling_filter import SamplingFilter

    logits = torch.randn(2, 3, 8)
    target = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_logprobs(logits, target[:, :2])
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(logits, target, temperature=0.0)
    with pytest.raises(ValueError, match="sampling_filter.top_k"):
        vocab_parallel_logprobs(logits, target, sampling_filter=SamplingFilter(top_k=0))
    hidden, weight = torch.randn(2, 3, 4), torch.randn(8, 4)
    with pytest.raises(ValueError, match="weight shape"):
        fused_linear_logprobs(hidden, weight[:, :3], target)
    with pytest.raises(ValueError, match="sampling_filter.top_p"):
        fused_linear_logprobs(hidden, weight, target, sampling_filter=SamplingFilter(top_p=torch.ones(2, 2)))
    with pytest.raises(ValueError, match="target shape"):
        fused_linear_loss(hidden, weight, target[:1], lambda lp, ent: (lp.sum(), None))

    loss = GRPOLoss(H.loss_config("ppo_token_tis"))
    lp = torch.randn(2, 3)
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        loss(lp, lp[:, :2], torch.zeros(2), torch.ones(2, 3, dtype=torch.bool), rollout_logprobs=lp)
    with pytest.raises(ValueError, match="rollout_logprobs must be given"):
        loss.on_logits(logits, target, lp, torch.zeros(2), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="target shape"):
        loss.on_logits(logits, target[:1], lp, torch.zeros(2), torch.ones(2, 3, dtype=torch.bool), rollout_logprobs=lp)
