"""The learning loop replays the rollout's sampling filter (mp_grpo/train/loop.py; ``engine.top_k`` / ``engine.top_p``).

* The boundary rule on a constructed case: a row of logits whose fp32 top-p nucleus drops a token that the
  same logits rounded to bf16 keep — a bf16 engine samples it, the fp32 trainer's replayed filter gives it
  log-prob −inf (the old-log-prob pass's function equals the float64 filtered reference, the −inf included).
  :func:`~mp_grpo.train.loop.drop_outside_filter` takes it out of the loss mask and counts it:
  loss, gradient and metrics then equal those of the same micro-batch with that token never trained on, all
  finite; without the rule the −inf old (and current) log-prob is a non-finite input: the loss drops the
  position's term and counts it, but the position stays in the step's denominators.
  A later update whose filter drops a token the old pass kept: the position gives no term and no gradient, stays
  in the denominators, is counted as outside the filter, and the step goes on.
* The loop itself under torchrun (gloo) with top-k and top-p on and a bf16 engine: TP = 1, TP = 2 and DP = 2
  give the same completions, rewards and dropped-token fractions, and loss / grad norm to fp32 reduction order
  (the micro-batch split is tested without a filter in test_trajectory_invariance.py; the filter is per row);
  the old-log-prob and training passes carry the filter (on-policy ratios exactly 1), the reference pass does
  not (a finite KL); with replay the vllm-kl is at the bf16 level and the token IS mean 1, without it the IS
  mean is the kept mass (< 1).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed import torchrun, worker_main
from tests.reference import filtered_logprobs_reference, sampling_filter_keep_reference
from tests.tolerances import assert_close

TOP_P = 0.8
VOCAB = 16


# ------------------------------------------------------------------------------------ the boundary rule
def _boundary_row(p: float) -> tuple[torch.Tensor, int]:
    """fp32 logits ``[V]`` and a token id that top-p keeps on the logits rounded to bf16 and drops on the fp32
    ones: the first such row of a seeded batch, found with the float64 reference."""
    x = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(0)) * 1.5
    bf16_only = sampling_filter_keep_reference(x.bfloat16().float(), top_p=p) & ~sampling_filter_keep_reference(x, top_p=p)
    rows = bf16_only.any(dim=1).nonzero().squeeze(1)
    assert len(rows) > 0, "no boundary row in the search batch"
    row = int(rows[0])
    return x[row], int(bf16_only[row].nonzero()[0, 0])


def _micro_batch_and_logits(loss_mask_at_boundary: bool):
    """Two sequences (2 prompt + 4 completion tokens); the completion token at position 3 of sequence 0 is the
    boundary token, every other one its position's argmax (kept by any filter). Returns the micro-batch with
    the filter replayed, the fp32 logits ``[2, 6, V]``, the boundary position in the micro-batch and the row."""
    from mp_grpo.megatron import Rollouts, prepare_micro_batch

    row, token = _boundary_row(TOP_P)
    gen = torch.Generator().manual_seed(1)
    b, s = 2, 6
    logits = torch.randn(b, s, VOCAB, generator=gen)
    logits[0, 2] = row  # the logit at position 2 predicts token 3
    tokens = torch.randint(0, VOCAB, (b, s), generator=gen)
    tokens[:, 2:] = logits[:, 1:5].argmax(-1)
    tokens[0, 3] = token
    mask = torch.zeros(b, s, dtype=torch.bool)
    mask[:, 2:] = True
    mask[0, 3] = loss_mask_at_boundary
    # The engine's log-probs: the filtered distribution of its bf16 logits (the boundary token inside it).
    target = torch.where(mask[:, 1:], tokens[:, 1:], torch.full_like(tokens[:, 1:], -100))
    rollout, _ = filtered_logprobs_reference(logits[:, :-1].bfloat16().float(), target, top_p=TOP_P)
    rollout = torch.cat([torch.zeros(b, 1, dtype=torch.float64), torch.where(mask[:, 1:], rollout, 0.0)], dim=1).float()
    rollouts = Rollouts(tokens=tokens, lengths=torch.full((b,), s), loss_mask=mask,
                        advantages=torch.tensor([1.0, -0.5]), rollout_logprobs=rollout)
    return prepare_micro_batch(rollouts).with_sampling_filter(top_p=TOP_P), logits, (0, 2), token


def _grpo(check_inputs: bool = False):
    from mp_grpo.config.job import load_job_config
    from mp_grpo.megatron import MegatronGRPO, ParallelGroups
    from mp_grpo.train.__main__ import config_path

    loss = load_job_config(config_path("cpu")).loss  # token TIS (cap 2), mismatch skip above vllm-kl 0.1
    return MegatronGRPO(loss, temperature=1.0, num_microbatches=1, calculate_per_token_loss=False,
                        groups=ParallelGroups(), check_inputs=check_inputs)


def _step(grpo, mb, logits):
    """One loss call on ``logits`` (a leaf): loss, metrics, the gradient of the logits and the skip decision."""
    from mp_grpo.loss.metrics import reduce_metrics

    leaf = logits.clone().requires_grad_(True)
    batch = grpo.global_batch([mb], step=0)
    loss, metrics = grpo.loss_func(mb, batch, leaf)
    loss.backward()
    return float(loss.detach()), reduce_metrics([metrics], None), leaf.grad, bool(batch.skip_step())


def test_bf16_engine_keeps_what_the_fp32_trainer_drops() -> None:
    """The constructed case is one: mp_grpo's own kernels, the engine's on bf16 logits and the trainer's replay
    on fp32 ones, disagree on the token."""
    from mp_grpo import vocab_parallel_logprobs
    from mp_grpo.ops import SamplingFilter
    from mp_grpo.train.sampler import sampling_filter_keep

    row, token = _boundary_row(TOP_P)
    engine_keep = sampling_filter_keep(row.bfloat16().float().unsqueeze(0), top_k=0, top_p=TOP_P, tp_group=None)
    assert bool(engine_keep[0, token])
    trainer = vocab_parallel_logprobs(row.unsqueeze(0), torch.tensor([token]), check_inputs=False,
                                      sampling_filter=SamplingFilter(top_p=TOP_P))
    assert bool(torch.isneginf(trainer).all())
    with pytest.raises(ValueError, match="outside the sampling_filter's kept set"):  # why the loop checks OFF
        vocab_parallel_logprobs(row.unsqueeze(0), torch.tensor([token]), sampling_filter=SamplingFilter(top_p=TOP_P))


def test_boundary_token_leaves_the_loss_as_if_never_trained_on() -> None:
    from mp_grpo.train.loop import check_replayed_step, drop_outside_filter

    grpo = _grpo()
    mb, logits, (b, s), _ = _micro_batch_and_logits(loss_mask_at_boundary=True)
    with torch.no_grad():
        old, _ = grpo.token_logprobs(logits, mb)  # the old-log-prob pass's function (forward_logprobs calls it)
    assert bool(torch.isneginf(old[b, s])) and int(torch.isneginf(old).sum()) == 1
    ref, _ = filtered_logprobs_reference(logits, mb.targets, top_p=TOP_P)  # TP = 1 against float64
    assert torch.equal(torch.isneginf(old), torch.isneginf(ref))
    assert_close(old[torch.isfinite(ref)], ref[torch.isfinite(ref)], torch.float32, msg="old log-probs vs float64")
    with_old = mb.with_logprobs(old_logprobs=old)
    ruled, dropped = drop_outside_filter(with_old)
    assert int(dropped) == 1 and not bool(ruled.loss_mask[b, s]) and int(ruled.targets[b, s]) == -100

    never, _, _, _ = _micro_batch_and_logits(loss_mask_at_boundary=False)
    with torch.no_grad():
        never_old, _ = grpo.token_logprobs(logits, never)
    never = never.with_logprobs(old_logprobs=never_old)
    for name in ("targets", "loss_mask", "old_logprobs"):
        assert torch.equal(getattr(ruled, name), getattr(never, name)), name
    # The engine's log-prob of the dropped token stays in the micro-batch, at a masked position (it must not leak).
    assert torch.equal(ruled.rollout_logprobs[ruled.loss_mask], never.rollout_logprobs[never.loss_mask])
    assert ruled.rollout_logprobs[b, s] != 0 and never.rollout_logprobs[b, s] == 0

    loss, metrics, grad, skipped = _step(grpo, ruled, logits)
    ref_loss, ref_metrics, ref_grad, _ = _step(grpo, never, logits)
    assert loss == ref_loss and torch.equal(grad, ref_grad)
    assert metrics == ref_metrics
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert not skipped and metrics["mismatch/k3"] < 1e-3 and metrics["sampling_filter/outside_tokens"] == 0
    assert metrics["valid_tokens"] == int(mb.loss_mask.sum()) - 1

    # Without the rule the −inf old and current log-probs are non-finite inputs at a trained position: the loss drops
    # its term (no gradient), counts it — but it stays in the step's denominators, unlike a token never trained on.
    _, raw_metrics, raw_grad, raw_skipped = _step(grpo, with_old, logits)
    assert raw_metrics["nonfinite_inputs"] == 1 and raw_metrics["sampling_filter/outside_tokens"] == 1
    n = metrics["valid_tokens"]  # the ruled step's denominator; without the rule it is n + 1 (the same terms)
    assert raw_metrics["loss"] == pytest.approx(metrics["loss"] * n / (n + 1), rel=1e-6)
    assert not raw_skipped
    assert bool(torch.isfinite(raw_grad).all()) and bool((raw_grad[b, s] == 0).all())
    # The loop always applies the rule: an old log-prob −inf reaching the step is a given input gone wrong, so its check
    # stops the step; with the rule nothing is left to report.
    with pytest.raises(ValueError, match=r"nonfinite inputs: 1 trained position\(s\) with a NaN / ±inf old"):
        check_replayed_step(raw_metrics, [with_old], None)
    check_replayed_step(metrics, [ruled], None)


@pytest.mark.parametrize("at_outside_target", [False, True], ids=["elsewhere", "at an outside target"])
def test_check_replayed_step_stops_on_other_nonfinite_inputs(at_outside_target: bool) -> None:
    """While replaying the ops run unchecked: a non-finite input other than the policy's −inf log-prob of a target
    outside the filter (here a NaN advantage) stops the step before the optimizer — also when it sits at the very
    position whose target is outside the filter (the loss counts such a position once)."""
    import dataclasses

    from mp_grpo.train.loop import check_replayed_step

    grpo = _grpo()
    mb, logits, (b, s), _ = _micro_batch_and_logits(loss_mask_at_boundary=at_outside_target)
    old_logits = logits.clone()
    old_logits[b, s] = logits[b, s].bfloat16().float()  # the old pass keeps the boundary token (a later update's case)
    with torch.no_grad():
        old, _ = grpo.token_logprobs(old_logits, mb)
    advantages = mb.advantages.clone()
    advantages[b] = float("nan")
    mb = dataclasses.replace(mb.with_logprobs(old_logprobs=old), advantages=advantages)
    _, metrics, grad, _ = _step(grpo, mb, logits)
    bad = int(mb.loss_mask[b].sum())
    assert bad > 0 and metrics["nonfinite_inputs"] == bad
    assert metrics["sampling_filter/outside_tokens"] == (1 if at_outside_target else 0)
    assert bool(torch.isfinite(grad).all())
    with pytest.raises(ValueError, match=f"nonfinite inputs: {bad} trained position"):
        check_replayed_step(metrics, [mb], None)


def test_later_update_dropping_a_kept_token_gives_no_term_and_no_gradient() -> None:
    """Old pass on logits that keep the token (its bf16-rounded row), the update's pass on logits that drop it."""
    from mp_grpo.train.loop import check_replayed_step, drop_outside_filter

    grpo = _grpo()
    mb, logits, (b, s), _ = _micro_batch_and_logits(loss_mask_at_boundary=True)
    old_logits = logits.clone()
    old_logits[b, s] = logits[b, s].bfloat16().float()
    with torch.no_grad():
        old, _ = grpo.token_logprobs(old_logits, mb)
    mb, dropped = drop_outside_filter(mb.with_logprobs(old_logprobs=old))
    assert int(dropped) == 0 and bool(mb.loss_mask[b, s]) and bool(torch.isfinite(old).all())
    loss, metrics, grad, skipped = _step(grpo, mb, logits)
    assert math.isfinite(loss) and all(math.isfinite(v) for v in metrics.values()), metrics
    # valid_tokens counts the positions with a term: the dropped one is not among them (it stays in the denominator)
    assert metrics["sampling_filter/outside_tokens"] == 1 and metrics["valid_tokens"] == int(mb.loss_mask.sum()) - 1
    assert metrics["nonfinite_inputs"] == 1  # the policy's −inf log-prob: dropped from the loss, counted
    assert bool(torch.isfinite(grad).all()) and bool((grad[b, s] == 0).all()) and bool((grad.abs().sum(-1) > 0).sum() > 1)
    check_replayed_step(metrics, [mb], None)  # expected while replaying: the step goes on


