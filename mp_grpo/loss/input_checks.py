"""Host-side checks of :class:`~mp_grpo.loss.GRPOLoss`'s inputs (step 1 of its schedule); every error names the
argument. Shapes and devices are checked against the argument that sets the token shape: ``logprobs`` for
``GRPOLoss(...)``, ``target`` for :meth:`GRPOLoss.on_logits <mp_grpo.loss.grpo_loss.GRPOLoss.on_logits>`,
the micro-batch's ``targets`` for ``MegatronGRPO.loss_func``.

One micro-batch is checked once, by the public entry point it enters (:func:`check_loss_call`, :func:`check_batch`);
the internal entries those call (``GRPOLoss.share_unchecked``, ``GRPOLoss.on_logits_unchecked``) trust it."""

from __future__ import annotations

import torch

from mp_grpo.collectives import group_size
from mp_grpo.config.loss import LossConfig, Objective
from mp_grpo.loss.covariance import COVARIANCE_OBJECTIVES
from mp_grpo.loss.global_batch import GlobalBatch
from mp_grpo.loss.sequence import PaddedSequences, SequenceLayout
from mp_grpo.loss.trust_region import TopKLogprobs, check_topk_logprobs


def check_loss_call(
    cfg: LossConfig,
    layout: SequenceLayout,
    shape: torch.Size,
    device: torch.device,
    reference: str,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    *,
    entropy_computed: bool = False,
    kl_logprobs: torch.Tensor | None = None,
    entropy_coef: float | torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    positive: torch.Tensor | None = None,
    positive_tokens: torch.Tensor | None = None,
    topk_logprobs: TopKLogprobs | None = None,
) -> torch.Tensor | None:
    """Step 1 of :class:`~mp_grpo.loss.GRPOLoss`'s schedule, once per call: every host-side check of one
    micro-batch's loss inputs against the token ``shape`` and ``device`` of ``reference`` (the argument that sets
    them). Made by the public entry points (``GRPOLoss(...)``, ``GRPOLoss.on_logits``, ``MegatronGRPO.loss_func``);
    the layers they call trust it. Returns the bool token mask of the positive examples (``nll.positive_coef``
    only, else None)."""
    check_token_inputs(cfg, layout, shape, device, reference, old_logprobs, advantages, loss_mask, rollout_logprobs,
                       ref_logprobs, entropy, entropy_computed=entropy_computed)
    if kl_logprobs is not None:
        check_float("kl_logprobs", kl_logprobs)
        check_like("kl_logprobs", kl_logprobs, shape, device, reference)
    if cfg.entropy.adaptive != (entropy_coef is not None):
        raise ValueError("entropy_coef must be given exactly when entropy.adaptive is true (the step's coefficient "
                         f"from AdaptiveEntropyCoefficient.applied); entropy.adaptive is {cfg.entropy.adaptive}")
    check_covariance(cfg, layout, generator, device, reference)
    check_topk_logprobs(cfg.trust_region, topk_logprobs, shape, device, reference)
    return positive_token_mask(cfg, layout, shape, positive, positive_tokens, device, reference)


def checked_layout(layout: SequenceLayout | None) -> SequenceLayout:
    """``layout``, or padded rows for None; raises unless it is a :class:`SequenceLayout`."""
    if layout is None:
        return PaddedSequences()
    if not isinstance(layout, SequenceLayout):
        raise TypeError(f"layout must be a SequenceLayout or None, got {type(layout).__name__}")
    return layout


def check_batch(cfg: LossConfig, batch: GlobalBatch, loss_mask: torch.Tensor) -> None:
    """The step's GlobalBatch: built from this micro-batch's ``loss_mask`` and for ``cfg``."""
    if not isinstance(batch, GlobalBatch):
        raise TypeError(f"batch must be a GlobalBatch or None, got {type(batch).__name__}")
    batch.check_micro_batch(loss_mask)
    batch.check_config(cfg)


