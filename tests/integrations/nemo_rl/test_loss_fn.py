"""MPGRPOLossFn's protocol without NeMo-RL: a data dict in NeMo-RL's layout built here, NeMo-RL's call signature,
its global counts; values and gradients against float64 references. The logit input at TP = 2 and at CP = 2
under gloo (torchrun): each rank's share of the vocabulary or of the sequence, checked against the log-prob input
on the whole logits — with the step's counts, and with NeMo-RL's split-API placeholder counts rescaled by 1/N."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist

from mp_grpo.integrations.nemo_rl import InputType, MPGRPOLossFn
from mp_grpo.integrations.nemo_rl.data import logit_fields
from mp_grpo.megatron.context_parallel import cp_positions
from mp_grpo.megatron.groups import ParallelGroups
from tests.distributed import torchrun, worker_main
from tests.integrations.nemo_rl.helpers import data_dict, global_counts
from tests.reference import nemo_rl_clipped_pg_loss_reference
from tests.tolerances import assert_close

VOCAB = 12


def _step(dtype=torch.float64, far=False):
    return [data_dict(3, [9, 6, 8], [3, 2, 4], 10, sample_mask=[1.0, 1.0, 0.0], dtype=dtype, far=far),
            data_dict(4, [10, 5, 1], [2, 3, 1], 10, dtype=dtype, far=far)]


def _plain(mb):
    return {k: v for k, v in mb.items() if k != "_current"}


@pytest.mark.parametrize("far", [False, True], ids=["realistic", "far_log_ratio"])
def test_logprob_input_is_clipped_pg_loss_in_float64(far: bool) -> None:
    """Two micro-batches with NeMo-RL's global counts add up to NeMo-RL's ClippedPGLossFn of the whole step
    (tests/reference.py, float64), values and gradients."""
    mbs = _step(far=far)
    seqs, toks = global_counts(*mbs)
    loss_fn = MPGRPOLossFn("nemo_rl_grpo", overrides=["policy.log_ratio_clamp=null"])
    total, grads = 0.0, []
    for mb in mbs:
        lp = mb["_current"][:, 1:].clone().requires_grad_()
        loss, metrics = loss_fn(data=_plain(mb), global_valid_seqs=seqs, global_valid_toks=toks, next_token_logprobs=lp)
        loss.backward()
        total, grads = total + loss.detach(), grads + [lp.grad]
        assert isinstance(metrics["loss"], float) and metrics["loss"] == pytest.approx(loss.item(), rel=1e-12)
    cat = {k: torch.cat([mb[k] for mb in mbs]) for k in mbs[0]}
    lp = cat["_current"][:, 1:].clone().requires_grad_()
    mask = cat["token_mask"][:, 1:] * cat["sample_mask"].unsqueeze(-1)
    want = nemo_rl_clipped_pg_loss_reference(lp, cat["prev_logprobs"][:, 1:], cat["advantages"][:, 1:], mask != 0,
                                             reference_policy_logprobs=cat["reference_policy_logprobs"][:, 1:],
                                             reference_policy_kl_penalty=0.01)
    want.backward()
    assert_close(total, want, torch.float64, "loss")
    assert_close(torch.cat(grads), lp.grad, torch.float64, "d/dlogprobs")


def test_metrics_add_up_over_micro_batches() -> None:
    """NeMo-RL sums each metric over micro-batches: the shares add up to the step's token means."""
    mbs = _step()
    seqs, toks = global_counts(*mbs)
    loss_fn = MPGRPOLossFn("nemo_rl_grpo")
    metrics = [loss_fn(data=_plain(mb), global_valid_seqs=seqs, global_valid_toks=toks,
                       next_token_logprobs=mb["_current"][:, 1:])[1] for mb in mbs]
    cat = {k: torch.cat([mb[k] for mb in mbs]) for k in mbs[0]}
    mask = (cat["token_mask"][:, 1:] * cat["sample_mask"].unsqueeze(-1)) != 0
    d = (cat["generation_logprobs"] - cat["prev_logprobs"])[:, 1:][mask]
    ratio = torch.exp(cat["_current"][:, 1:] - cat["prev_logprobs"][:, 1:])[mask]
    expected = {"token_mult_prob_error": d.abs().exp().mean(), "gen_kl_error": (torch.exp(-d) - 1 + d).mean(),
                "policy_kl_error": (torch.exp(d) - 1 - d).mean(), "probs_ratio": ratio.mean(),
                "probs_ratio_clamped": ratio.clamp(0.8, 1.2).mean(), "sampling_importance_ratio": torch.exp(-d).mean()}
    for key, value in expected.items():
        assert sum(m[key] for m in metrics) == pytest.approx(value.item(), rel=1e-7), key
    assert min(m["probs_ratio_min"] for m in metrics) == pytest.approx(ratio.min().item(), rel=1e-12)
    assert max(m["probs_ratio_clamped_max"] for m in metrics) == pytest.approx(min(ratio.max().item(), 1.2), rel=1e-12)
    assert sum(m["num_valid_samples"] for m in metrics) == 5.0


