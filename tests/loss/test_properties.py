"""Property-based tests of GRPOLoss (hypothesis): random valid configs, layouts, dtypes and extreme but finite
inputs, each checked against the float64 reference (tests/reference.py) for value, gradient (through a random
upstream gradient) and metrics, on both backends (the torch path and the fused Triton kernels, here under the
Triton interpreter: sizes stay tiny), and for layout invariance (the same tokens split over ranks and
micro-batches, padded or packed, give the same summed shares, gradients and metrics as one call).

Properties
    * ``test_config_layer_refuses_or_runs``: any combination of config keys and values (valid or not) is either
      refused at load time with a ConfigError naming a key, or it runs — on the torch path matching the
      reference, and on the Triton path matching the torch path or refused when the GRPOLoss is built.
    * ``test_single_call_matches_reference_{torch,triton}``: one call on a whole padded step (``batch=None``).
      The Triton variant also runs the torch path on the same draw: the same metric names and values.
    * ``test_split_matches_single_call_{torch,triton}``: the step over (rank, micro-batch) pairs with one
      GlobalBatch (the data-parallel ranks simulated in one process, as their all-reduce sums them): summed
      shares, gradients and reduced metrics equal one call's (1e-9 relative in float64) and the reference's.
    * ``test_covariance_objectives_match_verl``: clip_cov / kl_cov (torch only; their selection is per call, so
      not layout-invariant) against ``verl_actor_loss_reference`` replaying the selection keys.
    * ``test_on_logits_matches_reference_and_the_two_ops``: ``GRPOLoss.on_logits`` against the float64 reference of
      the logits and against the log-prob op followed by the loss.
    The CP = 2 property runs under torchrun in tests/loss/test_properties_cp.py, the Megatron adapter's
    CP = 2 × TP = 2 one in tests/megatron/test_properties_cp_tp.py, the log-prob op's in
    tests/ops/test_logprob_properties.py.

Device
    The single-call, split and ``on_logits`` properties run where ``MP_GRPO_PROPERTY_DEVICE`` says (cpu by default;
    cuda under the ``gpu`` profile; skipped, saying why, when cuda is asked for without a GPU), the float64
    reference on the CPU. On CUDA the Triton backend runs the compiled kernels, every backend the profile's count,
    and the steps are larger (up to 6 rows of 600 tokens; ``on_logits``: long rows and vocabularies up to 70001).
    ``MP_GRPO_PROPERTY_COMPUTE=float32|float64`` keeps to steps computed in that dtype.

Profiles (``MP_GRPO_HYPOTHESIS_PROFILE``, tests/hypothesis_profiles.py)
    * ``ci`` (default, what ``python -m pytest`` and CI run): ``derandomize=True`` — the same examples on every
      run, about 3 minutes on 2 cores for both property files.
    * ``dev``: the CI counts with fresh random examples (and hypothesis' example database in ``.hypothesis/``).
    * ``soak``: 50× the CI counts, fresh random examples — for local runs, e.g.
      ``MP_GRPO_HYPOTHESIS_PROFILE=soak nice -n 19 python -m pytest tests/loss/test_properties.py -p no:cacheprovider``,
      and many seeds in parallel with scripts/soak_properties.py (docs/testing.md).
    * ``gpu``: the soak counts on CUDA.

Reproducing a failure
    hypothesis prints the falsifying example (the config dict, the step's structure, its ``seed``) and a
    ``@reproduce_failure('<version>', b'<blob>')`` line: paste that decorator above the failing test function
    and run that test alone. Under ``dev`` / ``soak`` the pytest output also names the run's seed: rerun with
    ``--hypothesis-seed=<seed>`` (and the same profile) to replay the whole run. Under ``ci`` the examples are
    fixed: rerunning the test reproduces the failure. A shrunk failure becomes a regular test that pins the
    example (tests/loss/test_property_regressions.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, event, given, note, settings
from hypothesis import strategies as st

from mp_grpo.config import ConfigError
from mp_grpo.loss import GRPOLoss, LossBackend, fused_unsupported, reduce_metrics
from tests.hypothesis_profiles import examples, forced_compute_dtype, needs_property_device, on_gpu, property_device
from tests.loss import properties as P
from tests.loss.strategies import build_config, loss_configs, raw_config_overrides, splits, steps


WEIGHT = {LossBackend.TORCH: 6.0, LossBackend.TRITON: 1.0}
"""Examples per backend relative to the profile: the Triton interpreter is ~50× slower per call."""
GPU_WEIGHT = 1.0
"""On CUDA (the gpu profile) every backend runs the profile's count: no interpreter there."""
GPU_LENGTHS = (6, 60, 600)
"""Sequence widths drawn on CUDA: up to 6 rows of 600 tokens span several blocks of the fused loss kernels (1024
tokens per program on a GPU; 16 under the interpreter, where the CPU sizes already span them)."""


