"""Megatron-LM's RL loop under pipeline parallelism on GPUs: ``GRPOForwardStep`` (``mp_grpo.integrations.megatron_rl``)
as the ``forward_step`` of megatron-core's real ``forward_backward_func`` at PP = 2 gives the gradients and the
reported loss of PP = 1 (needs 2 CUDA GPUs; skipped otherwise).

Run on a machine with ≥ 2 GPUs::

    NCCL_NVLS_ENABLE=0 python -m pytest tests/gpu/test_megatron_rl_pipeline.py -v -s

Megatron-LM itself (``megatron.training``, ``megatron.rl``) is not installed: its three entries that the forward
step reads are stood in for — ``get_args()`` (the run's arguments: iteration, loss options,
``calculate_per_token_loss``, no sequence packing), ``get_rl_runtime_state()`` (a sequence counter) — and
megatron-core's own ``num_microbatches_calculator`` gives M. Everything else is megatron-core's: GPTModel
(local layer spec, fp32, 2 layers; ``tests/gpu/test_megatron_pipeline.py``'s model), DDP,
``finalize_model_grads`` and the 1F1B schedule.

1. ``case_run`` at PP = 1 (1 GPU): the whole step of 8 sequences padded to 64 tokens, as Megatron-LM's unpacked
   data iterator gives them (tokens, advantages, old / reference / inference log-probs, loss mask), as ONE
   micro-batch; the initial weights, DDP's ``main_grad`` and what ``forward_backward_func`` returned (Megatron-LM's
   ``[sum, count]`` metric pairs, reduced as its ``train_step`` does) are saved.
2. ``case_run`` at PP = 2 (2 GPUs, one layer per stage): the same weights and items, 2 micro-batches of 4, the
   same call on both stages. Every stage's gradients must equal the reference's for the parameters it holds
   (relative L2 within the fp32 tolerance), the last stage's reduced metrics the reference's, and the step's
   skip decision (mismatch monitor, which every stage makes from its own copy of the micro-batches: a broadcast
   over PP inside the schedule would deadlock against 1F1B's first p2p receive) must be PP = 1's on both stages.

The model is called as Megatron-LM calls it: ``runtime_gather_output=False`` (the logits stay sharded), one THD
segment per row (``PackedSeqParams``) and ``fp32_output``. megatron-core's local attention takes no THD
parameters; causal attention over each whole row, which it computes without them, is what one segment per row
means — ``LocalSpecCall`` checks that the segments are the rows and drops them (and ``fp32_output``: the model
is fp32, without ``Float16Module``).

Variants: ``calculate_per_token_loss`` on / off × (Megatron-LM's loss from its arguments — clip, KL, its
sampled-token entropy term, IS correction —, a step-level config: IS-weight normalization + mismatch monitor).
"""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the worker processes run this file as a script

from tests.gpu.launch import init_nccl, torchrun, worker_main  # noqa: E402

NUM_SEQUENCES = 8
OLD_LOGPROB_STD = 0.1
"""Old log-probs: the uniform policy's −log V (what the freshly built model gives) plus this noise, so that ratios
stay near 1 and most tokens have a gradient."""
MEGATRON_LM_ARGS = dict(grpo_clamp_eps_lower=0.2, grpo_clamp_eps_upper=0.28, grpo_kl_beta=0.05,
                        grpo_entropy_term_weight=0.01, rl_inference_logprobs_is_correction=True,
                        rl_importance_sampling_truncation_coef=2.0)
STEP_LEVEL = ["rollout_correction.weight_level=token", "rollout_correction.weight_max=2.0",
              "rollout_correction.normalize_weights=true", "mismatch.skip_threshold=100.0"]
LOSS_CONFIGS = ["megatron_lm_args", "step_level"]
VARIANTS = [(per_token, name) for per_token in (False, True) for name in LOSS_CONFIGS]
REPORTED = ("lm loss", "rl/kl_term", "rl/pi_over_pi_old")
"""Megatron-LM's metric keys every variant reports (its entropy term only with an entropy bonus)."""
TINY_NORM = 1e-30


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_forward_step_pipeline_equals_one_stage(tmp_path: Path) -> None:
    print(torchrun(__file__, "case_run", 1, out_dir=str(tmp_path), pp=1))
    print(torchrun(__file__, "case_run", 2, out_dir=str(tmp_path), pp=2))


