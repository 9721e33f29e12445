"""NeMo-RL's asynchronous trainer path (the split API: placeholder counts, one rescale per step) with MPGRPOLossFn.

Each test runs one step of micro-batches twice: synchronously (NeMo-RL's global counts on every call) and as the
split API does (:mod:`.split_api`: counts of 1, then the rescale — NeMo-RL's own statements where its source is
present (``MP_GRPO_NEMO_RL_SRC``), the emulation pinned to them otherwise), and compares the step's loss, every
micro-batch's gradient and every metric: float64 to the float64 tolerance, float32 to fp32 rounding. A synchronous
metric divides by the count + 1e-8 (NeMo-RL's ``masked_mean``); the comparison takes that epsilon out. With
NeMo-RL's source, ``ClippedPGLossFn`` (synchronous, and on its own split-API step) on the same data too. Two DP
ranks under gloo; the refusal of each setting not linear in the step's count.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from mp_grpo.config import preset_names
from mp_grpo.integrations.nemo_rl import InputType, MPGRPOLossFn
from mp_grpo.integrations.nemo_rl.interfaces import MetricNormalizer
from mp_grpo.loss import StaleGlobalBatchError
from mp_grpo.megatron.groups import ParallelGroups
from tests.distributed import torchrun, worker_main
from tests.integrations.nemo_rl.helpers import data_dict, global_counts, nemo_rl_or_skip
from tests.integrations.nemo_rl.split_api import PLACEHOLDER, local_counts, nemo_rl_rescale, rescale
from tests.tolerances import assert_close

EMPTY_SEQS = ["aggregation.count_empty_sequences=true"]
FEEDABLE = {
    **{name: [] for name in ("megatron_lm_grpo", "nemo_rl_grpo", "trl_cispo", "trl_dapo", "trl_dr_grpo", "trl_grpo",
                             "trl_luspo", "trl_sapo", "trl_vespo", "verl_clip_cov", "verl_kl_cov", "verl_ppo",
                             "trl_dppo", "nemo_rl_dppo_binary_tv", "prime_rl_dppo")},
    "gspo": EMPTY_SEQS, "deepseek_v32": EMPTY_SEQS,  # NeMo-RL's S counts every row: the one override they need
}
"""Every preset NeMo-RL can feed (with its override): the log-prob input."""
REFUSED_PRESETS = {"mismatch_safe": "mismatch.skip_threshold", "areal_m2po": "m2po.bound"}
"""Presets refused on both paths, and the setting named."""
EPSILON = 1e-8
"""NeMo-RL's ``masked_mean`` epsilon, in the synchronous metrics."""