def _weight(backend: LossBackend) -> float:
    return GPU_WEIGHT if on_gpu() else WEIGHT[backend]


@st.composite
def _step_for(draw, backend: LossBackend, **kwargs):
    name = "triton" if backend == LossBackend.TRITON else "torch"
    cfg_dict = draw(loss_configs(name))
    note(f"config: {cfg_dict}")
    torch_only = backend == LossBackend.TORCH
    if on_gpu():
        size = {"max_rows": 6, "max_len": draw(st.sampled_from(GPU_LENGTHS))}
    else:
        size = {} if torch_only else {"max_rows": 4, "max_len": 6}
    step = draw(steps(cfg_dict, kl_logprobs=torch_only, compute=forced_compute_dtype(), **size, **kwargs))
    note(f"step: {step!r}")
    event("compute", str(step.compute_dtype()).removeprefix("torch."))
    return step


# ----------------------------------------------------------------------------------------------- config layer
@settings(max_examples=examples(5))
@given(sections=raw_config_overrides(), data=st.data())
def test_config_layer_refuses_or_runs(sections: dict, data) -> None:
    try:
        cfg = build_config(sections)
    except ConfigError as error:
        named = [key for section, keys in sections.items() for key in keys if f"{section}.{key}" in str(error)]
        assert named or any(section in str(error) for section in sections), f"the error names no key: {error}"
        return
    # The config is accepted: it must run on the torch path and match the reference.
    if cfg.policy.objective.value in ("clip_cov", "kl_cov"):
        step = data.draw(steps(sections, max_rows=3, max_len=5, low_precision=False))
        P.run_single(step, LossBackend.TORCH)  # runs; the verl reference is the covariance property's
        return
    step = data.draw(steps(sections, max_rows=3, max_len=5, low_precision=False))
    ref = P.reference(step)
    assume(P.representable(step, ref))
    got = P.run_single(step, LossBackend.TORCH)
    P.check_against_reference(step, got, ref, "torch")
    # The Triton backend either implements it or refuses it when the GRPOLoss is built, naming the option.
    missing = fused_unsupported(cfg)
    if missing is not None:
        with pytest.raises(ValueError, match="config: backend TRITON does not implement"):
            GRPOLoss(cfg, backend=LossBackend.TRITON)
    else:
        GRPOLoss(cfg, backend=LossBackend.TRITON)


# ----------------------------------------------------------------------------------------------- one call
def _single_call_matches_reference(backend: LossBackend):
    @needs_property_device()
    @settings(max_examples=examples(_weight(backend)))
    @given(data=st.data())
    def test(data) -> None:
        device = property_device()
        step = data.draw(_step_for(backend))
        ref = P.reference(step)
        assume(P.representable(step, ref))
        got = P.run_single(step, backend, device)
        P.check_against_reference(step, got, ref, backend.value)
        if backend == LossBackend.TRITON:  # the two backends: the same names, the same values
            torch_result = P.run_single(step, LossBackend.TORCH, device)
            compute = step.compute_dtype()
            P.assert_loss_close(got.loss, torch_result.loss, ref[1], compute, "triton vs torch")
            for n in P.LEAVES:
                if got.grads[n] is not None:
                    P.assert_grad_close(got.grads[n], torch_result.grads[n], P.valid_mask(step),
                                        max(step.data[n].dtype, compute, key=P._rtol), f"triton vs torch d/d{n}")
            P.assert_metrics_close(got.metrics, torch_result.metrics, compute, "triton vs torch", scales=ref[2])

    return test


test_single_call_matches_reference_torch = _single_call_matches_reference(LossBackend.TORCH)
test_single_call_matches_reference_triton = _single_call_matches_reference(LossBackend.TRITON)


