"""The parity cases: verl 0.9.1's own loss modes against ``mp_grpo:<preset>`` (or a config registered for the
test) where the two define the same loss. Each case: verl's ActorConfig arguments for its own mode, the mp_grpo
loss mode, the config registered under it when it is not a shipped preset, the ``rollout_is_weights`` verl
hands both (None, token or sequence level), and whether their gradients agree to the last bit (the losses agree to
fp32 rounding: mp_grpo divides each token's term by the global count before the sum, verl after it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Case:
    verl: dict
    """verl's ActorConfig arguments (``loss_mode`` among them) for verl's own loss."""
    ours: str
    """The mp_grpo loss mode."""
    overrides: tuple[str, ...] | None = None
    """For a test-registered mode: (preset, *dotlist overrides) of its config."""
    weights: str | None = None
    """``rollout_is_weights``: None, "token" or "sequence"."""
    exact: bool = False
    """The gradients agree bit for bit (else to fp32 rounding); the losses always to fp32 rounding."""
    shared: dict = field(default_factory=dict)
    """ActorConfig arguments both runs take (verl's KL / entropy terms, aggregation)."""


CASES: dict[str, Case] = {
    # vanilla PPO (dual clip c = 3, |ℓ| ≤ 20): the verl_ppo preset
    "vanilla": Case({"loss_mode": "vanilla"}, "mp_grpo:verl_ppo", exact=True),
    "vanilla_kl_entropy": Case({"loss_mode": "vanilla"}, "mp_grpo:verl_ppo", exact=True,
                               shared={"use_kl_loss": True, "kl_loss_coef": 0.05, "entropy_coeff": 0.01}),
    "vanilla_token_is": Case({"loss_mode": "vanilla"}, "mp_grpo:verl_ppo", weights="token", exact=True),
    "vanilla_seq_mean_token_sum": Case(
        {"loss_mode": "vanilla"}, "mp_grpo:test_ppo_seq_sum",
        ("verl_ppo", "aggregation.mode=seq_mean_token_sum"), exact=True, shared={"loss_agg_mode": "seq-mean-token-sum"}),
    "vanilla_seq_mean_token_sum_norm": Case(
        {"loss_mode": "vanilla"}, "mp_grpo:test_ppo_sum_norm",
        ("verl_ppo", "aggregation.mode=seq_mean_token_sum_norm", "aggregation.norm_constant=8"), exact=True,
        shared={"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 8}),
    # TRL presets with verl's own rollout correction in place of their rollout_correction section
    "dapo": Case({"loss_mode": "vanilla", "clip_ratio_high": 0.28}, "mp_grpo:trl_dapo", weights="token",
                 exact=True),
    "grpo": Case({"loss_mode": "vanilla"}, "mp_grpo:trl_grpo", weights="sequence", exact=True,
                 shared={"loss_agg_mode": "seq-mean-token-mean"}),
    "dr_grpo": Case({"loss_mode": "vanilla"}, "mp_grpo:trl_dr_grpo", weights="sequence", exact=True,
                    shared={"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 512}),
    "cispo": Case({"loss_mode": "cispo", "clip_ratio_low": 1.0, "clip_ratio_high": 4.0}, "mp_grpo:trl_cispo",
                  weights="token", exact=True),
    # Not bit-equal: mp_grpo takes the gate's derivative as e/(1 + e)², e = e^−|x| (verl: torch.sigmoid's y·(1 − y), 0
    # once y rounds to 1): the same to fp32 rounding.
    "sapo": Case({"loss_mode": "sapo"}, "mp_grpo:trl_sapo", weights="token",
                 shared={"loss_agg_mode": "seq-mean-token-mean"}),
    "luspo": Case({"loss_mode": "gspo", "clip_ratio_low": 2e-3, "clip_ratio_high": 2.5e-3}, "mp_grpo:trl_luspo",
                  weights="sequence", exact=True, shared={"loss_agg_mode": "seq-mean-token-sum"}),
    # GSPO (verl: GSPO-token; the preset: the sequence gradient — the same with per-sequence advantages)
    "gspo": Case({"loss_mode": "gspo", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}, "mp_grpo:gspo",
                 shared={"loss_agg_mode": "seq-mean-token-mean"}),
    # verl's covariance objectives (clip_cov with ratio 1: every candidate is zeroed, no random draw)
    "clip_cov": Case({"loss_mode": "clip_cov", "clip_cov_ratio": 1.0}, "mp_grpo:test_clip_cov",
                     ("verl_clip_cov", "policy.clip_cov_ratio=1.0"), exact=True),
    "kl_cov": Case({"loss_mode": "kl_cov"}, "mp_grpo:verl_kl_cov", exact=True),
    # verl's gpg is REINFORCE: −A·log π
    "gpg": Case({"loss_mode": "gpg"}, "mp_grpo:test_reinforce", ("verl_ppo", "policy.objective=reinforce",
                                                                  "policy.dual_clip_c=null"), exact=True),
}


def register_test_configs() -> None:
    """Register the test-only loss modes of :data:`CASES` (in every process that runs them)."""
    from mp_grpo.config import load_config
    from mp_grpo.integrations.verl import register

    for case in CASES.values():
        if case.overrides is not None:
            register(case.ours, load_config(case.overrides[0], list(case.overrides[1:])))