def _step(dtype: torch.dtype, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    mbs = [data_dict(seed, [9, 6, 8], [3, 2, 4], 10, sample_mask=[1.0, 1.0, 0.0], dtype=dtype),
           data_dict(seed + 1, [10, 5, 1], [2, 3, 1], 10, dtype=dtype),
           data_dict(seed + 2, [7, 10, 4], [1, 3, 2], 10, dtype=dtype)]
    for mb in mbs:
        mb["rewards"] = torch.tensor([1.0, -0.5, 0.3])
    return mbs


def _plain(mb):
    return {k: v for k, v in mb.items() if k != "_current"}


def _rescaler():
    """NeMo-RL's own rescale where its source is given (its imports must then work: else the test skips saying so,
    as the parity tests do), else the emulation (checked against NeMo-RL's by test_emulated_rescale_is_nemo_rls)."""
    own = nemo_rl_rescale()
    if own is not None:
        nemo_rl_or_skip()
    return own or rescale


def _call(loss_fn, mb, seqs, toks, logits=None, wrap=dict):
    """One micro-batch: (loss, d/d input, metrics); ``wrap`` makes the data dict (NeMo-RL: ``BatchedDataDict``).
    clip_cov's random selection is seeded alike on both paths."""
    torch.manual_seed(0)
    data = wrap(_plain(mb))
    if logits is None:
        x = mb["_current"][:, 1:].clone().requires_grad_()
        loss, metrics = loss_fn(data=data, global_valid_seqs=seqs, global_valid_toks=toks, next_token_logprobs=x)
    else:
        x = logits.clone().requires_grad_()
        loss, metrics = loss_fn(data=data, global_valid_seqs=seqs, global_valid_toks=toks, logits=x)
    loss.backward()
    return loss.detach(), x.grad, metrics


def synchronous(loss_fn, mbs, seqs, toks, logits=None):
    """Σ losses, the gradients and metrics of every micro-batch, with the step's counts."""
    out = [_call(loss_fn, mb, seqs, toks, None if logits is None else logits[i]) for i, mb in enumerate(mbs)]
    return sum(o[0] for o in out), [o[1] for o in out], [o[2] for o in out]


def split_api(loss_fn, mbs, logits=None, rescale_fn=None, group=None):
    """The split-API step: placeholder counts, then the rescale by the DP-reduced counts. Returns the step loss (this
    rank's Σ loss × 1/N), the rescaled gradients and metrics, and (seqs, toks)."""
    one = torch.tensor(PLACEHOLDER)
    out = [_call(loss_fn, mb, one, one, None if logits is None else logits[i]) for i, mb in enumerate(mbs)]
    counts = torch.stack([torch.stack(local_counts(mb)) for mb in mbs]).sum(0)
    if group is not None:
        dist.all_reduce(counts, group=group)
    seqs, toks = counts.unbind()
    r = (rescale_fn or _rescaler())(loss_fn.loss_type, loss_fn.metric_normalizations, [o[2] for o in out], seqs, toks)
    return r.loss, [o[1] * r.inv_n for o in out], r.metrics, (seqs, toks)


def compare(sync, split, normalizations, toks: float, dtype: torch.dtype, what: str) -> None:
    """The split-API step against the synchronous one: loss, gradients, every metric (the sync epsilon out)."""
    loss, grads, metrics = sync
    # NeMo-RL sums the step's loss in float32; the micro-batches' rescaled loss metrics carry it in full precision
    assert_close(torch.tensor(split[0], dtype=torch.float64), loss.double(), torch.float32, f"{what}: step loss")
    assert_close(torch.tensor(sum(m["loss"] for m in split[2]), dtype=torch.float64), loss.double(), dtype,
                 f"{what}: Σ rescaled loss metrics")
    for i, (g, w) in enumerate(zip(split[1], grads)):
        assert_close(g, w, dtype, f"{what}: gradient of micro-batch {i}")
    for i, (got, want) in enumerate(zip(split[2], metrics)):
        assert got.keys() == want.keys(), f"{what}: metric keys differ"
        for key in want:
            assert key in normalizations, f"{what}: metric {key} not advertised in metric_normalizations"
            expected = want[key]
            if key != "loss" and normalizations[key] is not MetricNormalizer.NONE and "_min" not in key \
                    and "_max" not in key:
                expected = want[key] * (toks + EPSILON) / toks
            if math.isinf(expected):
                assert got[key] == expected, f"{what}: metric {key} [{i}]"
                continue
            assert_close(torch.tensor(float(got[key])), torch.tensor(float(expected)), dtype, f"{what}: metric {key} [{i}]")


# ----------------------------------------------------------------------------- every preset, log-prob input
def test_every_preset_is_fed_or_refused() -> None:
    assert set(FEEDABLE) | set(REFUSED_PRESETS) == set(preset_names())
    for preset, key in REFUSED_PRESETS.items():
        with pytest.raises(ValueError, match=f"^config: {key} needs"):
            MPGRPOLossFn(preset)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("preset", sorted(FEEDABLE))
def test_split_api_step_equals_the_synchronous_step(preset: str, dtype: torch.dtype) -> None:
    mbs = _step(dtype)
    seqs, toks = global_counts(*mbs)
    loss_fn = MPGRPOLossFn(preset, overrides=FEEDABLE[preset])
    sync = synchronous(loss_fn, mbs, seqs.to(dtype), toks.to(dtype))
    split = split_api(loss_fn, mbs)
    compare(sync, split, loss_fn.metric_normalizations, float(toks), dtype, preset)


# ----------------------------------------------------------------------------- the logit input (the Megatron worker's)
LOGIT_CASES = {
    "nemo_rl_grpo_entropy_bonus": ("nemo_rl_grpo", ["entropy.bonus_coef=0.01"]),
    "trl_grpo": ("trl_grpo", []),
    "gspo": ("gspo", EMPTY_SEQS),
}


def _logits(mbs, dtype, vocab=11, seed=10):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(*mb["input_ids"].shape, vocab, generator=gen, dtype=torch.float64) * 2).to(dtype) for mb in mbs]


