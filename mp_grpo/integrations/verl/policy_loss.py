"""An mp_grpo LossConfig as a verl policy loss: ``fn(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, rollout_is_weights=None) -> (loss, metrics)`` (verl ``core_algos.PolicyLossFn``).

What verl hands a policy loss, per micro-batch (``verl.workers.utils.losses.ppo_loss``): padded ``[B, T]``
log-probs (temperature applied, context parallelism already gathered), per-token advantages, the response
mask, the actor config whose ``global_batch_info`` holds the step's counts — ``dp_size``, ``batch_num_tokens``
(valid tokens over the DP group), ``global_batch_size`` (every sequence of the mini-batch), ``loss_scale_factor``
— and, when verl's own ``algorithm.rollout_correction`` is on, per-token ``rollout_is_weights``. verl adds the
KL and entropy terms itself, outside the policy loss, aggregated with ``actor.loss_agg_mode``.

Schedule of :meth:`VerlPolicyLoss.__call__`
    1. Check that verl's ``loss_agg_mode`` is the config's (verl aggregates its KL and entropy with it), and
       ``loss_scale_factor`` its ``norm_constant`` in seq_mean_token_sum_norm.
    2. The rollout correction: verl's ``rollout_is_weights`` in place of the config's ``rollout_correction``
       section (which needs rollout log-probs verl does not hand a loss); a section without weights is refused.
    3. The step's account from verl's counts: ``GlobalBatch.from_counts(valid_tokens=batch_num_tokens,
       all_sequences=global_batch_size)`` — S is every sequence of the mini-batch, verl's meaning — or, without
       counts and with ``dp_size`` 1, this micro-batch alone (verl's fallback: its valid tokens and sequences).
    4. :class:`~mp_grpo.GRPOLoss` on the micro-batch; the returned loss is its share × ``dp_size`` (verl's
       convention: DP averages gradients). No collective.
    5. Metrics in verl's form (one host read): ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``
       as this micro-batch's means (verl averages them over micro-batches and ranks), and every mean metric of
       the loss as ``actor/mp_grpo/<name>``. Then :func:`mp_grpo.check_errors` raises any input error recorded
       on the device since the last call (a micro-batch beyond the counts, a bad target in the LM-head kernel):
       verl's loop has no other mp_grpo sync point.

What a config may hold (:func:`verl_refusals` names what it may not, and why): every objective (vespo
without IS weights), every aggregation mode but verl's ``token-sum``, OPSM (measured against the old
log-probs: verl's rollout log-probs do not reach the loss). Not: its own KL or entropy terms (verl adds
them: ``actor.use_kl_loss`` / ``kl_loss_coef`` / ``kl_loss_type``, ``actor.entropy_coeff`` — counting them
twice is impossible by construction), the top-entropy selection, the VAPO NLL term, the mismatch skip.
verl's own policy-loss knobs (``clip_ratio*``, ``clip_ratio_c``, ``tau_*``, ``policy_loss.clip_cov_*`` …) are
not read: the config defines the policy loss, as each of verl's loss modes reads only its own knobs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from mp_grpo.config.loss import Aggregation, LossConfig, Objective, RolloutCorrectionConfig, TrustRegion
from mp_grpo.loss import GlobalBatch, GRPOLoss
from mp_grpo.loss.clamps import symmetric_clamp
from mp_grpo.ops.checks import check_errors

VERL_AGGREGATIONS: dict[str, Aggregation] = {
    "token-mean": Aggregation.TOKEN_MEAN,
    "seq-mean-token-mean": Aggregation.SEQ_MEAN_TOKEN_MEAN,
    "seq-mean-token-sum": Aggregation.SEQ_MEAN_TOKEN_SUM,
    "seq-mean-token-sum-norm": Aggregation.SEQ_MEAN_TOKEN_SUM_NORM,
}
"""verl's ``loss_agg_mode`` values and the mp_grpo aggregation each one is (verl's ``token-sum`` has none:
a sum with no global divisor)."""

_VERL_NAME = {mode: name for name, mode in VERL_AGGREGATIONS.items()}

METRIC_PREFIX = "actor/mp_grpo/"
"""Prefix of the loss's own metrics in verl's log."""


def verl_refusals(config: LossConfig) -> list[str]:
    """What of ``config`` cannot run as a verl policy loss, each with the reason and verl's own way to do it."""
    out = []
    if config.kl.coef != 0.0:
        out.append(f"kl.coef={config.kl.coef}: verl hands a policy loss no reference log-probs and adds its own KL "
                   "outside it — use actor.use_kl_loss=true, actor.kl_loss_coef, actor.kl_loss_type (low_var_kl is "
                   "k3 clamped to ±10) with a config whose kl.coef is 0")
    if config.entropy.bonus_coef != 0.0 or config.entropy.adaptive:
        out.append("entropy.bonus_coef / entropy.adaptive: verl adds its own entropy bonus outside the policy loss "
                   "(actor.entropy_coeff); use a config whose entropy.bonus_coef is 0")
    if config.entropy.top_quantile < 1.0:
        out.append(f"entropy.top_quantile={config.entropy.top_quantile}: the top-entropy selection needs every "
                   "token's entropy and a step-level quantile, which verl does not hand a policy loss")
    if config.nll.positive_coef != 0.0:
        out.append(f"nll.positive_coef={config.nll.positive_coef}: the VAPO NLL term needs the rewards, which "
                   "verl does not hand a policy loss")
    if config.mismatch.skip_threshold is not None:
        out.append(f"mismatch.skip_threshold={config.mismatch.skip_threshold}: skipping a step needs the rollout "
                   "log-probs of the whole step, which verl does not hand a policy loss (verl's "
                   "algorithm.rollout_correction reports the mismatch as rollout_corr/ metrics)")
    if config.trust_region.mode != TrustRegion.NONE:
        out.append(f"trust_region.mode={config.trust_region.mode.value}: the trust region compares π_θ with the rollout "
                   "engine's log-probs, which verl does not hand a policy loss; verl's own policy_loss.loss_mode="
                   "dppo_tv / dppo_kl is DPPO's binary trust region (against old_log_prob: the rollout's in its bypass "
                   "mode)")
    if config.m2po.bound is not None:
        out.append(f"m2po.bound={config.m2po.bound}: M2PO's mask needs the rollout log-probs of the whole step, which "
                   "verl does not hand a policy loss")
    if config.policy.objective == Objective.VESPO and _has_rollout_correction(config):
        out.append("policy.objective=vespo with rollout_correction: VESPO puts the IS weight inside its gamma "
                   "weight φ(w); verl's precomputed rollout_is_weights can only multiply the policy term")
    return out