def test_refusals_name_the_option() -> None:
    with pytest.raises(ValueError, match="entropy.bonus_coef needs the policy entropy.*LOGIT"):
        MPGRPOLossFn("nemo_rl_grpo", overrides=["entropy.bonus_coef=0.01"])
    with pytest.raises(ValueError, match="rollout_correction.normalize_weights needs the global mean"):
        MPGRPOLossFn("nemo_rl_grpo", overrides=["rollout_correction.weight_level=token",
                                                "rollout_correction.normalize_weights=true"])
    with pytest.raises(ValueError, match="entropy.top_quantile < 1 needs"):
        MPGRPOLossFn("nemo_rl_grpo", input_type=InputType.LOGIT, overrides=["entropy.top_quantile=0.2"])
    with pytest.raises(ValueError, match="count_empty_sequences=true"):
        MPGRPOLossFn("nemo_rl_grpo", overrides=["aggregation.mode=seq_mean_token_mean"])
    loss_fn = MPGRPOLossFn("nemo_rl_grpo")
    mb = _step()[0]
    with pytest.raises(TypeError, match="next_token_logprobs="):
        loss_fn(data=_plain(mb), global_valid_seqs=torch.tensor(3.0), global_valid_toks=torch.tensor(9.0),
                logits=torch.zeros(3, 10, VOCAB))
    with pytest.raises(KeyError, match="prev_logprobs"):
        loss_fn(data={k: v for k, v in _plain(mb).items() if k != "prev_logprobs"}, global_valid_seqs=torch.tensor(3.0),
                global_valid_toks=torch.tensor(9.0), next_token_logprobs=mb["_current"][:, 1:])


def test_interface_attributes_and_pickling() -> None:
    loss_fn = MPGRPOLossFn("nemo_rl_grpo", input_type=InputType.LOGIT)
    assert loss_fn.input_type.value == "logit" and loss_fn.loss_type.value == "token_level"
    assert loss_fn.reference_policy_kl_penalty == 0.01
    seq = MPGRPOLossFn("nemo_rl_grpo", overrides=["aggregation.mode=seq_mean_token_mean",
                                                   "aggregation.count_empty_sequences=true"])
    assert seq.loss_type.value == "sequence_level" and seq.metric_normalizations["loss"].value == "sequences"
    copy = pickle.loads(pickle.dumps(loss_fn))
    assert copy.input_type == loss_fn.input_type and copy.config == loss_fn.config and copy._loss is None


def test_from_master_config_picks_the_input() -> None:
    master = {"policy": {"megatron_cfg": {"enabled": True}, "generation": {"top_k": 20, "top_p": 1.0}},
              "grpo": {"skip_reference_policy_logprobs_calculation": False}}
    loss_fn = MPGRPOLossFn.from_master_config(master, "nemo_rl_grpo")
    assert loss_fn.kind == InputType.LOGIT and loss_fn.sampling_filter.top_k == 20 and loss_fn.sampling_filter.top_p is None
    master["policy"]["megatron_cfg"]["enabled"] = False
    assert MPGRPOLossFn.from_master_config(master, "nemo_rl_grpo").kind == InputType.LOGPROB
    master["grpo"]["skip_reference_policy_logprobs_calculation"] = True
    with pytest.raises(ValueError, match="reference log-probs"):
        MPGRPOLossFn.from_master_config(master, "nemo_rl_grpo")


def test_logit_fields_shift_then_cut() -> None:
    """Position t of the padded row predicts token t+1; the CP cut is NeMo-RL's chunks r and 2·CP−1−r."""
    mb = _step()[0]
    f = logit_fields(mb, ("advantages",), 12, None)
    assert f.target.shape == (3, 12)
    m = f.mask
    assert torch.equal(m[:, :9], (mb["token_mask"][:, 1:] != 0) & (mb["sample_mask"] != 0).unsqueeze(1))
    assert not m[:, 9:].any()
    assert torch.equal(f.target[m], mb["input_ids"][:, 1:][m[:, :9]])
    assert (f.target[~m] == -100).all()
    positions = cp_positions(12, 2, 1)
    assert positions.tolist() == [3, 4, 5, 6, 7, 8]
    with pytest.raises(ValueError, match="do not cover"):
        logit_fields(mb, (), 4, None)