@pytest.mark.parametrize("case", sorted(LOGIT_CASES))
def test_split_api_logit_input(case: str) -> None:
    preset, overrides = LOGIT_CASES[case]
    mbs = _step(torch.float32)
    logits = _logits(mbs, torch.float32)
    seqs, toks = global_counts(*mbs)
    loss_fn = MPGRPOLossFn(preset, overrides=overrides, input_type=InputType.LOGIT, groups=ParallelGroups())
    sync = synchronous(loss_fn, mbs, seqs, toks, logits)
    split = split_api(loss_fn, mbs, logits)
    compare(sync, split, loss_fn.metric_normalizations, float(toks), torch.float32, case)


# ----------------------------------------------------------------------------- against NeMo-RL's ClippedPGLossFn
def test_emulated_rescale_is_nemo_rls() -> None:
    """The emulation the DP test's workers use is NeMo-RL's own statements, on every kind of metric."""
    nemo_rl_or_skip()
    own = nemo_rl_rescale()
    assert own is not None, "MP_GRPO_NEMO_RL_SRC does not hold nemo_rl/models/policy/workers/megatron_policy_worker.py"
    for overrides in ([], ["aggregation.mode=seq_mean_token_mean", *EMPTY_SEQS]):
        loss_fn = MPGRPOLossFn("nemo_rl_grpo", overrides=overrides)
        names = [*loss_fn.metric_normalizations, "not_advertised"]
        metrics = [{name: float(i + 1) * (j + 2) for j, name in enumerate(names)} for i in range(2)]
        seqs, toks = torch.tensor(5.0, dtype=torch.float64), torch.tensor(17.0, dtype=torch.float64)
        assert own(loss_fn.loss_type, loss_fn.metric_normalizations, metrics, seqs, toks) == \
            rescale(loss_fn.loss_type, loss_fn.metric_normalizations, metrics, seqs, toks)


def _nemo_split_api(nemo, mbs, batched, rescale_fn):
    """ClippedPGLossFn on the split API: its placeholder calls, then NeMo-RL's rescale."""
    one = torch.tensor(PLACEHOLDER)
    out = []
    for mb in mbs:
        lp = mb["_current"][:, 1:].clone().requires_grad_()
        loss, m = nemo(next_token_logprobs=lp, data=batched(_plain(mb)), global_valid_seqs=one, global_valid_toks=one)
        loss.backward()
        out.append((lp.grad, m))
    counts = torch.stack([torch.stack(local_counts(mb)) for mb in mbs]).sum(0)
    r = rescale_fn(nemo.loss_type, nemo.metric_normalizations, [m for _, m in out], *counts.unbind())
    return r.loss, [g * r.inv_n for g, _ in out], r.metrics


@pytest.mark.parametrize("case", ["grpo", "dual_clip_clip_higher", "tis", "k2_no_kl_clamps", "sequence_level"])
def test_split_api_matches_clipped_pg_loss(case: str) -> None:
    loss_mod = nemo_rl_or_skip()
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    from tests.integrations.nemo_rl.test_parity import CASES, EXACT, SKIP_METRICS

    nemo_kwargs, overrides = CASES[case]
    mbs = _step(torch.float32, seed=sum(map(ord, case)))
    seqs, toks = global_counts(*mbs)
    nemo = loss_mod.ClippedPGLossFn(loss_mod.ClippedPGLossConfig(**nemo_kwargs))
    ours = MPGRPOLossFn("nemo_rl_grpo", overrides=overrides + EXACT)
    own = nemo_rl_rescale()
    want_sync = [_call(nemo, mb, seqs, toks, wrap=BatchedDataDict) for mb in mbs]
    want_split = _nemo_split_api(nemo, mbs, BatchedDataDict, own)
    got = split_api(ours, mbs, rescale_fn=own)
    skip = SKIP_METRICS | ({"kl_penalty"} if case == "sequence_level" else set())  # stated differences
    for name, (loss, grads, metrics) in {
        "ClippedPGLossFn": (sum(w[0] for w in want_sync), [w[1] for w in want_sync], [w[2] for w in want_sync]),
        "ClippedPGLossFn on the split API": (torch.tensor(want_split[0]), want_split[1], want_split[2]),
    }.items():
        assert_close(torch.tensor(got[0]), loss, torch.float32, f"{case} vs {name}: loss")
        for i, (g, w) in enumerate(zip(got[1], grads)):
            assert_close(g, w, torch.float32, f"{case} vs {name}: gradient [{i}]")
        for i, (g, w) in enumerate(zip(got[2], metrics)):
            for key in sorted(set(w) - skip):
                assert_close(torch.tensor(float(g[key])), torch.tensor(float(w[key])), torch.float32,
                             f"{case} vs {name}: metric {key} [{i}]")