# ------------------------------------------------------------------------------------------------ workers
def _items() -> list[tuple[torch.Tensor, ...]]:
    """The step's 8 rows as Megatron-LM's unpacked data iterator yields them, one row per item: (tokens [1, S],
    advantages [1], old log-probs [1, S-1], loss mask [1, S], position ids [1, S], reference and inference
    log-probs [1, S-1]). Items are concatenated into micro-batches by :func:`_micro_batch_items`."""
    from tests.gpu.test_megatron_pipeline import SEQ_LEN, VOCAB

    gen = torch.Generator().manual_seed(11)
    n, s = NUM_SEQUENCES, SEQ_LEN
    tokens = torch.randint(0, VOCAB, (n, s), generator=gen)
    prompt = torch.randint(4, 12, (n, 1), generator=gen)
    length = torch.randint(s // 2, s + 1, (n, 1), generator=gen)
    positions = torch.arange(s).unsqueeze(0)
    loss_mask = ((positions >= prompt) & (positions < length)).float()
    old = -math.log(VOCAB) + OLD_LOGPROB_STD * torch.randn(n, s - 1, generator=gen)
    ref = old + 0.3 * torch.randn(n, s - 1, generator=gen)
    inference = old + 0.2 * torch.randn(n, s - 1, generator=gen)
    advantages = torch.randn(n, generator=gen)
    return [(tokens[r:r + 1], advantages[r:r + 1], old[r:r + 1], loss_mask[r:r + 1], positions.clone(),
             ref[r:r + 1], inference[r:r + 1]) for r in range(n)]


def _micro_batch_items(num_microbatches: int) -> list[tuple[torch.Tensor, ...]]:
    rows = _items()
    size = NUM_SEQUENCES // num_microbatches
    return [tuple(torch.cat(field) for field in zip(*rows[i * size:(i + 1) * size])) for i in range(num_microbatches)]


def _stand_in_megatron_lm(args: SimpleNamespace, counted: list[int]) -> None:
    """``megatron.training.get_args`` and ``megatron.rl.rl_utils.get_rl_runtime_state``, the Megatron-LM entries the
    forward step reads (Megatron-LM is not installed beside megatron-core)."""
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: args
    rl = types.ModuleType("megatron.rl")
    rl.__path__ = []
    rl_utils = types.ModuleType("megatron.rl.rl_utils")
    rl_utils.get_rl_runtime_state = lambda: SimpleNamespace(increment_sequences=counted.append)
    sys.modules.update({"megatron.training": training, "megatron.rl": rl, "megatron.rl.rl_utils": rl_utils})


class LocalSpecCall:
    """The DDP-wrapped GPTModel as Megatron-LM's forward step calls it, for megatron-core's local layer spec (see
    the module docstring): the THD segments must be the rows; they and ``fp32_output`` are dropped."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def modules(self):
        return self.model.modules()

    def __call__(self, tokens, position_ids, attention_mask, *, packed_seq_params, runtime_gather_output, fp32_output):
        rows = tokens.shape[1]
        cu = packed_seq_params.cu_seqlens_q.tolist()
        if packed_seq_params.qkv_format != "thd" or cu != [0, rows] or packed_seq_params.cu_seqlens_kv.tolist() != cu:
            raise AssertionError(f"expected one THD segment per row of {rows} tokens, got {packed_seq_params}")
        if not fp32_output:
            raise AssertionError("the run's arguments say fp32 (no --bf16 / --fp16): fp32_output must be True")
        return self.model(tokens, position_ids, attention_mask, runtime_gather_output=runtime_gather_output)


def _forward_step(name: str):
    """A fresh forward step (its ``calculate_per_token_loss`` read from the run's arguments at the first call)."""
    from mp_grpo.integrations.megatron_rl import GRPOForwardStep

    if name == "megatron_lm_args":
        return GRPOForwardStep.from_args(SimpleNamespace(**MEGATRON_LM_ARGS))
    return GRPOForwardStep("megatron_lm_grpo", overrides=STEP_LEVEL)


def _reduced(losses: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Megatron-LM's ``train_step`` reduction of the ``[sum, count]`` pairs over the micro-batches (DP = 1)."""
    if not losses:
        return {}
    out = {}
    for key in losses[0]:
        total = torch.stack([d[key].float() for d in losses]).sum(0)
        out[key] = float(total[0] / total[1])
    return out


def case_run(out_dir: str, pp: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests.gpu.test_megatron_pipeline import SEQ_LEN, _build, _gathered_grads, _load
    from tests.tolerances import tolerance

    init_nccl()
    ps.initialize_model_parallel(pipeline_model_parallel_size=pp)
    out = Path(out_dir)
    num_microbatches = pp  # PP = 1: the whole step as one micro-batch; PP = 2: two
    size = NUM_SEQUENCES // num_microbatches
    init_num_microbatches_calculator(dist.get_rank(), None, NUM_SEQUENCES, size, 1)
    if pp == 1:
        _, gpt = _build(False)
        torch.save({n: p.detach().float().cpu().clone() for n, p in gpt.named_parameters()}, out / "weights.pt")
    weights = torch.load(out / "weights.pt")
    rtol = tolerance(torch.float32)["rtol"]
    failures = []
    for iteration, (per_token, name) in enumerate(VARIANTS):
        args = SimpleNamespace(curr_iteration=iteration, rl_use_sequence_packing=False, calculate_per_token_loss=per_token,
                               fp16=False, bf16=False, **MEGATRON_LM_ARGS)
        counted: list[int] = []
        _stand_in_megatron_lm(args, counted)
        ddp, gpt = _build(per_token)
        _load(gpt, weights)
        step = _forward_step(name)
        ddp.zero_grad_buffer()
        losses = get_forward_backward_func()(
            forward_step_func=lambda data_iterator, model: step(data_iterator, LocalSpecCall(model)),
            data_iterator=iter(_micro_batch_items(num_microbatches)), model=ddp, num_microbatches=num_microbatches,
            seq_length=SEQ_LEN, micro_batch_size=size, forward_only=False)
        grads = _gathered_grads(gpt)
        reduced = _reduced(losses)
        skip = step._step.batch.skip_step()
        stage = ps.get_pipeline_model_parallel_rank()
        where = f"pp{pp} stage {stage} per_token={per_token} {name}"
        if counted != [size] * num_microbatches:
            failures.append(f"the runtime state counted {counted} sequences, expected {[size] * num_microbatches} [{where}]")
        result = out / f"{name}_{per_token}.pt"
        if pp == 1:
            missing = [k for k in REPORTED if k not in reduced]
            if missing:
                failures.append(f"Megatron-LM's metric keys {missing} missing from {sorted(reduced)} [{where}]")
            torch.save({"grads": grads, "reduced": reduced, "skip": skip}, result)
            print(f"{where}: lm loss {reduced.get('lm loss', math.nan):.6f}, skip_step {skip}")
            continue
        ref = torch.load(result)
        errors = {n: float((g - ref["grads"][n]).norm() / ref["grads"][n].norm().clamp(min=TINY_NORM))
                  for n, g in grads.items()}
        failures += [f"grad {n}: relative L2 error {e:.2e} > {rtol:.1e} [{where}]" for n, e in errors.items()
                     if not e <= rtol]
        if skip != ref["skip"]:
            failures.append(f"skip_step {skip} vs reference {ref['skip']} [{where}]")
        if ps.is_pipeline_last_stage():
            if set(reduced) != set(ref["reduced"]):
                failures.append(f"metric keys {sorted(reduced)} vs reference {sorted(ref['reduced'])} [{where}]")
            failures += [f"{k}: {reduced[k]:.8g} vs reference {v:.8g} [{where}]" for k, v in ref["reduced"].items()
                         if k in reduced and not math.isclose(reduced[k], v, rel_tol=rtol, abs_tol=rtol)]
        elif losses:
            failures.append(f"a stage before the last returned {len(losses)} losses [{where}]")
        worst = max(errors, key=errors.get)
        print(f"{where}: {len(errors)} parameters, worst relative L2 error {errors[worst]:.2e} ({worst})"
              + (f"; lm loss {reduced['lm loss']:.6f} (reference {ref['reduced']['lm loss']:.6f})"
                 if "lm loss" in reduced else ""))
    destroy_num_microbatches_calculator()
    ps.destroy_model_parallel()
    assert not failures, "\n".join(failures)


if __name__ == "__main__":
    worker_main({"case_run": case_run})