# ------------------------------------------------------------------------------------ the loop on layouts
STEPS = 2
TOL_LOSS_ABS = 1e-6
"""fp32 reduction order (as tests/train/test_trajectory_invariance.py): losses are sums of ~30 terms of size ~1."""
TOL_ON_POLICY_RATIO = 1e-6
"""On-policy ratios e^(log π − old): the same op on the same logits gives 1 exactly; fp32 rounding at most."""
TOL_GRAD_NORM_REL = 1e-5
"""fp32 reduction order over micro-batches, DP ranks and vocabulary shards, compounded over 2 Adam steps."""

BASE = [
    "model.vocab_size=16", "model.hidden_size=16", "model.max_sequence_length=8",
    f"train.steps={STEPS}", "train.lr=2e-2", "train.updates_per_rollout=1",
    "rollout.group_size=4", "rollout.prompt_min_length=1", "rollout.prompt_max_length=2",
    "task.completion_length=3", "output.progress_bar=false", "parallel.sequence_format=packed",
    "engine.dtype=bf16", "engine.top_k=6", f"engine.top_p={TOP_P}",
    "loss.kl.coef=0.01",  # the reference pass too (full-vocabulary log-probs)
]
# name -> (processes, overrides); every layout has 8 sequences a step
LAYOUTS = {
    "tp1_m1": (1, ["parallel.tensor_model_parallel_size=1", "train.num_microbatches=1", "train.micro_batch_size=8"]),
    "tp1_no_replay": (1, ["parallel.tensor_model_parallel_size=1", "train.num_microbatches=1", "train.micro_batch_size=8",
                          "engine.replay_filter=false"]),
    "tp2_m1": (2, ["parallel.tensor_model_parallel_size=2", "train.num_microbatches=1", "train.micro_batch_size=8"]),
    "dp2_m1": (2, ["parallel.tensor_model_parallel_size=1", "train.num_microbatches=1", "train.micro_batch_size=4"]),
}