def test_vapo_is_not_linear_in_the_step_count() -> None:
    """NeMo-RL's VAPO term is the micro-batch's own mean: its own split-API step scales it by 1/N, unlike its
    synchronous step — mp_grpo refuses the placeholder call instead."""
    loss_mod = nemo_rl_or_skip()
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    mbs = _step(torch.float64)
    seqs, toks = global_counts(*mbs)
    nemo = loss_mod.ClippedPGLossFn(loss_mod.ClippedPGLossConfig(positive_example_nll_weight=0.1))
    sync = sum(_call(nemo, mb, seqs, toks, wrap=BatchedDataDict)[0] for mb in mbs)
    split = _nemo_split_api(nemo, mbs, BatchedDataDict, nemo_rl_rescale())[0]
    assert abs(split - float(sync)) > 1e-3, (split, float(sync))
    ours = MPGRPOLossFn("nemo_rl_grpo", overrides=["nll.positive_coef=0.1"])
    one = torch.tensor(PLACEHOLDER)
    with pytest.raises(ValueError, match="nll.positive_coef"):
        ours(data=_plain(mbs[0]), global_valid_seqs=one, global_valid_toks=one,
             next_token_logprobs=mbs[0]["_current"][:, 1:])


# ----------------------------------------------------------------------------- refusals, stale counts
def test_step_level_settings_are_refused_at_construction() -> None:
    cases = {
        "rollout_correction.normalize_weights": (["rollout_correction.weight_level=token",
                                                  "rollout_correction.normalize_weights=true"], InputType.LOGPROB),
        "entropy.top_quantile < 1": (["entropy.top_quantile=0.2"], InputType.LOGIT),
        "mismatch.skip_threshold": (["mismatch.skip_threshold=0.1"], InputType.LOGPROB),
        "nonfinite.skip_step": (["nonfinite.skip_step=true"], InputType.LOGPROB),
        "entropy.adaptive": (["entropy.adaptive=true", "entropy.bonus_coef=0.01"], InputType.LOGIT),
    }
    for key, (overrides, kind) in cases.items():
        with pytest.raises(ValueError, match=f"^config: {key} needs .* switch it off$"):
            MPGRPOLossFn("nemo_rl_grpo", overrides=overrides, input_type=kind)


NONLINEAR_ON_SPLIT_API = {
    "nll.positive_coef": ["nll.positive_coef=0.1"],
    "aggregation.regularizer_mode": ["aggregation.mode=seq_mean_token_mean", *EMPTY_SEQS,
                                     "aggregation.regularizer_mode=token_mean"],
}


@pytest.mark.parametrize("key", sorted(NONLINEAR_ON_SPLIT_API))
def test_settings_not_linear_in_the_count_are_refused_on_the_split_api(key: str) -> None:
    """Accepted with real counts; refused at the first placeholder call, and at construction from the
    SingleController's master config (it has ``async_rl``)."""
    overrides = NONLINEAR_ON_SPLIT_API[key]
    loss_fn = MPGRPOLossFn("nemo_rl_grpo", overrides=overrides)
    mbs = _step(torch.float64)
    seqs, toks = global_counts(*mbs)
    synchronous(loss_fn, mbs, seqs, toks)
    one = torch.tensor(PLACEHOLDER)
    with pytest.raises(ValueError, match=f"^config \\(NeMo-RL's split-API trainer.*{key}") as err:
        loss_fn(data=_plain(mbs[0]), global_valid_seqs=one, global_valid_toks=one,
                next_token_logprobs=mbs[0]["_current"][:, 1:])
    assert "\n" not in str(err.value)
    master = {"policy": {"megatron_cfg": {"enabled": False}}, "grpo": {}, "async_rl": {}}
    with pytest.raises(ValueError, match=f"^config \\(NeMo-RL's split-API trainer.*{key}"):
        MPGRPOLossFn.from_master_config(master, "nemo_rl_grpo", overrides)
    del master["async_rl"]
    MPGRPOLossFn.from_master_config(master, "nemo_rl_grpo", overrides)


