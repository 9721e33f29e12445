"""GRPOForwardStep without Megatron-LM: its loss on sharded logits, the pre-step account, what ``loss_func`` hands
Megatron's schedule, and the forward step's glue with Megatron-LM's modules stood in for. Context parallelism
(packed bins) and tensor parallelism at 2 ranks under gloo (torchrun)."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from mp_grpo.integrations.megatron_rl import EntropyTerm, GRPOForwardStep, loss_config_from_args
from mp_grpo.megatron.context_parallel import thd_cp_positions
from mp_grpo.megatron.groups import ParallelGroups
from mp_grpo.megatron.scaling import MegatronScaling
from tests.distributed import torchrun, worker_main
from tests.integrations.megatron_rl.helpers import packed_bin, unpacked
from tests.tolerances import assert_close

VOCAB = 16


def _logits(seed: int, shape) -> torch.Tensor:
    return torch.randn(*shape, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def _reference(step: GRPOForwardStep, mbs, logits):
    """The objective and d/dlogits in float64 through the log-prob path (log_softmax of the whole vocabulary)."""
    stored = step.pre_step(mbs, step=0)
    total, grads = 0.0, []
    for x, z in zip(stored.inputs, logits):
        full = z.double().requires_grad_()
        lp = torch.log_softmax(full, -1).gather(-1, x.target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        lp = torch.where(x.target >= 0, lp, torch.zeros((), dtype=torch.float64))
        entropy = -(torch.softmax(full, -1) * torch.log_softmax(full, -1)).sum(-1)
        cfg = step.config
        share, _ = step.loss(lp, x.old_logprobs, x.advantages, x.mask,
                             rollout_logprobs=x.inference_logprobs if cfg.needs_rollout_logprobs else None,
                             ref_logprobs=x.ref_logprobs if cfg.kl.coef else None,
                             entropy=entropy if cfg.needs_entropy and step.entropy_term == EntropyTerm.FULL else
                             (-lp.exp() * lp if cfg.needs_entropy else None), batch=stored.batch, layout=x.layout)
        share.backward()
        total, grads = total + share.detach(), grads + [full.grad]
    return total, grads


@pytest.mark.parametrize("entropy_term", list(EntropyTerm))
def test_loss_on_logits_matches_float64(entropy_term: EntropyTerm) -> None:
    step = GRPOForwardStep("megatron_lm_grpo", overrides=["entropy.bonus_coef=0.01", "kl.coef=0.05"],
                           entropy_term=entropy_term, groups=ParallelGroups())
    pairs = [unpacked(1, 3, 10, dtype=torch.float32), unpacked(2, 2, 10, dtype=torch.float32)]
    mbs = [p[0] for p in pairs]
    logits = [_logits(10 + i, mb.tokens.shape) for i, mb in enumerate(mbs)]
    want, want_grads = _reference(step, mbs, logits)
    stored = step.pre_step(mbs, step=0)
    total = 0.0
    for i, (x, z) in enumerate(zip(stored.inputs, logits)):
        y = z.clone().requires_grad_()
        share, metrics = step.loss_on_logits(y, x, stored.batch)
        share.backward()
        total = total + share.detach()
        assert_close(y.grad, want_grads[i], torch.float32, f"d/dlogits [{i}]")
        assert ("entropy" in metrics) == (entropy_term == EntropyTerm.FULL or step.config.needs_entropy)
    assert_close(total, want, torch.float32, "objective")


@pytest.mark.parametrize("per_token", [True, False])
def test_loss_func_hands_megatron_its_scaling(per_token: bool) -> None:
    step = GRPOForwardStep("megatron_lm_grpo", groups=ParallelGroups())
    pairs = [unpacked(1, 3, 10, dtype=torch.float32), unpacked(2, 2, 10, dtype=torch.float32)]
    mbs = [p[0] for p in pairs]
    stored = step.pre_step(mbs, step=7)
    scaling = MegatronScaling(calculate_per_token_loss=per_token, num_microbatches=2, dp_size=1)
    outs, shares = [], []
    for i, x in enumerate(stored.inputs):
        z = _logits(20 + i, mbs[i].tokens.shape)
        outs.append(step.loss_func(x, stored.batch, scaling, z))
        shares.append(step.loss_on_logits(z, x, stored.batch)[0].detach())
    tokens = float(stored.batch.valid_tokens)
    for out, share, x in zip(outs, shares, stored.inputs):
        if per_token:
            loss, num_tokens, metrics = out
            assert int(num_tokens) == int(x.mask.sum()) and loss.item() == pytest.approx(tokens * share.item(), rel=1e-6)
        else:
            loss, metrics = out
            assert loss.item() == pytest.approx(2 * share.item(), rel=1e-6)
        assert {"lm loss", "rl/kl_term", "rl/pi_over_pi_old"} <= set(metrics)
        assert all(v.numel() == 2 for v in metrics.values())  # Megatron-LM reduces [sum, count] pairs exactly
    # Megatron-LM's train_step: Σ over micro-batches of each pair, then num / den
    reduced = torch.stack([o[-1]["lm loss"] for o in outs]).sum(0)
    assert (reduced[0] / reduced[1]).item() == pytest.approx(sum(shares).item(), rel=1e-5)


def test_loss_config_from_args_and_refusals() -> None:
    args = SimpleNamespace(grpo_clamp_eps_lower=0.2, grpo_clamp_eps_upper=0.28, grpo_kl_beta=0.05,
                           grpo_entropy_term_weight=0.01, rl_inference_logprobs_is_correction=True,
                           rl_importance_sampling_truncation_coef=2.0)
    cfg = loss_config_from_args(args)
    assert (cfg.policy.eps_low, cfg.policy.eps_high, cfg.kl.coef, cfg.entropy.bonus_coef) == (0.2, 0.28, 0.05, 0.01)
    assert cfg.rollout_correction.weight_max == 2.0 and cfg.policy.log_ratio_clamp is None and cfg.kl.input_clamp is None
    with pytest.raises(ValueError, match="top_quantile"):
        GRPOForwardStep("megatron_lm_grpo", overrides=["entropy.top_quantile=0.2"])
    with pytest.raises(TypeError, match="EntropyTerm"):
        GRPOForwardStep("megatron_lm_grpo", entropy_term="sampled_token")
    step = GRPOForwardStep("megatron_lm_grpo", overrides=["rollout_correction.weight_level=token"], groups=ParallelGroups())
    mb, _ = unpacked(1, 2, 8, with_inference=False, dtype=torch.float32)
    stored = step.pre_step([mb], step=0)
    with pytest.raises(ValueError, match="inference log-probs"):
        step.loss_on_logits(_logits(0, mb.tokens.shape), stored.inputs[0], stored.batch)


def test_forward_step_glue_with_megatron_stood_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """``__call__`` with Megatron-LM's modules replaced by stand-ins: the pre-step hook pulls the iteration's M
    micro-batches once (a new iteration pulls the next M), the model is called with runtime_gather_output=False,
    and the loss_func's per-token scaling uses the step's account."""
    pairs = [unpacked(i, 2, 8, dtype=torch.float32) for i in range(4)]
    items = [(mb.tokens, mb.advantages, mb.old_logprobs, torch.cat([mb.loss_mask[:, :1], mb.loss_mask], 1),
              mb.position_ids, mb.ref_logprobs, mb.inference_logprobs) for mb, _ in pairs]
    args = SimpleNamespace(curr_iteration=0, rl_use_sequence_packing=False, rl_inference_logprobs_is_correction=False,
                           calculate_per_token_loss=True, fp16=False, bf16=False)
    counted = []
    stand_ins = {
        "megatron.training": types.SimpleNamespace(get_args=lambda: args),
        "megatron.rl": types.ModuleType("megatron.rl"),
        "megatron.rl.rl_utils": types.SimpleNamespace(get_rl_runtime_state=lambda: SimpleNamespace(
            increment_sequences=counted.append)),
    }
    for name, module in stand_ins.items():
        monkeypatch.setitem(sys.modules, name, module)
    import megatron.core.num_microbatches_calculator as calc
    import megatron.core.parallel_state as ps
    monkeypatch.setattr(calc, "get_num_microbatches", lambda: 2)
    monkeypatch.setattr(ps, "is_pipeline_last_stage", lambda *a, **k: True)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)

    calls = []

    class Model(torch.nn.Module):
        def forward(self, tokens, position_ids, attention_mask, *, packed_seq_params, runtime_gather_output, fp32_output):
            calls.append(runtime_gather_output)
            return _logits(int(tokens.sum()), tokens.shape)

    step = GRPOForwardStep("megatron_lm_grpo", groups=ParallelGroups())
    iterator = iter(items)
    for iteration in (0, 1):
        args.curr_iteration = iteration
        for _ in range(2):
            logits, loss_func = step(iterator, Model())
            loss, num_tokens, metrics = loss_func(logits)
            assert loss.requires_grad is False and int(num_tokens) > 0
        assert step._step.step == iteration and step._step.micro_batches[0].tokens.equal(pairs[2 * iteration][0].tokens)
    assert calls == [False] * 4 and counted == [2] * 4
    with pytest.raises(StopIteration):
        next(iterator)  # exactly 2 × M items were read


# ----------------------------------------------------------------------------- 2 ranks: CP (packed bins), TP
def case_two_ranks(parallel: str, overrides: list[str]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if parallel == "cp":
        pairs = [packed_bin(3, [6, 9, 4], 4, 24, dtype=torch.float32), packed_bin(4, [9, 3], 4, 16, dtype=torch.float32)]
        groups = ParallelGroups(cp=dist.group.WORLD, dp_cp=dist.group.WORLD)
    else:
        pairs = [unpacked(1, 3, 10, dtype=torch.float32), unpacked(2, 2, 10, dtype=torch.float32)]
        groups = ParallelGroups(tp=dist.group.WORLD)
    mbs = [p[0] for p in pairs]
    logits = [_logits(30 + i, mb.tokens.shape) for i, mb in enumerate(mbs)]
    single = GRPOForwardStep("megatron_lm_grpo", overrides=overrides, groups=ParallelGroups())
    want, want_grads = _reference(single, mbs, logits)
    step = GRPOForwardStep("megatron_lm_grpo", overrides=overrides, groups=groups)
    stored = step.pre_step(mbs, step=0)
    assert float(stored.batch.valid_tokens) == float(sum(mb.loss_mask.sum() for mb in mbs))
    total = torch.zeros((), dtype=torch.float64)
    for i, (mb, x, z) in enumerate(zip(mbs, stored.inputs, logits)):
        if parallel == "cp":
            positions = thd_cp_positions(torch.tensor(list(mb.seq_starts) + [mb.tokens.shape[1]] * (mb.seq_starts[-1] !=
                                                                                                     mb.tokens.shape[1])),
                                         world, rank)
            assert torch.equal(x.positions, positions)
            shard, grad = z[:, positions], want_grads[i][:, positions]
        else:
            v = VOCAB // world
            shard, grad = z[..., rank * v:(rank + 1) * v], want_grads[i][..., rank * v:(rank + 1) * v]
        y = shard.clone().requires_grad_()
        share, metrics = step.loss_on_logits(y, x, stored.batch)
        share.backward()
        assert_close(y.grad, grad, torch.float32, f"{parallel} rank {rank} d/dlogits [{i}]")
        total = total + share.detach().double()
        # The loss rows' logits alone (OutputRows.LOSS, what _model_forward returns then): the same share, metrics
        # and gradient at the rows.
        rows = stored.rows[i]
        y_rows = rows.gather(shard).unsqueeze(0).requires_grad_()
        share_rows, metrics_rows = step.loss_on_logits(y_rows, x, stored.batch, rows)
        share_rows.backward()
        assert_close(share_rows, share, torch.float32, f"{parallel} rank {rank} share on the loss rows [{i}]")
        assert sorted(metrics_rows) == sorted(metrics)
        for key, value in metrics.items():
            assert_close(metrics_rows[key], value, torch.float32, f"{parallel} rank {rank} metric {key} [{i}]")
        assert_close(y_rows.grad[0], rows.gather(grad), torch.float32, f"{parallel} rank {rank} rows' d/dlogits [{i}]")
    if parallel == "cp":
        dist.all_reduce(total)  # CP ranks hold shares of every sequence
    assert_close(total, want, torch.float32, f"{parallel} objective")


@pytest.mark.parametrize("parallel", ["cp", "tp"])
def test_two_ranks(parallel: str) -> None:
    overrides = (["policy.objective=gspo", "aggregation.mode=seq_mean_token_mean", "kl.coef=0.05"]
                 if parallel == "cp" else ["entropy.bonus_coef=0.01"])
    torchrun(__file__, "case_two_ranks", nproc=2, parallel=parallel, overrides=overrides)


if __name__ == "__main__":
    worker_main({"case_two_ranks": case_two_ranks})
