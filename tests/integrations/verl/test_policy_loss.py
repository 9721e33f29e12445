"""mp_grpo's verl policy losses through verl 0.9.1's own ``ppo_loss`` (verl/workers/utils/losses.py): equal to
verl's loss modes where they define the same loss (tests/integrations/verl/cases.py) — one micro-batch, two
micro-batches, DP = 2 under gloo —; metrics in verl's form; what is refused, and the message.

Inputs are fp32, as verl's engine hands them. Losses agree to fp32 rounding (tests/tolerances.py; mp_grpo divides
each token's term by the global count before summing, verl after); the gradients of the "exact" cases (the same
per-token formulas) bit for bit, the others to fp32 rounding."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.integrations.verl.helpers import actor_config, make_verl_batch, require_verl, run_ppo_loss

if __name__ != "__main__":
    require_verl()

from tests.integrations.verl.cases import CASES, register_test_configs  # noqa: E402
from tests.tolerances import assert_close  # noqa: E402

LENGTHS = [7, 3, 0, 9, 5, 1, 8, 6]
R = 9
SPLITS = (slice(0, 3), slice(3, 8))
VERL_METRICS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/pg_loss", "actor/entropy_loss",
                "kl_loss")


@pytest.fixture(scope="module", autouse=True)
def _registered():
    import verl  # noqa: F401  (loads mp_grpo's plugin: the presets are registered)

    register_test_configs()


def _both(case, batch, *, tokens: int, sequences: int, dp_size: int = 1):
    """(verl's own mode, mp_grpo's mode) on ``batch`` through ppo_loss with the given global counts."""
    out = []
    verl_kwargs = {k: v for k, v in case.verl.items() if k != "loss_mode"}
    for mode, kwargs in ((case.verl["loss_mode"], verl_kwargs), (case.ours, {})):
        config = actor_config(mode, **kwargs, **case.shared)
        out.append(run_ppo_loss(config, batch, weights=case.weights, batch_num_tokens=tokens,
                                global_batch_size=sequences, dp_size=dp_size, upstream=0.7))
    return out


def _assert_same(case, name: str, verl_out, ours_out) -> None:
    (v_loss, v_metrics, v_glp, v_gent), (o_loss, o_metrics, o_glp, o_gent) = verl_out, ours_out
    if case.exact:
        assert torch.equal(o_glp, v_glp) and torch.equal(o_gent, v_gent), f"{name}: gradients differ in a bit"
    assert_close(o_loss, v_loss, torch.float32, f"{name} loss")
    assert_close(o_glp, v_glp, torch.float32, f"{name} d/dlogprobs")
    assert_close(o_gent, v_gent, torch.float32, f"{name} d/dentropy")
    for key in VERL_METRICS:
        if key in v_metrics:
            assert key in o_metrics, f"{name}: metric {key} missing"
            assert o_metrics[key] == pytest.approx(v_metrics[key], rel=1e-5, abs=1e-6), f"{name}: {key}"


@pytest.mark.parametrize("name", list(CASES))
def test_one_micro_batch_matches_verl(name: str) -> None:
    case = CASES[name]
    batch = make_verl_batch(sum(map(ord, name)), LENGTHS, R)
    verl_out, ours_out = _both(case, batch, tokens=int(batch.mask.sum()), sequences=len(LENGTHS))
    _assert_same(case, name, verl_out, ours_out)
    assert any(k.startswith("actor/mp_grpo/") for k in ours_out[1]), "the loss's own metrics are logged"


@pytest.mark.parametrize("name", list(CASES))
def test_two_micro_batches_match_verl(name: str) -> None:
    """Each micro-batch with the mini-batch's counts (verl's global_batch_info): equal to verl per micro-batch;
    the gradient summed over the two equals the one-micro-batch gradient (the covariance objectives select per
    micro-batch, as verl: their sum is not split-invariant, by definition)."""
    case = CASES[name]
    batch = make_verl_batch(sum(map(ord, name)) + 1, LENGTHS, R)
    tokens, sequences = int(batch.mask.sum()), len(LENGTHS)
    grads = torch.zeros_like(batch.logprobs)
    for i, rows in enumerate(SPLITS):
        verl_out, ours_out = _both(case, batch.rows(rows), tokens=tokens, sequences=sequences)
        _assert_same(case, f"{name} micro-batch {i}", verl_out, ours_out)
        grads[rows] = ours_out[2]
    if name not in ("clip_cov", "kl_cov"):
        whole = _both(case, batch, tokens=tokens, sequences=sequences)[1]
        assert_close(grads, whole[2], torch.float32, f"{name}: two micro-batches vs one")


DP_CASES = ["vanilla", "grpo", "dr_grpo", "gspo", "sapo"]


def case_data_parallel(names: list[str]) -> None:
    """torchrun worker: this rank's half of the mini-batch, verl's counts all-reduced over DP = 2."""
    import torch.distributed as dist

    import verl  # noqa: F401

    register_test_configs()
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in names:
        case = CASES[name]
        batch = make_verl_batch(sum(map(ord, name)) + 2, LENGTHS, R)
        half = len(LENGTHS) // world
        rows = slice(rank * half, (rank + 1) * half)
        tokens = torch.tensor(int(batch.mask[rows].sum()))
        dist.all_reduce(tokens)  # what verl's engine does for batch_num_tokens
        assert tokens.item() == int(batch.mask.sum())
        verl_out, ours_out = _both(case, batch.rows(rows), tokens=int(tokens), sequences=len(LENGTHS),
                                   dp_size=world)
        _assert_same(case, f"{name} rank {rank}", verl_out, ours_out)
        # DDP averages the ranks' gradients: with verl's ×dp_size that is the one-process gradient of the mini-batch.
        grads = torch.zeros_like(batch.logprobs)
        grads[rows] = ours_out[2]
        dist.all_reduce(grads)
        whole = _both(case, batch, tokens=int(tokens), sequences=len(LENGTHS))[1]
        assert_close(grads / world, whole[2], torch.float32, f"{name}: DP = 2 averaged vs one process")


def test_data_parallel_matches_verl() -> None:
    """DP = 2 (torchrun, gloo), the cases of DP_CASES in one launch."""
    from tests.distributed import torchrun

    torchrun(__file__, "case_data_parallel", 2, names=DP_CASES)


# ------------------------------------------------------------------------------------------ refusals
def _call(mode: str, batch, *, weights=None, dp_size=1, tokens=..., sequences=..., **kwargs):
    tokens = int(batch.mask.sum()) if tokens is ... else tokens
    sequences = batch.mask.shape[0] if sequences is ... else sequences
    return run_ppo_loss(actor_config(mode, **kwargs), batch, weights=weights, batch_num_tokens=tokens,
                        global_batch_size=sequences, dp_size=dp_size)


@pytest.mark.parametrize(("mode", "kwargs", "weights", "match"), [
    ("mp_grpo:gspo", {}, None,
     r"actor.loss_agg_mode=token-mean, but mp_grpo:gspo aggregates .* seq_mean_token_mean: set "
     r"actor.loss_agg_mode=seq-mean-token-mean"),
    ("mp_grpo:verl_ppo", {"loss_agg_mode": "token-sum"}, None, "mp_grpo has no counterpart of token-sum"),
    ("mp_grpo:trl_dr_grpo", {"loss_agg_mode": "seq-mean-token-sum-norm"}, "sequence",
     r"actor.loss_scale_factor=None, but mp_grpo:trl_dr_grpo divides each sequence by aggregation.norm_constant=512"),
    ("mp_grpo:trl_dr_grpo", {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 256}, "sequence",
     r"actor.loss_scale_factor=256, but .* aggregation.norm_constant=512: set actor.loss_scale_factor=512"),
    ("mp_grpo:trl_dapo", {}, None,
     r"mp_grpo:trl_dapo corrects the training–inference mismatch \(rollout_correction: weight_level=sequence, "
     r"reject_level=sequence, reject_max=3.0\) .* algorithm.rollout_correction"),
    ("mp_grpo:nemo_rl_grpo", {}, None, r"kl.coef=0.01: verl hands a policy loss no reference log-probs .* "
                                       r"actor.use_kl_loss=true"),
    ("mp_grpo:deepseek_v32", {"loss_agg_mode": "seq-mean-token-mean"}, None, r"kl.coef=0.001"),
    ("mp_grpo:mismatch_safe", {}, "token", r"mismatch.skip_threshold=0.1: skipping a step needs the rollout"),
    ("mp_grpo:trl_vespo", {}, "token", r"vespo with rollout_correction: VESPO puts the IS weight inside"),
])
def test_refused_with_the_reason(mode: str, kwargs: dict, weights, match: str) -> None:
    batch = make_verl_batch(5, LENGTHS, R)
    with pytest.raises(ValueError, match=match):
        _call(mode, batch, weights=weights, **kwargs)


def test_counts_required_under_data_parallelism_and_fallback_alone() -> None:
    """Without verl's counts the call is the whole step (verl's agg_loss fallback) — only with dp_size 1."""
    batch = make_verl_batch(6, LENGTHS, R)
    with pytest.raises(ValueError, match=r"global_batch_info\['batch_num_tokens'\] is required when dp_size > 1"):
        _call("mp_grpo:verl_ppo", batch, dp_size=2, tokens=None)
    for mode, agg in (("verl_ppo", "token-mean"), ("gspo", "seq-mean-token-mean")):
        verl_mode = "vanilla" if mode == "verl_ppo" else "gspo"
        clip = {} if mode == "verl_ppo" else {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}
        ours = _call(f"mp_grpo:{mode}", batch, tokens=None, sequences=None, loss_agg_mode=agg)
        theirs = _call(verl_mode, batch, tokens=None, sequences=None, loss_agg_mode=agg, **clip)
        assert_close(ours[0], theirs[0], torch.float32, f"{mode} fallback loss")
        assert_close(ours[2], theirs[2], torch.float32, f"{mode} fallback gradient")


def test_micro_batch_beyond_the_counts_is_refused() -> None:
    """A micro-batch with more valid tokens than verl's batch_num_tokens (counts of another mini-batch)."""
    from mp_grpo.loss import StaleGlobalBatchError
    from mp_grpo.ops.checks import deferred_checks

    batch = make_verl_batch(7, LENGTHS, R)
    with pytest.raises(StaleGlobalBatchError, match="does not fit in this GlobalBatch's counts"):
        _call("mp_grpo:verl_ppo", batch, tokens=int(batch.mask.sum()) - 1)
    # Deferred as on a GPU: the policy loss raises it at its own host read, within the same call.
    with deferred_checks(), pytest.raises(StaleGlobalBatchError, match="valid tokens 39 > the step's valid_tokens 38"):
        _call("mp_grpo:verl_ppo", batch, tokens=int(batch.mask.sum()) - 1)


if __name__ == "__main__":
    from tests.distributed import worker_main

    worker_main({"case_data_parallel": case_data_parallel})
    sys.exit(0)