def test_real_counts_keep_the_stale_count_check() -> None:
    """Only both counts exactly 1 are placeholders: other counts that a micro-batch exceeds are refused."""
    mb = _step(torch.float64)[0]  # 9 valid tokens, 2 sequences
    loss_fn = MPGRPOLossFn("nemo_rl_grpo")
    for seqs, toks in ((3.0, 5.0), (3.0, 1.0), (1.0, 5.0)):
        with pytest.raises(StaleGlobalBatchError, match="does not fit in this GlobalBatch's counts"):
            loss_fn(data=_plain(mb), global_valid_seqs=torch.tensor(seqs), global_valid_toks=torch.tensor(toks),
                    next_token_logprobs=mb["_current"][:, 1:])
    one = torch.tensor(PLACEHOLDER)
    loss_fn(data=_plain(mb), global_valid_seqs=one, global_valid_toks=one, next_token_logprobs=mb["_current"][:, 1:])
    loss_fn(data=_plain(mb), global_valid_seqs=1, global_valid_toks=1.0, next_token_logprobs=mb["_current"][:, 1:])


def test_from_master_config_reads_pydantic_sections() -> None:
    """NeMo-RL's MasterConfig holds ``grpo`` and ``loss_fn`` as pydantic models (attributes, no ``get``)."""
    master = SimpleNamespace(policy={"megatron_cfg": {"enabled": True}},
                             grpo=SimpleNamespace(skip_reference_policy_logprobs_calculation=False,
                                                  seq_logprob_error_threshold=None),
                             loss_fn=SimpleNamespace(force_on_policy_ratio=False))
    assert MPGRPOLossFn.from_master_config(master, "nemo_rl_grpo").kind == InputType.LOGIT
    master.grpo.skip_reference_policy_logprobs_calculation = True
    with pytest.raises(ValueError, match="reference log-probs"):
        MPGRPOLossFn.from_master_config(master, "nemo_rl_grpo")
    master.grpo.skip_reference_policy_logprobs_calculation = False
    master.loss_fn.force_on_policy_ratio = True
    with pytest.raises(ValueError, match="^loss_fn.force_on_policy_ratio: .*prev_logprobs"):
        MPGRPOLossFn.from_master_config(master, "nemo_rl_grpo")
    master.grpo.seq_logprob_error_threshold = 0.5  # NeMo-RL computes the old log-probs then
    MPGRPOLossFn.from_master_config(master, "nemo_rl_grpo")


# ----------------------------------------------------------------------------- two DP ranks (gloo)
def case_two_dp_ranks(preset: str, overrides: list[str], logit: bool) -> None:
    """Each rank holds its own micro-batches of the step; the split API's counts are all-reduced over DP as
    ``finish_train_step`` does. Every rank's gradients and metrics equal the synchronous step's, and so does the
    DP-summed loss."""
    rank = dist.get_rank()
    mbs = _step(torch.float32, seed=20)
    extra = _step(torch.float32, seed=30)
    step = mbs + extra  # rank 0: mbs, rank 1: extra
    seqs, toks = global_counts(*step)
    mine = mbs if rank == 0 else extra
    logits = _logits(mine, torch.float32, seed=40 + rank) if logit else None
    kind = InputType.LOGIT if logit else InputType.LOGPROB
    loss_fn = MPGRPOLossFn(preset, overrides=overrides, input_type=kind, groups=ParallelGroups() if logit else None)
    sync = synchronous(loss_fn, mine, seqs, toks, logits)
    split = split_api(loss_fn, mine, logits, rescale_fn=rescale, group=dist.group.WORLD)
    assert float(split[3][1]) == float(toks) and float(split[3][0]) == float(seqs)
    totals = torch.tensor([float(sync[0]), split[0]], dtype=torch.float64)
    dist.all_reduce(totals)
    assert_close(totals[1], totals[0], torch.float32, f"rank {rank}: the DP-summed step loss")
    compare(sync, split, loss_fn.metric_normalizations, float(toks), torch.float32, f"{preset} rank {rank}")


def test_split_api_two_dp_ranks() -> None:
    for preset, overrides, logit in (("nemo_rl_grpo", [], True), ("trl_grpo", [], False)):
        torchrun(__file__, "case_two_dp_ranks", nproc=2, preset=preset, overrides=overrides, logit=logit)


if __name__ == "__main__":
    worker_main({"case_two_dp_ranks": case_two_dp_ranks})
