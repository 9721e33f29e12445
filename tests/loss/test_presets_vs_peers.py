"""Each preset against its peer's own loss code. TRL presets: against TRL's loss code, re-written in float64 in tests/reference.py
(``trl_grpo_loss_reference``: huggingface/trl f2cd577, trl/trainer/grpo_trainer.py ``_compute_loss``,
``get_gamma_weights`` and the vLLM IS ratio of ``_generate_and_score_completions``; Liger-Kernel 0.8.5
src/liger_kernel/chunked_loss/grpo_loss.py computes the same): one micro-batch, one process.

Realistic inputs: the preset as shipped equals TRL (its ±20 clamps never bind). Inputs beyond the clamps
(|log-ratio| and |ref − log π| up to ~60): the preset plus the overrides its file states
(``policy.log_ratio_clamp=null``, ``kl.input_clamp=null``) equals TRL, and the preset as shipped does not
wherever a clamp binds on a term that is not clipped anyway.

verl presets (``verl_ppo``, and ``gspo`` with verl's overrides) against ``verl_actor_loss_reference`` (verl
b178a3c core_algos.py); ``nemo_rl_grpo`` against ``nemo_rl_clipped_pg_loss_reference`` (NeMo-RL 7ea279a
nemo_rl/algorithms/loss/loss_functions.py), each with realistic inputs and beyond the clamps."""

from __future__ import annotations

import pytest
import torch

from mp_grpo.config import load_config, preset_path
from mp_grpo.loss import GRPOLoss
from tests.loss.helpers import make_batch
from tests.reference import nemo_rl_clipped_pg_loss_reference, trl_grpo_loss_reference, verl_actor_loss_reference
from tests.tolerances import assert_close

LENGTHS = [5, 3, 0, 6, 1, 4]
T = 7
EXACT = ["policy.log_ratio_clamp=null", "kl.input_clamp=null"]

# preset → (TRL GRPOConfig arguments, extra mp_grpo overrides for the same run)
CASES: dict[str, tuple[str, dict, list[str]]] = {
    "grpo": ("trl_grpo", dict(loss_type="grpo"), []),
    "grpo_kl_bias": ("trl_grpo", dict(loss_type="grpo", beta=0.04, use_bias_correction_kl=True),
                     ["kl.coef=0.04", "kl.bias_correction=true"]),
    "grpo_entropy_bonus": ("trl_grpo", dict(loss_type="grpo", entropy_coef=0.03),
                           ["entropy.bonus_coef=0.03", "aggregation.regularizer_mode=token_mean"]),
    "dapo": ("trl_dapo", dict(loss_type="dapo", epsilon_high=0.28), []),
    "dapo_top_entropy_bonus_kl": (
        "trl_dapo", dict(loss_type="dapo", epsilon_high=0.28, top_entropy_quantile=0.4, entropy_coef=0.05, beta=0.02),
        ["entropy.top_quantile=0.4", "entropy.bonus_coef=0.05", "entropy.bonus_on_selected=true", "kl.coef=0.02"]),
    "dapo_token_truncate": ("trl_dapo", dict(loss_type="dapo", epsilon_high=0.28, vllm_importance_sampling_mode=
                                             "token_truncate", vllm_importance_sampling_clip_min=0.5),
                            ["rollout_correction.reject_level=null", "rollout_correction.reject_max=null",
                             "rollout_correction.weight_level=token", "rollout_correction.weight_min=0.5",
                             "rollout_correction.weight_max=3.0"]),
    "dr_grpo": ("trl_dr_grpo", dict(loss_type="dr_grpo", max_completion_length=512), []),
    "cispo": ("trl_cispo", dict(loss_type="cispo", epsilon_high=5.0), []),
    "sapo": ("trl_sapo", dict(loss_type="sapo"), []),
    "vespo": ("trl_vespo", dict(loss_type="vespo", vllm_importance_sampling_mode="token_truncate"), []),
    "vespo_token_mask_kl": (
        "trl_vespo", dict(loss_type="vespo", vllm_importance_sampling_mode="token_mask",
                          vllm_importance_sampling_clip_min=0.8, vllm_importance_sampling_clip_max=1.25, beta=0.04),
        ["rollout_correction.weight_max=null", "rollout_correction.reject_level=token", "rollout_correction.reject_min=0.8",
         "rollout_correction.reject_max=1.25", "kl.coef=0.04"]),
    "luspo": ("trl_luspo", dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=2e-3,
                                epsilon_high=2.5e-3), []),
    "gspo_no_vllm_kl_bias": (
        "gspo", dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4,
                     beta=0.04, use_bias_correction_kl=True),
        ["aggregation.count_empty_sequences=true", "kl.coef=0.04", "kl.bias_correction=true",
         "kl.bias_correction_level=geometric", "kl.output_clamp=null"]),
    # DeepSeek-V3.2's OPSM + unbiased KL as TRL implements them (loss_type="grpo": every row counted)
    "deepseek_v32_opsm_no_vllm": (
        "deepseek_v32", dict(loss_type="grpo", beta=0.001, use_bias_correction_kl=True, off_policy_mask_threshold=0.05),
        ["opsm.delta=0.05", "aggregation.count_empty_sequences=true", "kl.output_clamp=null"]),
    "dapo_opsm_vllm": ("trl_dapo", dict(loss_type="dapo", epsilon_high=0.28, off_policy_mask_threshold=0.02),
                       ["opsm.delta=0.02"]),
}
NO_VLLM = {"gspo_no_vllm_kl_bias", "deepseek_v32_opsm_no_vllm"}


