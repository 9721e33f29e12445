"""Ranks that disagree fail at the GlobalBatch's one all-reduce (mp_grpo/loss/fingerprint.py), under torchrun / gloo.

Two ranks build the step's GlobalBatch (from masks and rollouts, or from counts with a group); one of them differs in its LossConfig, its step id, how it built the
batch, a ``same_on_all_ranks`` setting, the counts it was given, or — through the Megatron adapter — ``calculate_per_token_loss``. Every
rank must raise :class:`RankDisagreementError` naming what differs (at once on the CPU; with the checks deferred
as on a GPU, at ``check_errors()``, the counts NaN meanwhile), and ranks that agree must get the exact counts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from mp_grpo.config import load_config
from mp_grpo.loss import GlobalBatch, RankDisagreementError
from mp_grpo.loss.fingerprint import canonical, fingerprint_items
from mp_grpo.config.loss import LossConfig
from mp_grpo.ops.checks import check_errors, deferred_checks
from tests.distributed import torchrun, worker_main

_STEP_LEVEL = ["rollout_correction.weight_level=token", "rollout_correction.weight_max=2.0",
               "rollout_correction.normalize_weights=true"]


def _inputs(rank: int) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(10 + rank)
    mask = torch.rand(3, 7, generator=gen) < 0.7
    old = -torch.rand(3, 7, generator=gen) * 3
    return dict(masks=[mask], old_logprobs=[old], rollout_logprobs=[old + 0.1 * torch.randn(3, 7, generator=gen)],
                entropies=[torch.rand(3, 7, generator=gen) * 2])


def _build(config_overrides: list[str] | None, rank: int, **kw) -> GlobalBatch:
    data = _inputs(rank)
    if config_overrides is None:
        return GlobalBatch.from_masks(data["masks"], group=dist.group.WORLD, **kw)
    cfg = load_config(None, config_overrides)
    return GlobalBatch.from_rollouts(cfg, data["masks"], old_logprobs=data["old_logprobs"],
                                     rollout_logprobs=data["rollout_logprobs"], entropies=data["entropies"],
                                     group=dist.group.WORLD, **kw)


def case_global_batch() -> None:
    rank = dist.get_rank()
    # --- agreement: exact counts over both ranks ---
    gb = _build(_STEP_LEVEL, rank, step=4, same_on_all_ranks={"calculate_per_token_loss": True, "temperature": 0.7})
    expected = sum(int(_inputs(r)["masks"][0].sum()) for r in range(2))
    assert gb.valid_tokens.item() == expected and gb.num_micro_batches.item() == 2
    # --- one rank differs: every rank raises, naming what differs ---
    cases = [
        (dict(config_overrides=_STEP_LEVEL + [f"aggregation.mode={'token_mean' if rank == 0 else 'seq_mean_token_mean'}"]),
         r"loss config aggregation\.mode \(this rank: '(token_mean|seq_mean_token_mean)'\)"),
        (dict(config_overrides=_STEP_LEVEL, step=4 + rank), r"on step \(this rank: [45]\)"),
        (dict(config_overrides=_STEP_LEVEL if rank == 0 else None), r"how the GlobalBatch was built"),
        (dict(config_overrides=_STEP_LEVEL, same_on_all_ranks={"calculate_per_token_loss": rank == 1}),
         r"same_on_all_ranks \(this rank: \{'calculate_per_token_loss': (True|False)\}\)"),
        (dict(config_overrides=None, step=3 if rank == 0 else None), r"step \(this rank: (3|None)\)"),
    ]
    for kw, match in cases:
        overrides = kw.pop("config_overrides")
        with pytest.raises(RankDisagreementError, match=match):
            _build(overrides, rank, **kw)
    # --- deferred, as on a GPU: no error at the build, NaN counts, the error at check_errors() on every rank ---
    with deferred_checks():
        gb = _build(_STEP_LEVEL, rank, step=7 + rank)
        assert torch.isnan(gb.valid_tokens) and torch.isnan(gb.weight_mean)
        with pytest.raises(RankDisagreementError, match=r"the 2 ranks of its group disagree on step"):
            check_errors()
        check_errors()  # cleared
    # --- a config only one rank reads entropies for: that rank raises before its gather, the other at the check ---
    with deferred_checks():
        quantile = "entropy.top_quantile=0.5" if rank == 0 else "entropy.top_quantile=1.0"
        if rank == 0:
            with pytest.raises(RankDisagreementError, match=r"loss config entropy\.top_quantile"):
                _build(_STEP_LEVEL + [quantile], rank)
        else:
            _build(_STEP_LEVEL + [quantile], rank)
            with pytest.raises(RankDisagreementError, match=r"loss config entropy\.top_quantile"):
                check_errors()
        check_errors()


def case_from_counts() -> None:
    """GlobalBatch.from_counts with a group: the ranks' counts, statistics, config and step compared bit for bit."""
    rank = dist.get_rank()
    cfg = load_config(None, ["rollout_correction.weight_level=token", "rollout_correction.weight_max=2.0",
                             "rollout_correction.normalize_weights=true"])
    common = dict(device="cpu", valid_sequences=7, all_sequences=9, micro_batches=4, config=cfg, step=2,
                  group=dist.group.WORLD)
    gb = GlobalBatch.from_counts(valid_tokens=120, weight_mean=torch.tensor(0.97, dtype=torch.float64), **common)
    assert gb.valid_tokens.item() == 120 and gb.weight_mean.item() == 0.97
    cases = [
        (dict(valid_tokens=120 + rank), r"valid_tokens \(this rank: 12[01]\.0\)"),
        (dict(valid_tokens=torch.tensor(120.0 + rank, dtype=torch.float64)), r"valid_tokens"),
        (dict(weight_mean=0.97 + 1e-12 * rank), r"weight_mean"),
    ]
    for changed, match in cases:
        kw = dict(common, valid_tokens=120, weight_mean=0.97) | changed
        with pytest.raises(RankDisagreementError, match=match):
            GlobalBatch.from_counts(**kw)
    with pytest.raises(RankDisagreementError, match=r"loss config rollout_correction\.weight_max"):
        other = load_config(None, ["rollout_correction.weight_level=token",
                                   f"rollout_correction.weight_max={2.0 + rank}",
                                   "rollout_correction.normalize_weights=true"])
        GlobalBatch.from_counts(**(dict(common, valid_tokens=120, weight_mean=0.97) | dict(config=other)))
    with deferred_checks():
        gb = GlobalBatch.from_counts(**dict(common, valid_tokens=120 + rank, weight_mean=0.97))
        assert torch.isnan(gb.valid_tokens) and torch.isnan(gb.weight_mean)
        with pytest.raises(RankDisagreementError, match="valid_tokens"):
            check_errors()