def _has_rollout_correction(config: LossConfig) -> bool:
    return config.rollout_correction != RolloutCorrectionConfig()


class VerlPolicyLoss:
    """A verl policy loss (see the module docstring) that runs ``config`` with mp_grpo's :class:`GRPOLoss`."""

    def __init__(self, name: str, config: LossConfig) -> None:
        """``name``: the loss mode it is registered under (for messages). Raises ``ValueError`` if ``config``
        holds what verl cannot feed (:func:`verl_refusals`)."""
        if not isinstance(config, LossConfig):
            raise TypeError(f"config must be a LossConfig (see mp_grpo.load_config), got {type(config).__name__}")
        refusals = verl_refusals(config)
        if refusals:
            raise ValueError(f"{name} cannot run as a verl policy loss: " + "; ".join(refusals))
        self.name = name
        self.config = config
        self._losses: dict[tuple[bool, bool], GRPOLoss] = {}

    # ------------------------------------------------------------------------------------------ call
    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's loss in verl's convention (share × dp_size) and its metrics (see the module)."""
        info = _global_batch_info(config)
        # --- 1. verl's aggregation is the config's ---
        self._check_aggregation(loss_agg_mode, info.get("loss_scale_factor"))
        # --- 2. the rollout correction: verl's weights in place of the config's section ---
        if rollout_is_weights is None and _has_rollout_correction(self.config):
            raise ValueError(
                f"{self.name} corrects the training–inference mismatch (rollout_correction: "
                f"{_section(self.config.rollout_correction)}) from the rollout log-probs, which verl does not hand "
                "a policy loss. In verl that correction is verl's own: turn on algorithm.rollout_correction "
                "(rollout_is = token | sequence, rollout_rs for rejection); its weights then arrive as "
                "rollout_is_weights and take the place of the section. Or use a config without rollout_correction")
        # --- 3. the step's account from verl's counts ---
        batch, count_empty = _step_account(info, response_mask, log_prob.device)
        # --- 4. the share, in verl's convention ---
        loss_fn = self._loss(count_empty, rollout_is_weights is not None)
        kwargs = {} if rollout_is_weights is None else {"is_weights": rollout_is_weights}
        share, metrics = loss_fn(log_prob, old_log_prob, advantages, response_mask, batch=batch, **kwargs)
        loss = share * info["dp_size"]
        # --- 5. metrics in verl's form (one host read), then the errors recorded on the device ---
        verl_metrics = self._verl_metrics(metrics, log_prob, old_log_prob, response_mask)
        check_errors()  # verl has no mp_grpo sync point of its own: this read raises what was deferred
        return loss, verl_metrics

    # ------------------------------------------------------------------------------------------ parts
    def _check_aggregation(self, loss_agg_mode: str, loss_scale_factor: Any) -> None:
        agg = self.config.aggregation
        if loss_agg_mode not in VERL_AGGREGATIONS:
            raise ValueError(
                f"actor.loss_agg_mode={loss_agg_mode}: {self.name} aggregates with aggregation.mode="
                f"{agg.mode.value}; mp_grpo has no counterpart of {loss_agg_mode} (allowed: "
                f"{' | '.join(VERL_AGGREGATIONS)})")
        if VERL_AGGREGATIONS[loss_agg_mode] != agg.regularizer:
            policy = "" if agg.regularizer == agg.mode else f" (its policy term with {agg.mode.value})"
            raise ValueError(
                f"actor.loss_agg_mode={loss_agg_mode}, but {self.name} aggregates the KL and entropy terms verl "
                f"adds with {agg.regularizer.value}{policy}: set actor.loss_agg_mode={_VERL_NAME[agg.regularizer]} "
                "(verl applies loss_agg_mode to them)")
        if Aggregation.SEQ_MEAN_TOKEN_SUM_NORM in (agg.mode, agg.regularizer):
            norm = agg.norm_constant
            if loss_scale_factor is None or float(loss_scale_factor) != norm:
                raise ValueError(
                    f"actor.loss_scale_factor={loss_scale_factor}, but {self.name} divides each sequence by "
                    f"aggregation.norm_constant={norm:g}: set actor.loss_scale_factor={norm:g} (verl's default, "
                    "null, divides by each micro-batch's padded response length, which changes with the split)")

    def _loss(self, count_empty: bool, is_weights: bool) -> GRPOLoss:
        """The GRPOLoss of the config as it runs in verl: S in verl's meaning (``count_empty``), and verl's IS
        weights in place of the rollout_correction section (``is_weights``)."""
        key = (count_empty, is_weights)
        if key not in self._losses:
            cfg = self.config
            cfg = dataclasses.replace(
                cfg, aggregation=dataclasses.replace(cfg.aggregation, count_empty_sequences=count_empty))
            if is_weights:
                cfg = dataclasses.replace(cfg, rollout_correction=RolloutCorrectionConfig())
            self._losses[key] = GRPOLoss(cfg)
        return self._losses[key]

    def _verl_metrics(
        self, metrics: Mapping[str, torch.Tensor], log_prob: torch.Tensor, old_log_prob: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> dict[str, float]:
        """verl's keys, then the loss's mean metrics; this micro-batch's means (0 where it has no token, as
        verl's masked_mean), read in one host transfer."""
        valid = response_mask.bool()
        zero = torch.zeros((), dtype=torch.float64, device=log_prob.device)
        count = valid.sum().double()
        objective = self.config.policy.objective
        log_ratio = symmetric_clamp(log_prob.detach() - old_log_prob, self.config.policy.log_ratio_clamp)
        # verl's ppo_kl: the mean of −ℓ; kl_cov's mode reports the mean of |ℓ| under that name
        kl_value = log_ratio.abs() if objective == Objective.KL_COV else -log_ratio
        pairs = {"actor/ppo_kl": torch.stack([torch.where(valid, kl_value, 0.0).sum().double(), count])}
        clipped = [metrics[k][0] for k in ("clip_frac/low", "clip_frac/high") if k in metrics]  # disjoint sets
        if objective == Objective.CLIP_COV:  # verl: the fraction whose term is zeroed
            clipped = [metrics["cov/selected_frac"][0]]
        pairs["actor/pg_clipfrac"] = torch.stack([sum(clipped, zero), count])
        pairs["actor/pg_clipfrac_lower"] = metrics.get("clip_frac/dual", torch.stack([zero, count]))
        for name, value in metrics.items():
            if value.shape == (2,) and name not in ("loss", "valid_tokens"):  # a [sum, count] mean entry
                pairs[METRIC_PREFIX + name] = value
        sums, counts = torch.stack([v.to(torch.float64) for v in pairs.values()]).unbind(-1)
        means = torch.where(counts > 0, sums / counts.clamp(min=1.0), zero).tolist()
        return dict(zip(pairs, means))


