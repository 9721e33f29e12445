"""The property tests' helpers (tests/loss/properties.py) compute what their slower formulations computed."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.hypothesis_profiles import examples
from tests.loss import properties as P
from tests.loss.strategies import loss_configs, steps
from tests.reference import grpo_metrics_reference, grpo_objective_reference


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@settings(max_examples=examples(5))
@given(data=st.data())
def test_the_reference_of_one_pass_equals_the_three_calls(data) -> None:
    """``properties.reference`` takes J, its magnitude and the metrics from one pass over the rows
    (``tests.reference.grpo_reference``): bit for bit what ``grpo_objective_reference`` (J and its gradients),
    its ``magnitude=True`` and ``grpo_metrics_reference`` of the detached inputs give."""
    cfg_dict = data.draw(st.sampled_from(["torch", "triton"]).flatmap(loss_configs))
    step = data.draw(steps(cfg_dict, kl_logprobs=True))
    got, size, metrics = P.reference(step)

    d = P.as_computed(step)
    leaves = {n: d[n].clone().requires_grad_() for n in P.LEAVES if n in d}
    args = dict(rollout_logprobs=d.get("rollout_logprobs"), ref_logprobs=d.get("ref_logprobs"),
                entropy=leaves.get("entropy"), kl_logprobs=leaves.get("kl_logprobs"), entropy_coef=step.entropy_coef,
                positive=step.positive, topk=step.topk)
    old, adv, mask = d.get("old_logprobs"), d["advantages"], d["loss_mask"]
    j = grpo_objective_reference(step.cfg, leaves["logprobs"], old, adv, mask, **args)
    (j * step.upstream).backward()
    detached = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    with torch.no_grad():
        want_size = grpo_objective_reference(step.cfg, leaves["logprobs"].detach(), old, adv, mask, magnitude=True,
                                             **detached)
        want_metrics = grpo_metrics_reference(step.cfg, leaves["logprobs"].detach(), old, adv, mask, **detached)

    assert _same(float(got.loss), float(j.detach())), (float(got.loss), float(j.detach()))
    for n in P.LEAVES:
        if n in leaves:
            want = leaves[n].grad if leaves[n].grad is not None else torch.zeros_like(leaves[n])
            assert torch.equal(got.grads[n], want), n
        else:
            assert got.grads[n] is None
    assert _same(size, float(want_size)), (size, float(want_size))
    assert metrics.keys() == want_metrics.keys()
    for k, (value, scale) in want_metrics.items():
        assert _same(metrics[k][0], value) and _same(metrics[k][1], scale), (k, metrics[k], (value, scale))
