"""The paths ``bench_step.py`` compares, as closures over a :class:`~step_model.Rig` and its micro-batches.

Every path runs through the rig's ``forward_backward_func`` (Megatron's schedule on the GPU), one model:

- ``floor``: the decoder alone — GPTModel with its output layer skipped
  (:func:`mp_grpo.megatron.fused_output.call_for_hidden_states`) and no loss: backward starts from a fixed
  random gradient of the final hidden states. The bare output-layer matmuls are timed apart
  (:func:`output_matmuls`) and added to its time.
- ``common``: what verl's Megatron actor does, written from its public description: the model's logits as
  ``Float16Module`` returns them by default (fp32), divided by the temperature in place, per-token log-probs
  as minus megatron-core's ``vocab_parallel_cross_entropy``, masked with ``masked_fill``, then the vanilla PPO
  loss in torch (:func:`common_ppo_loss`: clipped ratio, dual clip on negative advantages, token mean).
- ``logits``: ``MegatronGRPO(output_path=LOGITS)`` — bf16 logits from the batch-major output layer,
  ``GRPOLoss.on_logits`` writing the logits' gradient in place.
- ``fused``: ``MegatronGRPO(output_path=FUSED)`` — the output layer fused with the loss, no logits held.
- ``logits_model_layer``: the ``logits`` path as it was before the batch-major output layer — GPTModel's own
  output layer (its transposed copies) and the logits' gradient in a new buffer; kept to measure that change.
- ``logits_fp32`` / ``fused_fp32``: the two mp_grpo paths with ``MegatronGRPO(logit_dtype=LogitDtype.FP32)`` —
  the logits from the same bf16 operands kept in fp32 (the output GEMM's accumulator, never rounded to bf16).
- ``fp32_head_tf32`` / ``fp32_head``: the frameworks' fp32 LM head, written from their public descriptions
  (TRL's ``cast_lm_head_to_fp32``, NeMo-RL's ``fp32_lm_head``, torchtitan's ``CastLinear``): the output layer's
  input (after ColumnParallelLinear's input mapping: the TP-summed gradient in backward) and its weight cast to
  fp32, then ``F.linear`` — with TF32 on (NeMo-RL's ``tf32``) or off (TRL, torchtitan) for that pass — then the
  common path's log-probs (megatron-core's ``vocab_parallel_cross_entropy``) and loss on the fp32 logits.

The loss is the same objective on every path: PPO clip (ε = 0.2) with dual clip c = 3, token mean over the
step's trained tokens, no entropy, no KL; without old log-probs the pass is on-policy (ratio 1: every token
has a gradient, as in the first mini-batch of a GRPO step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from functools import partial

import torch
import torch.nn.functional as F

from mp_grpo.config import LossConfig, load_config
from mp_grpo.config.job import OutputPath
from mp_grpo.megatron import IGNORE_INDEX, MegatronGRPO, MegatronScaling, MicroBatch
from mp_grpo.megatron.forward_only import forward_logprobs
from mp_grpo.megatron.fused_output import call_for_hidden_states
from mp_grpo.ops import vocab_parallel_logprobs

try:  # the logit precision setting (README, "Precision"); the fp32 rows need it
    from mp_grpo import LogitDtype
except ImportError:  # an mp_grpo without it: those rows are skipped, and the report says why
    LogitDtype = None

TEMPERATURE = 1.0
"""Sampling temperature of the rollouts (the common path still divides by it, as verl does)."""
EPS_CLIP = 0.2
"""PPO clip range (verl's ``clip_ratio``)."""
DUAL_CLIP_C = 3.0
"""Dual-clip bound on negative advantages (verl's ``clip_ratio_c``)."""
LOG_RATIO_CLAMP = 20.0
"""Bound on |log π − log π_old| before ``exp`` in the common path's ratio (verl's vanilla PPO loss)."""
FLOOR_GRADIENT_SEED = 29
"""Seed of the floor's random gradient of the final hidden states (the same in every pass)."""
LOSS_OVERRIDES = [f"policy.eps_low={EPS_CLIP}", f"policy.eps_high={EPS_CLIP}", f"policy.dual_clip_c={DUAL_CLIP_C}"]
"""mp_grpo's config of the same objective (token mean is its default aggregation)."""


class Path(str, Enum):
    FLOOR = "floor"
    COMMON = "common"
    LOGITS = "logits"
    FUSED = "fused"
    LOGITS_MODEL_LAYER = "logits_model_layer"
    LOGITS_FP32 = "logits_fp32"
    FUSED_FP32 = "fused_fp32"
    FP32_HEAD_TF32 = "fp32_head_tf32"
    FP32_HEAD = "fp32_head"


MP_GRPO_FP32 = (Path.LOGITS_FP32, Path.FUSED_FP32)
FP32_HEADS = {Path.FP32_HEAD_TF32: True, Path.FP32_HEAD: False}
"""The frameworks' fp32 head paths and whether their fp32 GEMMs run on TF32 tensor cores."""


def unavailable(path: Path) -> str | None:
    """Why ``path`` cannot run with this mp_grpo (None: it can)."""
    if Path(path) in MP_GRPO_FP32 and LogitDtype is None:
        return "this mp_grpo has no logit precision setting (mp_grpo.LogitDtype)"
    return None


def loss_config() -> LossConfig:
    return load_config(None, LOSS_OVERRIDES)


# ------------------------------------------------------------------------------------- the common path
def common_logprobs(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor, *,
                    temperature: float = TEMPERATURE) -> torch.Tensor:
    """verl's log-probs: ``logits /= T`` in place, minus megatron-core's vocab-parallel cross entropy, 0 where not trained."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits.div_(temperature)
    logprobs = -vocab_parallel_cross_entropy(logits, targets)
    return logprobs.masked_fill(~loss_mask, 0.0)


def common_ppo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    loss_mask: torch.Tensor, *, denominator: float) -> torch.Tensor:
    """Vanilla PPO loss as verl describes it: ``r = exp(clamp(log π − log π_old, ±20))``, the larger of
    ``−A·r`` and ``−A·clip(r, 1 − ε, 1 + ε)``, for A < 0 at most ``−A·c``; summed over trained tokens / ``denominator``."""
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - EPS_CLIP, 1.0 + EPS_CLIP)
    pg = torch.maximum(unclipped, clipped)
    pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * DUAL_CLIP_C), pg)
    return torch.where(loss_mask, pg, torch.zeros_like(pg)).sum() / denominator


def _token_advantages(mb: MicroBatch) -> torch.Tensor:
    adv = mb.advantages
    return adv.unsqueeze(1).expand(mb.targets.shape) if adv.dim() == 1 else adv


def _trained_tokens(micro: list[MicroBatch]) -> float:
    return float(sum(int(mb.loss_mask.sum()) for mb in micro))


# ------------------------------------------------------------------------------------- forward steps
def _floor_step(rig, upstream: dict, forward_only: bool):
    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        hidden, _ = call_for_hidden_states(model, mb.input_ids, mb.position_ids, None, **rig.model_kwargs)

        def loss_func(out):
            if forward_only:
                return out.new_zeros(()), {}
            key = tuple(out.shape)
            if key not in upstream:  # one fixed random gradient per shape, made in the first (warm-up) step
                gen = torch.Generator(device=out.device).manual_seed(FLOOR_GRADIENT_SEED)
                upstream[key] = torch.randn(key, device=out.device, generator=gen).to(out.dtype)
            return (out * upstream[key]).sum(), {}

        return hidden, loss_func

    return forward_step


def _common_step(micro: list[MicroBatch], forward_only: bool):
    denominator = _trained_tokens(micro)

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        logits = model(mb.input_ids, mb.position_ids, None)  # verl's call: Float16Module's default fp32 output

        def loss_func(out):
            logprobs = common_logprobs(out, mb.targets, mb.loss_mask)
            if forward_only:
                return logprobs.new_zeros(()), {"logprobs": logprobs}
            old = logprobs.detach() if mb.old_logprobs is None else mb.old_logprobs
            loss = common_ppo_loss(logprobs, old, _token_advantages(mb), mb.loss_mask, denominator=denominator)
            return loss * len(micro), {}  # Megatron's schedule divides by the number of micro-batches

        return logits, loss_func

    return forward_step


def _model_layer_step(rig, grpo: MegatronGRPO, batch, micro: list[MicroBatch]):
    """The logits path before the batch-major output layer: GPTModel's own layer, a new gradient buffer."""
    scaling = MegatronScaling(calculate_per_token_loss=False, num_microbatches=len(micro), dp_size=rig.groups.dp_size)

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        logits = model(mb.input_ids, mb.position_ids, None, **rig.model_kwargs)

        def loss_func(out):
            share, metrics = grpo.loss.on_logits(
                out, mb.targets, mb.old_logprobs, mb.advantages, mb.loss_mask, tp_group=rig.groups.tp,
                temperature=TEMPERATURE, with_entropy=False, ignore_index=IGNORE_INDEX, batch=batch, layout=mb.sequences,
            )
            return scaling.megatron_loss(share, batch.valid_tokens), metrics

        return logits, loss_func

    return forward_step


def _grpo(rig, path: Path, micro: list[MicroBatch]) -> MegatronGRPO:
    output_path = OutputPath.FUSED if path in (Path.FUSED, Path.FUSED_FP32) else OutputPath.LOGITS
    precision = {} if path not in MP_GRPO_FP32 else {"logit_dtype": LogitDtype.FP32}
    return MegatronGRPO(loss_config(), temperature=TEMPERATURE, calculate_per_token_loss=False,
                        num_microbatches=len(micro), groups=rig.groups, with_entropy=False, output_path=output_path,
                        **precision)


# ------------------------------------------------------------------------------------- the frameworks' fp32 head
@contextmanager
def tf32_matmuls(enabled: bool) -> Iterator[None]:
    """fp32 matmuls on TF32 tensor cores (``enabled``) or in IEEE fp32 for the duration, restored after. Uses the
    ``fp32_precision`` setting where torch has it (mixing it with the legacy ``allow_tf32`` flag is an error)."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        before = matmul.fp32_precision
        matmul.fp32_precision = "tf32" if enabled else "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = before
    else:  # pragma: no cover - torch < 2.9
        before = matmul.allow_tf32
        matmul.allow_tf32 = enabled
        try:
            yield
        finally:
            matmul.allow_tf32 = before


def fp32_head_logits(rig, model, mb: MicroBatch) -> torch.Tensor:
    """The frameworks' fp32 head: the output layer's mapped input and weight cast to fp32, ``F.linear`` —
    ``[B, S, V_local]`` fp32 logits (the model's decoder and the input mapping run as on the fused path)."""
    hidden, weight = call_for_hidden_states(model, mb.input_ids, mb.position_ids, None, **rig.model_kwargs)
    return F.linear(hidden.float(), weight.weight.float())


def _fp32_head_step(rig, micro: list[MicroBatch], forward_only: bool):
    """The common path's loss on the fp32 head's logits (see :func:`_common_step`)."""
    denominator = _trained_tokens(micro)

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        logits = fp32_head_logits(rig, model, mb)

        def loss_func(out):
            logprobs = common_logprobs(out, mb.targets, mb.loss_mask)
            if forward_only:
                return logprobs.new_zeros(()), {"logprobs": logprobs}
            old = logprobs.detach() if mb.old_logprobs is None else mb.old_logprobs
            loss = common_ppo_loss(logprobs, old, _token_advantages(mb), mb.loss_mask, denominator=denominator)
            return loss * len(micro), {}

        return logits, loss_func

    return forward_step


# ------------------------------------------------------------------------------------- passes
def training_pass(rig, path: Path, micro: list[MicroBatch]) -> Callable[[], list]:
    """One training ``forward_backward_func`` over ``micro`` on ``path`` (the step's GlobalBatch built here, once)."""
    path = Path(path)
    if path == Path.FLOOR:
        step = _floor_step(rig, {}, forward_only=False)
    elif path == Path.COMMON:
        step = _common_step(micro, forward_only=False)
    elif path in FP32_HEADS:
        schedule = partial(rig.schedule, _fp32_head_step(rig, micro, forward_only=False), micro, forward_only=False)

        def run():
            with tf32_matmuls(FP32_HEADS[path]):  # forward and backward GEMMs alike
                return schedule()

        return run
    else:
        grpo = _grpo(rig, path, micro)
        batch = grpo.global_batch(micro, step=0)
        if path == Path.LOGITS_MODEL_LAYER:
            step = _model_layer_step(rig, grpo, batch, micro)
        else:
            step = grpo.forward_step_func(batch, step=0, model_kwargs=rig.model_kwargs)
    return partial(rig.schedule, step, micro, forward_only=False)


def forward_pass(rig, path: Path, micro: list[MicroBatch]) -> Callable[[], list[torch.Tensor] | None]:
    """The forward-only log-prob pass (old / reference policy) over ``micro`` on ``path``, under ``no_grad``:
    the log-probs per micro-batch (the floor: None — the decoder alone, no output layer)."""
    path = Path(path)
    plain = (Path.FLOOR, Path.COMMON, *FP32_HEADS)
    grpo = None if path in plain else _grpo(rig, path, micro)  # once, as a training loop does

    def run():
        with torch.no_grad():
            if path == Path.FLOOR:
                rig.schedule(_floor_step(rig, {}, forward_only=True), micro, forward_only=True)
                return None
            if path == Path.COMMON:
                return [d["logprobs"] for d in rig.schedule(_common_step(micro, forward_only=True), micro,
                                                            forward_only=True)]
            if path in FP32_HEADS:
                with tf32_matmuls(FP32_HEADS[path]):
                    return [d["logprobs"] for d in rig.schedule(_fp32_head_step(rig, micro, forward_only=True), micro,
                                                                forward_only=True)]
            if path == Path.LOGITS_MODEL_LAYER:
                def step(data_iterator, model):
                    mb = next(data_iterator)

                    def loss_func(out):
                        lp = vocab_parallel_logprobs(out, mb.targets, tp_group=rig.groups.tp, temperature=TEMPERATURE,
                                                     ignore_index=IGNORE_INDEX)
                        return lp.new_zeros(()), {"logprobs": lp}

                    return model(mb.input_ids, mb.position_ids, None, **rig.model_kwargs), loss_func

                return [d["logprobs"] for d in rig.schedule(step, micro, forward_only=True)]
            out = forward_logprobs(grpo, rig.forward_backward_func, rig.model, micro, model_kwargs=rig.model_kwargs)
            return out.logprobs

    return run


def grpo_step(rig, path: Path, micro: list[MicroBatch], optimizer) -> Callable[[], None]:
    """A whole GRPO step on ``path``: the forward-only pass (old log-probs), the training pass on them (its
    GlobalBatch built in the step), megatron-core's optimizer step. The floor runs the decoder in both passes."""
    path = Path(path)
    old_pass = forward_pass(rig, path, micro)

    def step():
        old = old_pass()
        with_old = micro if old is None else [mb.with_logprobs(old_logprobs=lp) for mb, lp in zip(micro, old)]
        rig.zero_grad()
        optimizer.zero_grad()
        training_pass(rig, path, with_old)()
        optimizer.step()

    return step


def output_matmuls(tokens: int, hidden: int, vocab: int, *, backward: bool, device, dtype=torch.bfloat16):
    """The bare output layer, timed apart for the floor: ``h @ Wᵀ`` (forward-only pass) or that and its two
    backward GEMMs from a random logits gradient (training pass). Random operands, made once. Under tensor
    parallelism ``vocab`` is this rank's shard (V / TP)."""
    gen = torch.Generator(device=device).manual_seed(5)
    h = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype).requires_grad_(backward)
    w = (torch.randn(vocab, hidden, device=device, generator=gen) * hidden**-0.5).to(dtype).requires_grad_(backward)
    if not backward:
        def fwd():
            with torch.no_grad():
                h @ w.t()

        return fwd
    grad = torch.randn(tokens, vocab, device=device, generator=gen).to(dtype)

    def fwd_bwd():
        h.grad = w.grad = None
        (h @ w.t()).backward(grad)

    return fwd_bwd