def _batch(seed: int, far: bool) -> dict[str, torch.Tensor]:
    batch = make_batch(seed, LENGTHS, T, garbage=False)  # TRL multiplies by the mask: finite padding
    if far:
        mask = batch["loss_mask"]
        gen = torch.Generator().manual_seed(seed + 1)
        for name, scale in (("old_logprobs", 20.0), ("rollout_logprobs", 0.5), ("ref_logprobs", 25.0)):
            shift = torch.randn(mask.shape, generator=gen, dtype=torch.float64) * scale
            batch[name] = torch.where(mask, batch[name] + shift, batch[name])
    return batch


def _ours(cfg, batch, vllm: bool):
    lp = batch["logprobs"].clone().requires_grad_()
    ent = batch["entropy"].clone().requires_grad_()
    loss, _ = GRPOLoss(cfg)(lp, batch["old_logprobs"], batch["advantages"], batch["loss_mask"],
                            rollout_logprobs=batch["rollout_logprobs"] if vllm else None,
                            ref_logprobs=batch["ref_logprobs"], entropy=ent)
    loss.backward()
    return loss.detach(), lp.grad, torch.zeros_like(ent) if ent.grad is None else ent.grad


def _trl(kwargs, batch, vllm: bool):
    lp = batch["logprobs"].clone().requires_grad_()
    ent = batch["entropy"].clone().requires_grad_()
    loss = trl_grpo_loss_reference(
        lp, batch["old_logprobs"], batch["advantages"], batch["loss_mask"],
        ref_per_token_logps=batch["ref_logprobs"], entropies=ent,
        sampling_per_token_logps=batch["rollout_logprobs"] if vllm else None, **kwargs)
    loss.backward()
    zeros = torch.zeros_like(batch["entropy"])
    return loss.detach(), lp.grad, zeros if ent.grad is None else ent.grad


@pytest.mark.parametrize("far", [False, True], ids=["realistic", "beyond_clamps"])
@pytest.mark.parametrize("case", list(CASES))
def test_preset_matches_trl(case: str, far: bool) -> None:
    preset, kwargs, overrides = CASES[case]
    vllm = case not in NO_VLLM
    batch = _batch(sum(map(ord, case)), far)
    cfg = load_config(preset_path(preset), overrides + (EXACT if far else []))
    loss, g_lp, g_ent = _ours(cfg, batch, vllm)
    want, w_lp, w_ent = _trl(kwargs, batch, vllm)
    assert torch.isfinite(want), "the reference must be finite for the comparison to mean anything"
    assert_close(loss, want, torch.float64, f"{case} loss")
    assert_close(g_lp, w_lp, torch.float64, f"{case} d/dlogprobs")
    assert_close(g_ent, w_ent, torch.float64, f"{case} d/dentropy")