def _global_batch_info(config: Any) -> dict[str, Any]:
    """verl's ``config.global_batch_info`` (missing keys: verl's defaults), ``dp_size`` checked."""
    raw = getattr(config, "global_batch_info", None) or {}
    info = {key: raw.get(key) for key in ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")}
    dp = 1 if info["dp_size"] is None else info["dp_size"]
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"config.global_batch_info['dp_size'] must be a positive int, got {dp!r}")
    info["dp_size"] = dp
    return info


def _step_account(info: dict[str, Any], response_mask: torch.Tensor, device: torch.device) -> tuple[GlobalBatch, bool]:
    """The GlobalBatch of verl's counts, and whether S counts every sequence (verl's ``global_batch_size``) or
    only those with a valid token (verl's local fallback). A count verl left out is this micro-batch's own,
    as in verl's ``agg_loss`` — allowed only with ``dp_size`` 1."""
    tokens, sequences = info["batch_num_tokens"], info["global_batch_size"]
    if (tokens is None or sequences is None) and info["dp_size"] > 1:
        missing = "batch_num_tokens" if tokens is None else "global_batch_size"
        raise ValueError(f"config.global_batch_info['{missing}'] is required when dp_size > 1 (verl's agg_loss "
                         "requires it too): the loss is normalized over the whole DP group")
    valid = response_mask.bool()
    counts: dict[str, Any] = {"valid_tokens": valid.sum() if tokens is None else tokens}
    if sequences is None:
        counts["valid_sequences"] = valid.any(dim=-1).sum()
    else:
        counts["all_sequences"] = sequences
    return GlobalBatch.from_counts(device=device, **counts), sequences is not None


def _section(section: RolloutCorrectionConfig) -> str:
    default = RolloutCorrectionConfig()
    parts = []
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        if value != getattr(default, field.name):
            shown = value.value if hasattr(value, "value") else value
            parts.append(f"{field.name}={str(shown).lower() if isinstance(shown, bool) else shown}")
    return ", ".join(parts)
