"""Random GRPO micro-batches for the loss tests (shared by the single-process and torchrun tests)."""

from __future__ import annotations

import torch

from mp_grpo.config import load_config


def make_batch(seed: int, lengths: list[int], T: int, *, dtype: torch.dtype = torch.float64,
               per_token_advantages: bool = False, garbage: bool = True) -> dict[str, torch.Tensor]:
    """A padded batch: row b has ``lengths[b]`` valid tokens at its start; masked positions hold inf/NaN."""
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    mask = torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    logprobs = -rnd(B, T).abs() - 0.1
    old = logprobs + rnd(B, T, scale=0.15)
    rollout = old + rnd(B, T, scale=0.15)
    ref = logprobs + rnd(B, T, scale=0.3)
    entropy = torch.rand(B, T, generator=gen, dtype=torch.float64) * 2
    advantages = rnd(B, T) if per_token_advantages else rnd(B)
    out = {"logprobs": logprobs, "old_logprobs": old, "rollout_logprobs": rollout, "ref_logprobs": ref,
           "entropy": entropy, "advantages": advantages, "loss_mask": mask}
    if garbage:  # masked positions may hold anything: the loss must never read them
        junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e4], dtype=torch.float64)
        pick = torch.randint(0, 4, (B, T), generator=gen)
        for name in ("logprobs", "old_logprobs", "rollout_logprobs", "ref_logprobs", "entropy"):
            out[name] = torch.where(mask, out[name], junk[pick])
        if per_token_advantages:
            out["advantages"] = torch.where(mask, out["advantages"], junk[pick])
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in out.items()}


# Configurations covering every objective, aggregation mode and correction (dotlist overrides).
FEATURE_CONFIGS: dict[str, list[str]] = {
    "ppo_dual_delta": ["policy.dual_clip_c=1.05", "policy.delta=1.05", "policy.eps_high=0.28"],
    "gspo_seq_is_geo_reject": ["policy.objective=gspo", "policy.eps_low=0.01", "policy.eps_high=0.02",
                               "rollout_correction.weight_level=sequence", "rollout_correction.weight_max=2.0",
                               "rollout_correction.reject_level=geometric", "rollout_correction.reject_min=0.9",
                               "rollout_correction.reject_max=1.1"],
    "gmpo": ["policy.objective=gmpo", "policy.eps_low=0.1", "policy.eps_high=0.1"],
    "cispo_tis_normalized": ["policy.objective=cispo", "policy.eps_low=null", "policy.eps_high=0.1",
                             "rollout_correction.weight_level=token", "rollout_correction.weight_max=1.1",
                             "rollout_correction.weight_min=0.95", "rollout_correction.normalize_weights=true"],
    "sapo_entropy_kl": ["policy.objective=sapo", "entropy.top_quantile=0.4", "entropy.bonus_coef=0.01",
                        "kl.coef=0.05", "kl.bias_correction=true"],
    "reinforce_opsm_skip": ["policy.objective=reinforce", "opsm.delta=0.05", "mismatch.skip_threshold=0.5"],
    "ppo_seq_reject_kl_st": ["rollout_correction.reject_level=sequence", "rollout_correction.reject_max=1.2",
                             "rollout_correction.weight_level=geometric", "rollout_correction.normalize_weights=true",
                             "mismatch.skip_threshold=10.0", "kl.coef=0.1", "kl.straight_through=true",
                             "aggregation.count_empty_sequences=true"],
    "ppo_score_kl_k2": ["kl.coef=0.1", "kl.estimator=k2", "kl.score_function=true", "opsm.delta=0.0"],
}

# The divergence trust region and M2PO (the property tests and tests/loss/test_trust_region*.py, test_m2po.py cover
# them on every path; these run where a feature needs a real multi-rank step or a compiler: the layout-invariance
# torchrun cases, the sm_90 compile, from_counts).
DIVERGENCE_FEATURES: dict[str, list[str]] = {
    "dppo_kl_m2po": ["policy.eps_low=null", "policy.eps_high=null", "trust_region.mode=binary_kl",
                     "trust_region.delta_low=0.02", "trust_region.delta_high=0.01", "m2po.bound=0.01",
                     "rollout_correction.weight_level=token"],
}

# Options only the torch path implements (mp_grpo.loss.fused_unsupported): LossBackend.AUTO routes them to
# it; the fused-path tests do not run them.
TORCH_ONLY_FEATURES: dict[str, list[str]] = {
    "vespo": ["policy.objective=vespo"],
    "vespo_token_tis_mask": ["policy.objective=vespo", "policy.vespo_k_neg=1.5", "policy.vespo_lambda_pos=0.5",
                             "rollout_correction.weight_level=token", "rollout_correction.weight_max=1.1",
                             "rollout_correction.weight_min=0.9", "rollout_correction.reject_level=token",
                             "rollout_correction.reject_min=0.8", "rollout_correction.reject_max=1.2"],
    "gspo_token_tis_kl_geo": ["policy.objective=gspo", "policy.gspo_gradient=token", "policy.eps_low=0.01",
                              "policy.eps_high=0.02", "rollout_correction.weight_level=token",
                              "rollout_correction.weight_max=1.05", "kl.coef=0.1", "kl.bias_correction=true",
                              "kl.bias_correction_level=geometric"],
    "sapo_reg_token_mean": ["policy.objective=sapo", "aggregation.regularizer_mode=token_mean", "kl.coef=0.1",
                            "entropy.bonus_coef=0.02", "kl.bias_correction=true", "kl.bias_correction_level=sequence"],
    "ppo_entropy_selected": ["entropy.top_quantile=0.5", "entropy.bonus_coef=0.03", "entropy.bonus_on_selected=true",
                             "kl.coef=0.05", "kl.score_function=true"],
}

AGGREGATIONS: dict[str, list[str]] = {
    "token_mean": ["aggregation.mode=token_mean"],
    "seq_mean_token_mean": ["aggregation.mode=seq_mean_token_mean"],
    "seq_mean_token_sum": ["aggregation.mode=seq_mean_token_sum"],
    "seq_mean_token_sum_norm": ["aggregation.mode=seq_mean_token_sum_norm", "aggregation.norm_constant=7"],
}


def config(feature: str, aggregation: str):
    overrides = FEATURE_CONFIGS[feature] if feature in FEATURE_CONFIGS else TORCH_ONLY_FEATURES[feature]
    return load_config(None, overrides + AGGREGATIONS[aggregation])