# ----------------------------------------------------------------------------------------------- layouts
def _split_matches_single_call(backend: LossBackend):
    @needs_property_device()
    @settings(max_examples=examples(_weight(backend)))
    @given(data=st.data())
    def test(data) -> None:
        device = property_device()
        step = data.draw(_step_for(backend))
        split = data.draw(splits(step))
        note(f"split: {split}")
        ref = P.reference(step)
        assume(P.representable(step, ref))
        single = P.run_single(step, backend, device)
        got = P.run_split(step, split, backend, device=device)
        compute = step.compute_dtype()
        rtol = P.RTOL_SPLIT[compute]
        P.assert_loss_close(got.loss, single.loss, ref[1], compute, "split vs one call", rtol=rtol)
        mask = P.valid_mask(step)
        for n in P.LEAVES:
            if single.grads[n] is not None:
                dtype = step.data[n].dtype
                P.assert_grad_close(got.grads[n], single.grads[n], mask, dtype, f"split vs one call d/d{n}",
                                    rtol=max(rtol, P._rtol(dtype)))
        P.assert_metrics_close(got.metrics, single.metrics, compute, "split vs one call", rtol=rtol, scales=ref[2])
        P.check_against_reference(step, got, ref, f"{backend.value} split")

    return test


test_split_matches_single_call_torch = _split_matches_single_call(LossBackend.TORCH)
test_split_matches_single_call_triton = _split_matches_single_call(LossBackend.TRITON)


# ----------------------------------------------------------------------------------------------- covariance
@settings(max_examples=examples(2))
@given(data=st.data())
def test_covariance_objectives_match_verl(data) -> None:
    from tests.reference import verl_actor_loss_reference

    objective = data.draw(st.sampled_from(["clip_cov", "kl_cov"]))
    agg, verl_agg = data.draw(st.sampled_from([("token_mean", "token-mean"),
                                               ("seq_mean_token_mean", "seq-mean-token-mean"),
                                               ("seq_mean_token_sum", "seq-mean-token-sum")]))
    ratio = data.draw(st.sampled_from([0.0002, 0.1, 0.5, 1.0]))
    lb = data.draw(st.sampled_from([-1.0, 0.05, 1.0]))  # never a bound at 0: see below
    ub = lb + data.draw(st.sampled_from([0.5, 5.0]))
    eps_low, eps_high = data.draw(st.sampled_from([0.2, 0.1])), data.draw(st.sampled_from([0.2, 0.28]))
    kl_coef = data.draw(st.sampled_from([0.0, 0.05]))
    estimator, verl_kl = data.draw(st.sampled_from([("k1", "k1"), ("k2", "k2"), ("k3", "low_var_kl")]))
    bonus = data.draw(st.sampled_from([0.0, 0.01]))
    ppo_kl_coef = data.draw(st.sampled_from([0.1, 1.0]))
    sections = {
        "policy": {"objective": objective, "eps_low": eps_low, "eps_high": eps_high, "log_ratio_clamp": None,
                   "clip_cov_ratio": ratio, "clip_cov_lb": lb, "clip_cov_ub": ub, "kl_cov_ratio": ratio,
                   "ppo_kl_coef": ppo_kl_coef},
        "aggregation": {"mode": agg, "count_empty_sequences": True},
        "kl": {"coef": kl_coef, "estimator": estimator,
               **({} if estimator == "k3" else {"input_clamp": None, "output_clamp": None})},
        "entropy": {"bonus_coef": bonus},
    }
    note(f"config: {sections}")
    # verl's means divide by n + 1e-8: a covariance that is exactly 0 (one token; one advantage for all) comes out
    # ±1e-16 there, which decides a bound at 0 and the order of tied tokens (mp_grpo/loss/covariance.py names the
    # difference). Per-token advantages and bounds away from 0 keep the draws free of such ties.
    step = data.draw(steps(sections, max_rows=4, max_len=6, low_precision=False, tie_free=True))
    d = step.data
    seed = data.draw(st.integers(0, 2**31 - 1))
    mask = d["loss_mask"]
    full = dict(d)
    full.setdefault("old_logprobs", d["logprobs"])
    full.setdefault("ref_logprobs", d["logprobs"])
    full.setdefault("entropy", torch.ones_like(d["logprobs"]))
    lp = full["logprobs"].clone().requires_grad_()
    ent = full["entropy"].clone().requires_grad_()
    gen = torch.Generator().manual_seed(seed) if objective == "clip_cov" else None
    cfg = build_config(sections)
    loss, _ = GRPOLoss(cfg)(lp, full["old_logprobs"], full["advantages"], mask, ref_logprobs=full["ref_logprobs"],
                            entropy=ent, generator=gen)
    (loss * step.upstream).backward()
    r_lp = full["logprobs"].clone().requires_grad_()
    r_ent = full["entropy"].clone().requires_grad_()
    adv = full["advantages"] if step.per_token_advantages else full["advantages"].unsqueeze(1).expand_as(r_lp)
    keys = torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    # verl reads every position (it multiplies by the mask): its inputs hold 0 where ours hold junk.
    clean = {k: torch.where(mask, full[k], torch.zeros((), dtype=full[k].dtype)) for k in
             ("old_logprobs", "ref_logprobs")}
    r_lp_in = torch.where(mask, r_lp, torch.zeros((), dtype=r_lp.dtype))
    r_ent_in = torch.where(mask, r_ent, torch.zeros((), dtype=r_ent.dtype))
    adv = torch.where(mask, adv, torch.zeros((), dtype=adv.dtype))
    want = verl_actor_loss_reference(r_lp_in, clean["old_logprobs"], adv, mask, loss_mode=objective,
                                     loss_agg_mode=verl_agg, clip_ratio_low=eps_low, clip_ratio_high=eps_high,
                                     ref_log_prob=clean["ref_logprobs"], kl_loss_coef=kl_coef, kl_loss_type=verl_kl,
                                     entropy=r_ent_in, entropy_coeff=bonus, clip_cov_ratio=ratio, clip_cov_lb=lb,
                                     clip_cov_ub=ub, kl_cov_ratio=ratio, ppo_kl_coef=ppo_kl_coef,
                                     selection_keys=keys)
    note(f"valid inputs: { {k: v[mask].tolist() for k, v in full.items() if k not in ('loss_mask', 'advantages')} }, "
         f"advantages {full['advantages'].tolist()}, keys seed {seed}")
    if not bool(mask.any()):
        assert loss.detach().item() == 0.0
        return
    (want * step.upstream).backward()
    # verl's seq-mean-token-mean divides each row by (n + 1e-8): relative 1e-8 off the exact mean.
    rtol = 1e-10 if agg == "token_mean" else 1e-7
    assert math.isfinite(want.detach().item())
    P.assert_loss_close(loss.detach(), want.detach(), abs(want.detach().item()), torch.float64, "vs verl", rtol=rtol)
    P.assert_grad_close(lp.grad, r_lp.grad, mask, torch.float64, "d/dlogprobs vs verl", rtol=rtol)
    P.assert_grad_close(_grad(ent), _grad(r_ent), mask, torch.float64, "d/dentropy vs verl", rtol=rtol)


