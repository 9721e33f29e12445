"""MPGRPOLossFn against NeMo-RL's own ClippedPGLossFn, on NeMo-RL's code (skipped without its source).

One step of two micro-batches with NeMo-RL's global counts: the summed loss, each micro-batch's gradient and
every metric NeMo-RL reports agree to fp32 rounding. ``policy.log_ratio_clamp=null``: NeMo-RL does not clamp the
PPO log-ratio (the preset's one stated difference that the "far" inputs reach).
"""

from __future__ import annotations

import pytest
import torch

from mp_grpo.integrations.nemo_rl import InputType, MPGRPOLossFn
from tests.integrations.nemo_rl.helpers import data_dict, global_counts, nemo_rl_or_skip
from tests.tolerances import assert_close

EXACT = ["policy.log_ratio_clamp=null"]

# case → (NeMo-RL ClippedPGLossConfig fields, mp_grpo overrides of the nemo_rl_grpo preset)
CASES = {
    "grpo": ({}, []),
    "dual_clip_clip_higher": (dict(ratio_clip_c=3.0, ratio_clip_max=0.28), ["policy.dual_clip_c=3.0", "policy.eps_high=0.28"]),
    "tis": (dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis",
                 truncated_importance_sampling_ratio=2.0),
            ["rollout_correction.weight_level=token", "rollout_correction.weight_max=2.0"]),
    "k2_no_kl_clamps": (dict(reference_policy_kl_type="k2", kl_input_clamp_value=None, kl_output_clamp_value=None),
                        ["kl.estimator=k2", "kl.input_clamp=null", "kl.output_clamp=null"]),
    "sequence_level": (dict(token_level_loss=False), ["aggregation.mode=seq_mean_token_mean", "aggregation.count_empty_sequences=true"]),
    "vapo": (dict(positive_example_nll_weight=0.1), ["nll.positive_coef=0.1"]),
}
SKIP_METRICS = {"is_oob_ratio"}  # NeMo-RL's TIS out-of-bounds fraction: not reported by mp_grpo


def _micro_batches(seed: int, far: bool):
    mbs = [data_dict(seed, [9, 6, 8], [3, 2, 4], 10, sample_mask=[1.0, 1.0, 0.0], far=far),
           data_dict(seed + 1, [10, 5, 1], [2, 3, 1], 10, far=far)]
    for mb in mbs:
        mb["rewards"] = torch.tensor([1.0, -0.5, 0.3])
    return mbs


def _run(loss_fn, mbs, counts, batched):
    seqs, toks = counts
    total, grads, metrics = 0.0, [], []
    for mb in mbs:
        data = batched({k: v for k, v in mb.items() if k != "_current"})
        lp = mb["_current"][:, 1:].clone().requires_grad_()
        loss, m = loss_fn(next_token_logprobs=lp, data=data, global_valid_seqs=seqs, global_valid_toks=toks)
        loss.backward()
        total = total + loss.detach()
        grads.append(lp.grad)
        metrics.append(m)
    return total, grads, metrics


@pytest.mark.parametrize("far", [False, True], ids=["realistic", "far_log_ratio"])
@pytest.mark.parametrize("case", list(CASES))
def test_logprob_input_matches_clipped_pg_loss(case: str, far: bool) -> None:
    loss_mod = nemo_rl_or_skip()
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    nemo_kwargs, overrides = CASES[case]
    mbs = _micro_batches(sum(map(ord, case)), far)
    counts = global_counts(*mbs)
    nemo = loss_mod.ClippedPGLossFn(loss_mod.ClippedPGLossConfig(**nemo_kwargs))
    ours = MPGRPOLossFn("nemo_rl_grpo", overrides=overrides + EXACT)
    assert ours.loss_type == nemo.loss_type and ours.input_type == nemo.input_type  # NeMo-RL's own enums
    want, want_grads, want_metrics = _run(nemo, mbs, counts, BatchedDataDict)
    got, got_grads, got_metrics = _run(ours, mbs, counts, BatchedDataDict)
    assert torch.isfinite(want)
    assert_close(got, want, torch.float32, f"{case} loss")
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        assert_close(g, w, torch.float32, f"{case} d/dlogprobs of micro-batch {i}")
    for i, (g, w) in enumerate(zip(got_metrics, want_metrics)):
        skip = SKIP_METRICS | ({"kl_penalty"} if case == "sequence_level" else set())  # stated difference
        assert set(w) - skip <= set(g), f"keys NeMo-RL reports that we do not: {set(w) - skip - set(g)}"
        for key in sorted(set(w) - skip):
            assert_close(torch.tensor(g[key]), torch.tensor(float(w[key])), torch.float32, f"{case} metric {key} [{i}]")
    assert set(ours.metric_normalizations) >= set(got_metrics[0])


def test_logit_input_matches_nemo_rl_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The logit input (TP = CP = 1) against NeMo-RL's own path: its prepare_loss_input turns the logits into
    log-probs, then ClippedPGLossFn; the loss and d/dlogits agree. (NeMo-RL's non-parallel path moves the targets
    with ``.cuda()``: on a machine without CUDA the test makes that the identity.)"""
    loss_mod = nemo_rl_or_skip()
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    from nemo_rl.algorithms.loss.utils import prepare_loss_input
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from mp_grpo.megatron.groups import ParallelGroups

    mbs = _micro_batches(5, far=False)
    seqs, toks = global_counts(*mbs)
    nemo = loss_mod.ClippedPGLossFn(loss_mod.ClippedPGLossConfig())
    ours = MPGRPOLossFn("nemo_rl_grpo", overrides=EXACT, input_type=InputType.LOGIT, groups=ParallelGroups())
    gen = torch.Generator().manual_seed(0)
    for i, mb in enumerate(mbs):
        data = BatchedDataDict({k: v for k, v in mb.items() if k != "_current"})
        logits = torch.randn(*mb["input_ids"].shape, 11, generator=gen)
        x = logits.clone().requires_grad_()
        inputs, data_n = prepare_loss_input(x, data, nemo)
        want, want_m = nemo(data=data_n, global_valid_seqs=seqs, global_valid_toks=toks, **inputs)
        want.backward()
        y = logits.clone().requires_grad_()
        got, got_m = ours(data=data, global_valid_seqs=seqs, global_valid_toks=toks, logits=y)
        got.backward()
        assert_close(got, want, torch.float32, f"loss [{i}]")
        assert_close(y.grad, x.grad, torch.float32, f"d/dlogits [{i}]")
        for key in ("loss", "probs_ratio", "probs_ratio_min", "probs_ratio_max", "kl_penalty", "token_mult_prob_error",
                    "gen_kl_error", "policy_kl_error", "js_divergence_error", "sampling_importance_ratio",
                    "num_valid_samples"):
            assert_close(torch.tensor(got_m[key]), torch.tensor(float(want_m[key])), torch.float32, f"metric {key} [{i}]")