def case_megatron_per_token_loss() -> None:
    """MegatronGRPO: ranks with different calculate_per_token_loss (or temperature) fail at global_batch."""
    from mp_grpo.megatron import MegatronGRPO, ParallelGroups, prepare_micro_batch
    from tests.megatron import helpers as H

    rank = dist.get_rank()
    micro = [prepare_micro_batch(H.make_rollouts(4, seed=20 + rank))]
    groups = ParallelGroups(dp_cp=dist.group.WORLD)
    same = MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=0.7, calculate_per_token_loss=True, groups=groups)
    same.global_batch(micro, step=1)
    for kw, match in ((dict(temperature=0.7, calculate_per_token_loss=rank == 0), "calculate_per_token_loss"),
                      (dict(temperature=0.7 + 0.1 * rank, calculate_per_token_loss=True), "temperature")):
        grpo = MegatronGRPO(H.loss_config("ppo_token_tis"), groups=groups, **kw)
        with pytest.raises(RankDisagreementError, match=match):
            grpo.global_batch(micro, step=1)


def test_canonical_is_stable_and_typed() -> None:
    cfg = load_config(None, _STEP_LEVEL)
    items = fingerprint_items(cfg, LossConfig, 3, {"b": 1, "a": (True, None)})
    assert [name for name, _, _ in items][:2] == ["how the GlobalBatch was built", "loss config policy.objective"]
    assert items[0][1] != fingerprint_items(cfg, LossConfig, 3, None, built="counts")[0][1]
    assert len(items) == len(fingerprint_items(None, LossConfig, None, None))  # same length, whatever the values
    assert canonical(1) == canonical(1.0) and canonical(True) != canonical(1)
    again = fingerprint_items(dataclasses.replace(cfg), LossConfig, 3, {"a": (True, None), "b": 1.0})
    assert [text for _, text, _ in again] == [text for _, text, _ in items]
    with pytest.raises(TypeError, match=r"same_on_all_ranks\[0\]\[1\]: object has no canonical form"):
        fingerprint_items(cfg, LossConfig, 3, {"x": object()})


@pytest.mark.parametrize("case", ["case_global_batch", "case_from_counts", "case_megatron_per_token_loss"])
def test_ranks_that_disagree_fail_at_the_all_reduce(case: str) -> None:
    torchrun(__file__, case, nproc=2)


if __name__ == "__main__":
    worker_main({"case_global_batch": case_global_batch, "case_from_counts": case_from_counts,
                 "case_megatron_per_token_loss": case_megatron_per_token_loss})