# ----------------------------------------------------------------------------- the logit input, TP = 2 / CP = 2
def _logits(seed: int, mb) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(mb["input_ids"].shape[0], 12, VOCAB, generator=gen) * 2  # S_pad = 12 ≥ S = 10


def _reference(mbs, logits, overrides):
    """The log-prob input on the whole (float64) logits: the loss, d/dlogits and the metrics of each micro-batch."""
    seqs, toks = global_counts(*mbs)
    loss_fn = MPGRPOLossFn("nemo_rl_grpo", overrides=overrides)
    out = []
    for mb, x in zip(mbs, logits):
        full = x.double().requires_grad_()
        lp = torch.log_softmax(full[:, :9], -1).gather(-1, mb["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
        loss, metrics = loss_fn(data=_plain(mb), global_valid_seqs=seqs, global_valid_toks=toks,
                                next_token_logprobs=lp)
        loss.backward()
        out.append((loss.detach(), full.grad, metrics))
    return out


def case_logit_input(parallel: str, overrides: list[str]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mbs = _step(dtype=torch.float32)
    logits = [_logits(10 + i, mb) for i, mb in enumerate(mbs)]
    reference = _reference(mbs, logits, overrides)
    groups = ParallelGroups(tp=dist.group.WORLD) if parallel == "tp" else ParallelGroups(cp=dist.group.WORLD)
    loss_fn = MPGRPOLossFn("nemo_rl_grpo", overrides=overrides, input_type=InputType.LOGIT, groups=groups)
    seqs, toks = global_counts(*mbs)
    for i, (mb, x, (want, want_grad, want_metrics)) in enumerate(zip(mbs, logits, reference)):
        if parallel == "tp":
            v = VOCAB // world
            shard = x[..., rank * v:(rank + 1) * v]
            grad_slice = want_grad[..., rank * v:(rank + 1) * v]
        else:
            positions = cp_positions(12, world, rank)
            shard, grad_slice = x[:, positions], want_grad[:, positions]
        y = shard.clone().requires_grad_()
        returned, metrics = loss_fn(data=_plain(mb), global_valid_seqs=seqs, global_valid_toks=toks, logits=y)
        (returned / (world if parallel == "cp" else 1)).backward()  # NeMo-RL's Megatron worker: ÷ CP
        assert_close(y.grad, grad_slice, torch.float32, f"{parallel} rank {rank} d/dlogits [{i}]")
        total = returned.detach() / (world if parallel == "cp" else 1)
        if parallel == "cp":
            dist.all_reduce(total)
        assert_close(total, want, torch.float32, f"{parallel} loss [{i}]")
        for key in ("loss", "probs_ratio", "probs_ratio_min", "probs_ratio_max", "probs_ratio_clamped_max",
                    "kl_penalty", "token_mult_prob_error", "gen_kl_error", "policy_kl_error", "js_divergence_error",
                    "sampling_importance_ratio", "num_valid_samples"):
            assert_close(torch.tensor(metrics[key]), torch.tensor(want_metrics[key]), torch.float32,
                         f"{parallel} rank {rank} metric {key} [{i}]")
        # NeMo-RL's split API: placeholder counts, the raw sums rescaled by 1/N (1/S at sequence level)
        n = float(toks) if loss_fn.loss_type.value == "token_level" else float(seqs)
        y = shard.clone().requires_grad_()
        one = torch.tensor(1.0)
        raw, raw_metrics = loss_fn(data=_plain(mb), global_valid_seqs=one, global_valid_toks=one, logits=y)
        (raw / (world if parallel == "cp" else 1)).backward()
        assert_close(y.grad / n, grad_slice, torch.float32, f"{parallel} rank {rank} split API d/dlogits [{i}]")
        assert_close(torch.tensor(raw_metrics["loss"] / n), torch.tensor(want_metrics["loss"]), torch.float32,
                     f"{parallel} rank {rank} split API loss [{i}]")


OVERRIDES = {
    "grpo": [],
    "gspo_seq_mean": ["policy.objective=gspo", "policy.eps_low=0.01", "policy.eps_high=0.02",
                      "aggregation.mode=seq_mean_token_mean", "aggregation.count_empty_sequences=true"],
}


@pytest.mark.parametrize("parallel", ["tp", "cp"])
def test_logit_input_two_ranks(parallel: str) -> None:
    cases = ["grpo"] if parallel == "tp" else ["grpo", "gspo_seq_mean"]
    for name in cases:
        torchrun(__file__, "case_logit_input", nproc=2, parallel=parallel, overrides=OVERRIDES[name])


if __name__ == "__main__":
    worker_main({"case_logit_input": case_logit_input})