def check_token_inputs(
    cfg: LossConfig,
    layout: SequenceLayout,
    shape: torch.Size,
    device: torch.device,
    reference: str,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    entropy: torch.Tensor | None,
    *,
    entropy_computed: bool = False,
) -> None:
    """The checks of :func:`check_loss_inputs` against the token shape and device of ``reference`` (the argument that
    sets them: ``logprobs``, or ``target`` for :meth:`GRPOLoss.on_logits`, which computes the entropy itself)."""
    layout.check_tokens(shape, reference)
    if not isinstance(loss_mask, torch.Tensor) or loss_mask.is_complex():
        raise TypeError(f"loss_mask must be a bool, integer or floating tensor, got {_kind(loss_mask)}")
    check_like("loss_mask", loss_mask, shape, device, reference)
    rc = cfg.rollout_correction
    if rc.bypass and old_logprobs is not None:
        raise ValueError("old_logprobs must be None with rollout_correction.bypass: the rollout log-probs are the old ones")
    needs = {
        "rollout_logprobs": (cfg.needs_rollout_logprobs, "rollout_correction / mismatch / trust_region / m2po settings"),
        "ref_logprobs": (cfg.kl.coef != 0.0, "kl.coef != 0"),
        "entropy": (cfg.needs_entropy and not entropy_computed,
                    "entropy.bonus_coef / entropy.top_quantile / entropy.adaptive"),
    }
    given = {"old_logprobs": old_logprobs, "rollout_logprobs": rollout_logprobs, "ref_logprobs": ref_logprobs,
             "entropy": entropy}
    for name, value in given.items():
        if value is None:
            needed, why = needs.get(name, (False, ""))
            if needed:
                raise ValueError(f"{name} must be given: the config's {why} need it")
            continue
        check_float(name, value)
        check_like(name, value, shape, device, reference)
    check_float("advantages", advantages)
    layout.is_per_sequence(advantages.shape, shape, "advantages")
    if advantages.device != device:
        raise ValueError(f"advantages is on {advantages.device} but {reference} is on {device}")


def check_covariance(
    cfg: LossConfig, layout: SequenceLayout, generator: torch.Generator | None, device: torch.device,
    reference: str = "logprobs",
) -> None:
    """clip_cov / kl_cov: no context parallelism; ``generator`` only with clip_cov, on the tokens' device."""
    objective = cfg.policy.objective
    if objective in COVARIANCE_OBJECTIVES and group_size(layout.cp_group) > 1:
        raise ValueError(
            f"layout: policy.objective={objective.value} selects tokens by their covariance over the micro-batch's "
            f"valid tokens (verl), but under context parallelism (cp_group of size {group_size(layout.cp_group)}) "
            "this rank holds only part of them and the selection is not made CP-invariant; use context parallel "
            "size 1 with this objective")
    if generator is None:
        return
    if objective != Objective.CLIP_COV:
        raise ValueError(f"generator is only used by policy.objective=clip_cov, not {objective.value}")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator.device.type != device.type:
        raise ValueError(f"generator is on {generator.device} but {reference} is on {device}")


def check_is_weights(cfg: LossConfig, is_weights: torch.Tensor, shape: torch.Size, device: torch.device) -> None:
    """A caller's precomputed IS weight: token-shaped floats on the tokens' device, and no computed weight beside it."""
    check_float("is_weights", is_weights)
    check_like("is_weights", is_weights, shape, device)
    if cfg.rollout_correction.weight_level is not None:
        raise ValueError(
            f"is_weights: the config computes its own IS weight (rollout_correction.weight_level="
            f"{cfg.rollout_correction.weight_level.value}); give one weight or the other — set weight_level to null "
            "to use the given weights")
    if cfg.policy.objective == Objective.VESPO:
        raise ValueError("is_weights: policy.objective=vespo puts the IS weight inside its gamma weight φ(w); a "
                         "precomputed weight can only multiply the policy term")


def positive_token_mask(
    cfg: LossConfig, layout: SequenceLayout, shape: torch.Size, positive: torch.Tensor | None,
    positive_tokens: torch.Tensor | None, layout_device: torch.device, reference: str = "logprobs",
) -> torch.Tensor | None:
    """Bool token mask of the positive examples (``nll.positive_coef`` only); checks ``positive`` (and that
    ``positive_tokens`` comes only with it)."""
    if cfg.nll.positive_coef == 0.0:
        for name, value in (("positive", positive), ("positive_tokens", positive_tokens)):
            if value is not None:
                raise ValueError(f"{name} is only used by nll.positive_coef != 0")
        return None
    if positive is None:
        raise ValueError("positive must be given: the config's nll.positive_coef needs it")
    if not isinstance(positive, torch.Tensor):
        raise TypeError(f"positive must be a tensor, got {type(positive).__name__}")
    if positive.device != layout_device:
        raise ValueError(f"positive is on {positive.device} but {reference} is on {layout_device}")
    if layout.is_per_sequence(positive.shape, shape, "positive"):
        positive = layout.broadcast(positive.to(torch.float64), shape)
    return positive != 0


def _kind(x: object) -> str:
    return str(x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__


def check_float(name: str, x: object) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {_kind(x)}")


def check_like(
    name: str, x: torch.Tensor, shape: torch.Size, device: torch.device, reference: str = "logprobs"
) -> None:
    if x.shape != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, {reference} has {tuple(shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but {reference} is on {device}")