@pytest.mark.parametrize("case", ["grpo_kl_bias", "vespo_token_mask_kl"])
def test_clamps_bind_beyond_them(case: str) -> None:
    """The overrides matter: as shipped, the ±20 KL input clamp changes the loss on those inputs."""
    preset, kwargs, overrides = CASES[case]
    batch = _batch(sum(map(ord, case)), far=True)
    loss, _, _ = _ours(load_config(preset_path(preset), overrides), batch, True)
    want, _, _ = _trl(kwargs, batch, True)
    assert not torch.allclose(loss, want, rtol=1e-6)


def _ours_per_token(cfg, batch, *, rollout=False, kl_logprobs=None, positive=None):
    lp = batch["logprobs"].clone().requires_grad_()
    ent = batch["entropy"].clone().requires_grad_()
    kl_lp = None if kl_logprobs is None else kl_logprobs.clone().requires_grad_()
    loss, _ = GRPOLoss(cfg)(lp, batch["old_logprobs"], batch["advantages"], batch["loss_mask"],
                            rollout_logprobs=batch["rollout_logprobs"] if rollout else None,
                            ref_logprobs=batch["ref_logprobs"], entropy=ent, kl_logprobs=kl_lp, positive=positive)
    loss.backward()
    grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in (lp, ent) + (() if kl_lp is None else (kl_lp,))]
    return loss.detach(), grads


VERL_SEQ_MEAN_RTOL = 1e-7
"""verl's seq-mean-token-mean divides by (n + 1e-8): relative 1e-8 / n off the exact mean mp_grpo takes."""

