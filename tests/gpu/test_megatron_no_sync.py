"""No host synchronization inside the Megatron micro-batch loop (one GPU; skipped without CUDA).

Run::

    python -m pytest tests/gpu/test_megatron_no_sync.py -v -s

One ``torchrun`` rank (NCCL), megatron-core's GPTModel (local layer spec) with DDP, padded micro-batches moved
to the GPU with ``MicroBatch.to`` and the step's GlobalBatch built from them (its all-reduce and the
entropy quantile may synchronize: that is data preparation, once per step). After one warm-up step, for
every micro-batch, under ``torch.cuda.set_sync_debug_mode("error")`` (any synchronizing CUDA call raises):

* MegatronGRPO's ``forward_step`` — the model call and the returned ``loss_func`` (log-probs with the
  default ``check_inputs=True``, GRPOLoss, the scaling) — and
* the backward of the loss through the log-prob op to the model output (``torch.autograd.grad``).

For logits and fused output paths, both loss contracts and a step-level config. Then a micro-batch with a
token id outside the vocabulary goes through the same loop without a sync and without an error, and the
error, naming ``target``, is raised at the step's sync point (``MegatronGRPO.reduce_metrics``). The whole
``forward_backward_func`` step is also run under ``"warn"`` and its synchronizations counted and printed
(megatron-core's schedule and DDP included; informational).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the worker processes run this file as a script

from tests.gpu.launch import init_nccl, torchrun, worker_main  # noqa: E402

VOCAB = 512
LOSS_CONFIGS = {
    "ppo_token_tis": ["rollout_correction.weight_level=token", "rollout_correction.weight_max=2.0"],
    "step_level": ["rollout_correction.weight_level=token", "rollout_correction.weight_max=2.0",
                   "rollout_correction.normalize_weights=true", "entropy.top_quantile=0.5",
                   "mismatch.skip_threshold=10.0"],
}
CASES = [("logits", False, "ppo_token_tis"), ("logits", True, "step_level"), ("fused", True, "ppo_token_tis"),
         ("fused", False, "step_level")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_host_sync_in_the_micro_batch_loop() -> None:
    print(torchrun(__file__, "case_no_sync", 1)[-6000:])


def case_no_sync() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mp_grpo.config import load_config
    from mp_grpo.config.job import ModelConfig, OutputPath, ParallelConfig, ParamsDtype, RolloutConfig
    from mp_grpo.megatron import MegatronGRPO, prepare_micro_batch
    from mp_grpo.megatron.gpt import build_gpt_for_training
    from mp_grpo.train.synthetic import synthesize_rollouts

    init_nccl()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    cfg = RolloutConfig(group_size=4, prompt_min_length=4, prompt_max_length=12, completion_min_length=4,
                        completion_max_length=40, tool_mask_fraction=0.2, mismatch_std=0.1)
    r = synthesize_rollouts(cfg, num_sequences=8, vocab_size=VOCAB, seed=3).rollouts
    gen = torch.Generator().manual_seed(4)
    old = -torch.rand(r.tokens.shape, generator=gen) * 4.0 - 0.5
    rollouts = type(r)(tokens=r.tokens, lengths=r.lengths, loss_mask=r.loss_mask, advantages=r.advantages,
                       old_logprobs=old, rollout_logprobs=old + 0.1 * torch.randn(r.tokens.shape, generator=gen))
    for output_path, per_token, name in CASES:
        built = build_gpt_for_training(
            ModelConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_attention_heads=4, max_sequence_length=64,
                        params_dtype=ParamsDtype("fp32"), init_seed=1),
            ParallelConfig(tensor_model_parallel_size=1, calculate_per_token_loss=per_token, average_in_collective=False))
        grpo = MegatronGRPO(load_config(None, LOSS_CONFIGS[name]), temperature=0.8, calculate_per_token_loss=per_token,
                            output_path=OutputPath(output_path))
        where = f"[{output_path}, per_token={per_token}, {name}]"

        def step_inputs(step: int, bad_token: bool = False):
            micro = [prepare_micro_batch(rollouts.select(slice(i, i + 4)), seq_len=64).to("cuda") for i in (0, 4)]
            if bad_token:
                targets = micro[1].targets.clone()
                targets[micro[1].loss_mask.nonzero()[0].unbind()] = VOCAB + 7
                micro[1] = dataclasses.replace(micro[1], targets=targets)
            entropies = None
            if grpo.config.entropy.top_quantile < 1:
                with torch.no_grad():
                    entropies = [grpo.model_logprobs(built.model, mb)[1] for mb in micro]
            return micro, grpo.global_batch(micro, step=step, entropies=entropies)

        # --- warm-up (Triton compilation, allocator) ---
        micro, batch = step_inputs(0)
        get_forward_backward_func()(forward_step_func=grpo.forward_step_func(batch, step=0), data_iterator=iter(micro),
                                    model=built.model, num_microbatches=2, seq_length=64, micro_batch_size=4)
        # --- the loop of our code under "error": forward step, loss function, backward to the model output ---
        for step, bad in ((1, False), (2, True)):
            micro, batch = step_inputs(step, bad)  # (the entropy pass of a bad step records the bad id too)
            forward_step = grpo.forward_step_func(batch, step=step)
            torch.cuda.synchronize()
            losses = []
            torch.cuda.set_sync_debug_mode("error")
            try:
                for mb in micro:
                    output, loss_func = forward_step(iter([mb]), built.model)
                    out = loss_func(output)
                    torch.autograd.grad(out[0], output)
                    losses.append(out[-1])
            finally:
                torch.cuda.set_sync_debug_mode(0)
            if bad:
                with pytest.raises(ValueError, match=r"target has \d+ token id\(s\) outside \[0, 512\)"):
                    grpo.reduce_metrics(losses)
                print(f"{where} bad token id: no sync in the loop, named error at reduce_metrics")
            else:
                metrics = grpo.reduce_metrics(losses)
                print(f"{where} zero synchronizations in the micro-batch loop; loss {metrics['loss']:.6f}")
        # --- informational: synchronizations of the whole forward_backward_func step ---
        micro, batch = step_inputs(3)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                get_forward_backward_func()(forward_step_func=grpo.forward_step_func(batch, step=3),
                                            data_iterator=iter(micro), model=built.model, num_microbatches=2,
                                            seq_length=64, micro_batch_size=4)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
        print(f"{where} whole forward_backward_func (schedule, DDP, finalize included): {len(syncs)} "
              f"synchronizing call(s) {json.dumps(syncs[:4])}")
    ps.destroy_model_parallel()


if __name__ == "__main__":
    worker_main({"case_no_sync": case_no_sync})