def case_runs(names: list[str], out: str) -> None:
    from mp_grpo.config.job import load_job_config
    from mp_grpo.train.__main__ import config_path
    from mp_grpo.train.loop import run

    results = {}
    for name in names:
        filters = []
        records = run(load_job_config(config_path("cpu"), BASE + LAYOUTS[name][1]),
                      on_rollout=lambda micro: filters.extend(mb.sampling_filter for mb in micro))
        replayed = [(f.top_k, f.top_p) for f in filters if f is not None]
        results[name] = [dict(completions=r["completions"].tolist(), rewards=r["rewards"].tolist(),
                              loss=r["metrics"]["loss"], grad_norm=r["grad_norm"], outside=r["outside_filter"],
                              k3=r["metrics"]["mismatch/k3"], is_mean=r["metrics"]["is_weight/raw/mean"],
                              ratio=(r["metrics"]["ratio/min"], r["metrics"]["ratio/max"]), kl=r["metrics"]["kl"],
                              replayed=replayed) for r in records]
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))


def test_loop_replays_the_filter_on_every_layout(tmp_path: Path) -> None:
    results = {}
    for nproc in (1, 2):
        names = [n for n, (p, _) in LAYOUTS.items() if p == nproc]
        out = tmp_path / f"runs{nproc}.json"
        torchrun(__file__, "case_runs", nproc=nproc, names=names, out=str(out))
        results.update(json.loads(out.read_text()))
    no_replay = results.pop("tp1_no_replay")
    base = results["tp1_m1"]
    assert len(base) == STEPS
    for name, runs in results.items():
        assert len(runs) == STEPS, f"{name}: {len(runs)} steps recorded"
        for step, (a, b) in enumerate(zip(base, runs)):
            where = f"{name} step {step}"
            assert b["replayed"] and all(f == [6, TOP_P] for f in b["replayed"]), f"filter not replayed: {where}"
            assert b["completions"] == a["completions"] and b["rewards"] == a["rewards"], f"rollouts differ: {where}"
            assert b["outside"] == a["outside"], f"dropped fractions differ: {where}"
            # On-policy: the training pass's log-probs equal the old pass's, so it replays the filter too (without
            # it the ratio would be the kept mass, ~0.8).
            assert all(abs(r - 1.0) <= TOL_ON_POLICY_RATIO for r in b["ratio"]), f"training-pass ratios {b['ratio']}: {where}"
            assert abs(b["loss"] - a["loss"]) <= TOL_LOSS_ABS, f"loss {b['loss']} vs {a['loss']}: {where}"
            # KL(π_θ^filtered ‖ π_ref) on full-vocabulary reference log-probs: finite, and > 0 even at step 0
            # (θ = ref) by the filter's kept mass.
            assert 0.0 < b["kl"] < 1.0, f"kl {b['kl']}: {where}"
            assert abs(b["grad_norm"] - a["grad_norm"]) <= TOL_GRAD_NORM_REL * a["grad_norm"], \
                f"grad norm {b['grad_norm']} vs {a['grad_norm']}: {where}"
    assert no_replay[0]["completions"] == base[0]["completions"]  # the same engine; the updates then differ
    for step, (a, b) in enumerate(zip(base, no_replay)):
        assert not b["replayed"] and b["outside"] == 0.0
        # Replayed: the bf16 level (ratios 1 to bf16 precision); not: every ratio is its row's kept mass.
        assert a["k3"] < 1e-3 < b["k3"] and abs(a["is_mean"] - 1.0) < 0.01 and b["is_mean"] < 0.95, (a, b)
    assert len({round(r["grad_norm"], 9) for r in base}) == STEPS  # the run learns something


if __name__ == "__main__":
    worker_main({"case_runs": case_runs})