def _grad(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x) if x.grad is None else x.grad


# ----------------------------------------------------------------------------------------------- from logits
@needs_property_device()
@settings(max_examples=examples(1.0))
@given(data=st.data())
def test_on_logits_matches_reference_and_the_two_ops(data) -> None:
    """``GRPOLoss.on_logits`` on the fused path (a batch given): the float64 reference of the logits' log-probs and
    entropy (gradient w.r.t. the logits), and the two ops in turn (``vocab_parallel_logprobs`` then the loss):
    the same value, logits gradient and metrics — padded or packed, fp32 or bf16 logits, temperature ≠ 1. On CUDA
    also long rows (more tokens than a fused-loss program takes) and wide vocabularies (several column blocks of
    the log-prob kernels, and the long-row launch configuration past 2**16 columns)."""
    from mp_grpo import vocab_parallel_logprobs
    from mp_grpo.loss import GlobalBatch, PackedSequences

    device = property_device()
    cfg_dict = data.draw(loss_configs("triton"))
    note(f"config: {cfg_dict}")
    shape = data.draw(st.sampled_from(["small", "long", "wide"])) if on_gpu() else "small"
    max_rows, max_len = {"small": (3, 5), "long": (4, 400), "wide": (3, 10)}[shape]
    step = data.draw(steps(cfg_dict, max_rows=max_rows, max_len=max_len, low_precision=False))
    note(f"step: {step!r}")
    cfg = step.cfg
    # M2PO's d on-policy is the kernel's float32 log-probs' (the reference's: the float64 ones): a step-level knife edge
    assume(cfg.m2po.bound is None or "old_logprobs" in step.data)
    vocab = data.draw({"small": st.integers(2, 12), "long": st.integers(2, 64),
                       "wide": st.one_of(st.integers(13, 9000), st.integers(13, 9000),
                                         st.sampled_from([65537, 70001]))}[shape])
    scale = data.draw(st.sampled_from([1.0, 5.0, 30.0]))
    temperature = data.draw(st.sampled_from([1.0, 1.0, 0.7, 2.0]))
    logits_dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16] if on_gpu() else
                                             [torch.float32, torch.float32, torch.bfloat16]))
    packed = data.draw(st.booleans())
    note(f"vocab {vocab}, logits scale {scale} {logits_dtype}, temperature {temperature}, packed {packed}")
    event("logits", str(logits_dtype).removeprefix("torch."))
    event("compute", "float32")  # the loss reads the kernel's float32 log-probs
    gen = torch.Generator().manual_seed(step.notes["seed"])
    d = step.data
    mask = d["loss_mask"]
    B, W = mask.shape
    logits = (torch.randn(B, W, vocab, generator=gen) * scale).to(logits_dtype)
    target = torch.randint(0, vocab, (B, W), generator=gen)
    target = torch.where(mask | (torch.rand(B, W, generator=gen) < 0.5), target, -100)  # ignored only where masked
    inputs = P.inputs_around_logits(step, logits, target, temperature, data.draw(P.logit_spreads(cfg)), gen)
    ref = P.logits_reference(cfg, logits, target, inputs, mask, temperature, step.upstream, topk=step.topk)
    assume(ref.representable)
    layout = None
    if packed:  # the rows back to back, each a segment of the whole width
        layout = PackedSequences(torch.arange(0, B * W + 1, W).to(device))
        logits, target, mask = logits.reshape(B * W, vocab), target.reshape(-1), mask.reshape(-1)
        inputs = {k: v if k == "advantages" and not step.per_token_advantages else v.reshape(-1)
                  for k, v in inputs.items()}
    logits, target, mask = logits.to(device), target.to(device), mask.to(device)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    # the step's account as a training loop builds it from its forward-only pass (log-probs = old when on-policy)
    lp_pass, entropy = vocab_parallel_logprobs(logits, target, with_entropy=True, temperature=temperature)
    # the trust region reads the kernel's float32 log-probs: a divergence within their rounding of δ is a knife edge
    assume(cfg.trust_region.mode.value == "none" or not P.trust_region_at_a_bound(
        cfg, lp_pass.detach().cpu().reshape(B, W), inputs["rollout_logprobs"].cpu().reshape(B, W), mask.cpu().reshape(B, W),
        torch.finfo(torch.float32).eps, step.topk))
    batch = GlobalBatch.from_rollouts(cfg, [mask], old_logprobs=[inputs.get("old_logprobs", lp_pass)],
                                      rollout_logprobs=[inputs["rollout_logprobs"]] if "rollout_logprobs" in inputs
                                      else None, entropies=[entropy], layouts=None if layout is None else [layout],
                                      advantages=[inputs["advantages"]])
    kwargs = {k: inputs.get(k) for k in ("rollout_logprobs", "ref_logprobs")}
    kwargs["topk_logprobs"] = P.topk_for(step, torch.arange(B * W), device)
    loss_fn = GRPOLoss(cfg, backend=LossBackend.TRITON)
    g = step.upstream
    # --- the fused path ---
    x = logits.clone().requires_grad_()
    loss, metrics = loss_fn.on_logits(x, target, inputs.get("old_logprobs"), inputs["advantages"], mask, batch=batch,
                                      layout=layout, temperature=temperature, **kwargs)
    (loss * g).backward()
    # --- the two ops in turn ---
    x2 = logits.clone().requires_grad_()
    out = vocab_parallel_logprobs(x2, target, with_entropy=cfg.needs_entropy, temperature=temperature)
    lp2, ent2 = out if cfg.needs_entropy else (out, None)
    loss2, metrics2 = loss_fn(lp2, inputs.get("old_logprobs"), inputs["advantages"], mask, entropy=ent2, batch=batch,
                              layout=layout, **kwargs)
    (loss2 * g).backward()
    # --- against the float64 reference, and each other ---
    grad = x.grad.cpu().reshape(B, W, vocab)
    P.assert_loss_close(loss.detach().cpu(), ref.loss, ref.size, torch.float32, "on_logits vs reference")
    P.assert_grad_close(grad, ref.grad, ref.grad_mask, logits_dtype, "on_logits d/dlogits vs reference",
                        rtol=max(P._rtol(logits_dtype), 1e-4), atol=ref.grad_atol)
    P.assert_loss_close(loss.detach().cpu(), loss2.detach().cpu(), ref.size, torch.float32, "on_logits vs the two ops")
    P.assert_grad_close(grad, x2.grad.cpu().reshape(B, W, vocab), torch.ones_like(grad, dtype=torch.bool),
                        logits_dtype, "on_logits vs the two ops d/dlogits")
    P.assert_metrics_close(reduce_metrics([metrics]), reduce_metrics([metrics2]), torch.float32,
                           "on_logits vs the two ops")
