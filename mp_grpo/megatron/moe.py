"""Mixture of experts under :class:`~mp_grpo.megatron.MegatronGRPO`: the routers' aux / z-loss scale, the
step's MoE metrics, routing replay.

**The rule (aux / z-loss scale).** megatron-core's router adds its load-balancing loss and z-loss
through ``MoEAuxLossAutoScaler``, whose gradient the schedule scales. Without ``calculate_per_token_loss``
each micro-batch's aux loss gets CP/M from the schedule and 1/(DP·CP) from DDP: weight 1/(M·DP) per
micro-batch aux loss — Megatron's intended scale. With ``calculate_per_token_loss`` the router multiplies
each micro-batch's aux loss by a token count w and ``finalize_model_grads`` divides every gradient by
N = Σ ``num_tokens`` (all micro-batches, DP×CP ranks). MegatronGRPO keeps both contracts on one rule:

    aux gradient = Σ_mb T_mb · ∇aux_mb / Σ_mb T_mb        (Σ over the step's micro-batches on all DP ranks)

with T_mb the micro-batch's routed tokens (every position the model runs on: prompts, completions,
padding). For micro-batches of one size — fixed-length padding — this is Σ ∇aux_mb / (M·DP), exactly what
``calculate_per_token_loss=False`` gives; it does not depend on the trained (completion) tokens, on M, on
DP or on which rank runs which micro-batch. (aux_mb itself is a per-micro-batch quantity — a product of
two means over the micro-batch's tokens — so regrouping tokens into other micro-batches changes it; that
is the aux loss's definition, not its scale.)

How: with per-token loss and an MoE model the loss function returns, as ``num_tokens``, the micro-batch's
*routed-token account* instead of its trained tokens, and scales GRPOLoss's share by the step's global
account A instead of the trained-token count G. GRPOLoss's gradient is unchanged (ℓ'= A·ℓ, divided by
N = A), and the routers' aux gradient becomes Σ w·∇aux_mb / A. The router's w differs by version:

* megatron-core 0.16 … 0.18: w = the router's local tokens T_mb / (TP·CP) (sequence parallelism shards
  the sequence over TP, CP over CP). A = Σ_mb T_mb / (TP·CP): CP rank 0 reports T_mb / (TP·CP) (its
  positions / TP), the other CP ranks 0.
* megatron-core ≥ 0.19 (Megatron-LM #5047 multiplies by the TP×CP size): w = T_mb. A = Σ_mb T_mb:
  every rank reports its positions.

Either way Σ w·∇aux_mb / A = Σ T_mb ∇aux_mb / Σ T_mb. The z-loss is attached the same way with the same
w, so the rule covers it. ``MoEAuxLossAutoScaler``'s own scale (``grad_scale_func``, fp16 loss scaling)
multiplies on top, as for the main loss.

Schedule of a step (MoE model, ``calculate_per_token_loss=True``)

1. ``check_model_config`` refuses what breaks the rule: TP > 1 without sequence parallelism, the
   ``seq_aux_loss`` type before 0.19 (its w is the sequence length, not the token count — Megatron-LM #5798),
   ``moe_grad_scale_func`` (0.19+: it would replace the scale again), a ``padding_mask`` model argument
   (the router would count only the unmasked positions).
2. ``loss_func`` returns ``(A·ℓ, RoutedTokenAccount.local(mb), metrics)``.
3. ``finalize_model_grads`` divides by N = A.

**Metrics.** :class:`MoEStats` puts a forward hook on every ``TopKRouter``: in a training forward (grad
enabled) it adds, per layer, the tokens dispatched to each expert, the router's aux-loss routing counts and
score sums, the sum of squared log-sum-exp of its logits and the token count into one device tensor — no
host synchronization. ``MegatronGRPO.reduce_metrics`` reduces it (sum over TP with sequence parallelism,
over DP×CP and over PP — each layer lives on one stage) and adds to the step's metrics:

* ``moe/load_balancing_loss``: Switch's E · Σ_i f_i·P_i over the whole step (f_i: fraction of the routing
  slots to expert i, P_i: mean router score of expert i), mean over the MoE layers — the coefficient-free
  value of ``aux_loss`` at step level;
* ``moe/z_loss`` (with ``moe_z_loss_coeff``): mean over tokens of logsumexp(router logits)², mean over layers;
* ``moe/expert_load_max`` / ``moe/expert_load_min``: tokens dispatched to an expert over the mean per
  expert (1 = balanced), the extreme over experts and layers; ``moe/expert_load_cv``: the coefficient of
  variation of the per-expert load, mean over layers.

**Routing replay.** See :meth:`~mp_grpo.megatron.micro_batch.MicroBatch.with_routing`: the forward step
hands the recorded top-k indices to megatron-core's ``RouterReplay`` (``moe_enable_routing_replay=True``,
megatron-core ≥ 0.16) and ``reduce_metrics`` clears the replay state at the end of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mp_grpo.collectives import all_reduce_sum, group_rank
from mp_grpo.megatron.groups import ParallelGroups

ROUTER_COUNTS_WHOLE_MICRO_BATCH = (0, 19)
"""megatron-core version from which the router's per-token weight w is the micro-batch's tokens (× TP·CP)."""


def megatron_core_version() -> tuple[int, int]:
    """(major, minor) of the installed megatron-core."""
    from megatron.core import package_info

    major, minor = package_info.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def is_moe(config) -> bool:
    """The model config has routed experts."""
    return bool(getattr(config, "num_moe_experts", None))


def _aux_types(config) -> list[tuple[str, float]]:
    """(load-balancing type, coefficient) pairs of the config (megatron-core accepts a name or a list)."""
    types = config.moe_router_load_balancing_type
    coeffs = config.moe_aux_loss_coeff
    if isinstance(types, str):
        return [(types, float(coeffs))]
    return [(t, float(c)) for t, c in zip(types, coeffs)]


def check_moe_config(config, groups: ParallelGroups, *, calculate_per_token_loss: bool) -> None:
    """Step 1: raise where the routed-token account cannot give the rule (see the module docstring)."""
    if not is_moe(config) or not calculate_per_token_loss:
        return
    # --- 1. refuse what the routed-token account cannot cover ---
    if groups.tp_size > 1 and not config.sequence_parallel:
        raise ValueError(
            "MoE with tensor parallelism needs sequence_parallel=True (megatron-core's MoELayer refuses training "
            "without it; the routed-token account assumes the router sees 1/TP of the sequence)"
        )
    if megatron_core_version() < ROUTER_COUNTS_WHOLE_MICRO_BATCH:
        if any(t == "seq_aux_loss" and c > 0 for t, c in _aux_types(config)):
            raise ValueError(
                "moe_router_load_balancing_type seq_aux_loss with calculate_per_token_loss on megatron-core < 0.19: "
                "its router weighs the loss by the sequence length, not by the micro-batch's tokens (fixed in "
                "0.19), so its scale would depend on the micro-batch size; use calculate_per_token_loss=False"
            )
    if getattr(config, "moe_grad_scale_func", None) is not None:
        raise ValueError(
            "moe_grad_scale_func is set: MegatronGRPO already gives the MoE aux / z losses their scale through the "
            "routed-token account (mp_grpo.megatron.moe); unset it"
        )


@dataclass(frozen=True)
class RoutedTokenAccount:
    """What ``loss_func`` reports as ``num_tokens`` for an MoE model under per-token loss (step 2)."""

    divisor: int
    """Positions per counted token: TP·CP before megatron-core 0.19, 1 from it."""
    reports: bool
    """Whether this rank reports its count (every rank from 0.19; CP rank 0 only before)."""
    cp_size: int

    @classmethod
    def for_model(cls, groups: ParallelGroups) -> RoutedTokenAccount:
        if megatron_core_version() >= ROUTER_COUNTS_WHOLE_MICRO_BATCH:
            return cls(divisor=1, reports=True, cp_size=groups.cp_size)
        return cls(divisor=groups.tp_size * groups.cp_size, reports=group_rank(groups.cp) == 0, cp_size=groups.cp_size)

    def local(self, positions: int, device: torch.device) -> torch.Tensor:
        """``num_tokens`` of a micro-batch with ``positions`` token positions on this rank (int tensor)."""
        # Every CP rank holds T_mb / CP positions; the divisor divides T_mb exactly (CP chunks, SP padding).
        count = positions * self.cp_size // self.divisor if self.divisor > 1 else positions
        return torch.tensor(count if self.reports else 0, dtype=torch.int, device=device)

    def total(self, all_positions: torch.Tensor) -> torch.Tensor:
        """A: the step's account, from the GlobalBatch's positions summed over DP×CP."""
        return all_positions / self.divisor


class MoEStats:
    """Per-layer router statistics of one step, accumulated on the device by forward hooks (see the module
    docstring, "Metrics")."""

    def __init__(self, config, groups: ParallelGroups) -> None:
        self.num_layers = int(config.num_layers)
        self.num_experts = int(config.num_moe_experts)
        self.topk = int(config.moe_router_topk)
        self.score_function = config.moe_router_score_function
        self.with_z_loss = config.moe_z_loss_coeff is not None
        self.sequence_parallel = bool(config.sequence_parallel)
        self.groups = groups
        self.stats: torch.Tensor | None = None
        self._hooked: dict[int, object] = {}
        self.device: torch.device | None = None

    # columns of one layer's row: [load (E) | aux-routing counts (E) | score sums (E) | Σ lse² | tokens]
    def _width(self) -> int:
        return 3 * self.num_experts + 2

    def attach(self, model: torch.nn.Module) -> None:
        """Hook every ``TopKRouter`` of ``model`` (once per router)."""
        from megatron.core.transformer.moe.router import TopKRouter

        for index, module in enumerate(m for m in model.modules() if isinstance(m, TopKRouter)):
            if id(module) in self._hooked:
                continue
            self._hooked[id(module)] = module.register_forward_hook(self._hook(module, index))
        if self.device is None:
            param = next(model.parameters(), None)
            self.device = param.device if param is not None else torch.device("cpu")

    def reset(self) -> None:
        """Start a new step (zeroes in place: no allocation, no sync)."""
        if self.stats is not None:
            self.stats.zero_()

    def _buffer(self, device: torch.device) -> torch.Tensor:
        if self.stats is None:
            self.stats = torch.zeros(self.num_layers, self._width(), dtype=torch.float64, device=device)
        return self.stats

    def _hook(self, router, index: int):
        from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

        e = self.num_experts

        def record(module, args, output) -> None:
            if not (module.training and torch.is_grad_enabled()):
                return  # forward-only passes (old / reference log-probs) are not the step's routing
            with torch.no_grad():
                add(module, args[0], output[1])

        def add(module, hidden: torch.Tensor, routing_map: torch.Tensor) -> None:
            layer = (module.layer_number - 1) if module.layer_number is not None else index
            bias = module.bias.detach().float() if module.bias is not None else None
            logits = torch.nn.functional.linear(hidden.detach().reshape(-1, hidden.shape[-1]).float(),
                                                module.weight.detach().float(), bias)
            aux_map, scores = compute_routing_scores_for_aux_loss(logits, self.topk, self.score_function)
            row = self._buffer(logits.device)[layer]
            row[:e] += routing_map.sum(0)
            row[e:2 * e] += aux_map.sum(0)
            row[2 * e:3 * e] += scores.sum(0)
            row[3 * e] += torch.logsumexp(logits, dim=-1).square().sum()
            row[3 * e + 1] += logits.shape[0]

        return record

    def reduce(self) -> dict[str, float]:
        """The step's MoE metrics on every rank (collectives over TP, DP×CP and PP; every rank must call)."""
        stats = self._buffer(self.device or torch.device("cpu")).clone()  # the collectives may return their input
        if self.sequence_parallel:  # TP ranks routed different shards of the sequence
            stats = all_reduce_sum(stats, self.groups.tp)
        stats = all_reduce_sum(stats, self.groups.dp_cp)
        stats = all_reduce_sum(stats, self.groups.pp)
        self.reset()
        e = self.num_experts
        tokens = stats[:, 3 * e + 1]
        layers = stats[tokens > 0]
        if layers.shape[0] == 0:
            return {}
        t = layers[:, 3 * e + 1 :]
        load = layers[:, :e]
        f = layers[:, e:2 * e] / (t * self.topk)
        p = layers[:, 2 * e:3 * e] / t
        mean_load = load.mean(-1, keepdim=True)  # > 0: the layer routed tokens
        relative = load / mean_load
        out = {
            "moe/load_balancing_loss": float((e * (f * p).sum(-1)).mean()),
            "moe/expert_load_max": float(relative.max()),
            "moe/expert_load_min": float(relative.min()),
            "moe/expert_load_cv": float((load.std(-1, unbiased=False) / mean_load[:, 0]).mean()),
        }
        if self.with_z_loss:
            out["moe/z_loss"] = float((layers[:, 3 * e] / t[:, 0]).mean())
        return out


def replay_routing(model: torch.nn.Module, routing: tuple[torch.Tensor, ...]) -> None:
    """Routing replay (verl R2/R3, NeMo-RL R3): hand megatron-core's ``RouterReplay`` this micro-batch's recorded
    top-k expert indices, one tensor per MoE layer of this stage, and switch the routers to replay them."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    from megatron.core.utils import get_attr_wrapped_model

    try:
        config = get_attr_wrapped_model(model, "config")
    except RuntimeError:
        config = None
    if config is not None and not getattr(config, "moe_enable_routing_replay", False):
        raise ValueError("MicroBatch.routing is set but the model config has moe_enable_routing_replay=False: "
                         "its routers would ignore the recorded decisions")
    RouterReplay.set_replay_data(list(routing))  # raises when the count differs from the MoE layers
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def end_routing_replay() -> None:
    """After a step that replayed routing: drop the replayed indices (``RouterReplay`` keeps a list of them
    per layer for recomputation) and let the routers decide again."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_indices()
    RouterReplay.clear_global_router_replay_action()