# verl: (preset, overrides, verl arguments, far-input overrides)
VERL_CASES = {
    "ppo": ("verl_ppo", [], dict(), []),
    "ppo_low_var_kl_entropy": ("verl_ppo", ["kl.coef=0.05", "entropy.bonus_coef=0.01"],
                               dict(kl_loss_coef=0.05, entropy_coeff=0.01), []),
    "ppo_k2_seq_mean": ("verl_ppo", ["kl.coef=0.05", "kl.estimator=k2", "aggregation.mode=seq_mean_token_mean",
                                     "aggregation.count_empty_sequences=true"],
                        dict(kl_loss_coef=0.05, kl_loss_type="k2", loss_agg_mode="seq-mean-token-mean"),
                        ["kl.input_clamp=null", "kl.output_clamp=null"]),
    "ppo_k1": ("verl_ppo", ["kl.coef=0.05", "kl.estimator=k1"], dict(kl_loss_coef=0.05, kl_loss_type="k1"),
               ["kl.input_clamp=null", "kl.output_clamp=null"]),
    "gspo_token_tis_kl": (
        "gspo", ["policy.gspo_gradient=token", "aggregation.count_empty_sequences=true",
                 "aggregation.regularizer_mode=token_mean", "kl.coef=0.05", "kl.estimator=k3",
                 "rollout_correction.weight_level=token", "rollout_correction.weight_max=2.0"],
        dict(loss_mode="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4, kl_loss_coef=0.05, rollout_is=2.0), []),
}


@pytest.mark.parametrize("far", [False, True], ids=["realistic", "beyond_clamps"])
@pytest.mark.parametrize("case", list(VERL_CASES))
def test_preset_matches_verl(case: str, far: bool) -> None:
    preset, overrides, kwargs, exact = VERL_CASES[case]
    kwargs = dict(kwargs)
    if far and case == "gspo_token_tis_kl":
        pytest.skip("verl clamps GSPO's sequence log-ratio at 10 from above, mp_grpo each token's at ±20 (stated)")
    batch = _batch(sum(map(ord, case)) + 7, far)
    mask = batch["loss_mask"]
    cfg = load_config(preset_path(preset), overrides + (exact if far else []))
    rollout = kwargs.pop("rollout_is", None)
    is_weights = None
    if rollout is not None:  # verl's token TIS weight: exp(old − rollout) truncated, detached
        d = torch.where(mask, batch["old_logprobs"] - batch["rollout_logprobs"], torch.zeros(()))
        is_weights = torch.exp(d).clamp(max=rollout)
    loss, (g_lp, g_ent) = _ours_per_token(cfg, batch, rollout=rollout is not None)
    lp = batch["logprobs"].clone().requires_grad_()
    ent = batch["entropy"].clone().requires_grad_()
    adv = batch["advantages"].unsqueeze(1).expand_as(lp)
    want = verl_actor_loss_reference(lp, batch["old_logprobs"], adv, mask, ref_log_prob=batch["ref_logprobs"],
                                     entropy=ent, rollout_is_weights=is_weights, **kwargs)
    want.backward()
    w_ent = torch.zeros_like(ent) if ent.grad is None else ent.grad
    if "seq_mean" in case or "gspo" in case:
        # verl's seq-mean-token-mean divides each row by (its token count + 1e-8): a relative 1e-8 / n.
        for got, exp, what in ((loss, want, "loss"), (g_lp, lp.grad, "d/dlogprobs"), (g_ent, w_ent, "d/dentropy")):
            torch.testing.assert_close(got, exp.detach(), rtol=VERL_SEQ_MEAN_RTOL, atol=1e-12, msg=f"{case} {what}")
        return
    assert_close(loss, want, torch.float64, f"{case} loss")
    assert_close(g_lp, lp.grad, torch.float64, f"{case} d/dlogprobs")
    assert_close(g_ent, w_ent, torch.float64, f"{case} d/dentropy")


@pytest.mark.parametrize("far", [False, True], ids=["realistic", "beyond_clamps"])
@pytest.mark.parametrize("unfiltered", [False, True], ids=["filtered_none", "kl_logprobs"])
@pytest.mark.parametrize("vapo", [False, True], ids=["", "positive_nll"])
def test_nemo_rl_preset_matches_nemo_rl(far: bool, unfiltered: bool, vapo: bool) -> None:
    """Beyond the clamps: the PPO log-ratio far beyond ±20 (NeMo-RL does not clamp it:
    policy.log_ratio_clamp=null); the KL input stays inside its clamp (where it binds NeMo-RL detaches the
    score-function weight and mp_grpo does not — a stated difference)."""
    batch = make_batch(21 + unfiltered, LENGTHS, T, garbage=False)
    mask = batch["loss_mask"]
    if far:
        shift = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 25
        batch["old_logprobs"] = torch.where(mask, batch["old_logprobs"] + shift, batch["old_logprobs"])
    kl_lp = torch.where(mask, batch["logprobs"] + 0.2, batch["logprobs"]) if unfiltered else None
    rewards = torch.tensor([1.0, -0.5, 0.0, 2.0, 0.3, -1.0], dtype=torch.float64)
    overrides = (["policy.log_ratio_clamp=null"] if far else []) + (["nll.positive_coef=0.1"] if vapo else [])
    cfg = load_config(preset_path("nemo_rl_grpo"), overrides)
    loss, grads = _ours_per_token(cfg, batch, kl_logprobs=kl_lp, positive=rewards > 0 if vapo else None)
    lp = batch["logprobs"].clone().requires_grad_()
    unf = None if kl_lp is None else kl_lp.clone().requires_grad_()
    adv = batch["advantages"].unsqueeze(1).expand_as(lp)
    want = nemo_rl_clipped_pg_loss_reference(lp, batch["old_logprobs"], adv, mask,
                                             reference_policy_logprobs=batch["ref_logprobs"],
                                             curr_logprobs_unfiltered=unf, reference_policy_kl_penalty=0.01,
                                             positive_example_nll_weight=0.1 if vapo else 0.0, rewards=rewards)
    want.backward()
    assert torch.isfinite(want)
    assert_close(loss, want, torch.float64, "loss")
    assert_close(grads[0], lp.grad, torch.float64, "d/dlogprobs")
    if unf is not None:
        assert_close(grads[2], unf.grad, torch.float64, "d/dkl_logprobs")
