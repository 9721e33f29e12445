"""forward_logprobs with megatron-core GPTModel through the real forward_backward_func on one GPU.

    python -m pytest tests/gpu/test_forward_only.py -v -s     (skipped without CUDA)

For fp32 and bf16 (Float16Module) parameters, logits and fused output paths, padded micro-batches: the
forward-only pass (``forward_backward_func(forward_only=True)``) returns, per micro-batch, what
the model called directly (:meth:`MegatronGRPO.model_logprobs`) gives, within fp32 tolerance, and — in fp32 — the float64
reference on GPTModel's full logits within ``tests/tolerances``' fp32 tolerance. It also runs the
learning job's GPU config for a few steps (``python -m mp_grpo.train --config gpu``) to check the job
starts on GPTModel and its rewards are finite.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the worker processes run this file as a script

from tests.gpu.launch import gpu_run, init_nccl, torchrun, torchrun_cmd, worker_main  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("output_path", ["logits", "fused"])
def test_forward_logprobs_gpt_one_gpu(dtype: str, output_path: str) -> None:
    print(torchrun(__file__, "case_forward_logprobs", 1, dtype=dtype, output_path=output_path))


@needs_gpu
def test_learning_job_gpu_config_starts(tmp_path: Path) -> None:
    log = tmp_path / "log.json"
    out = gpu_run(torchrun_cmd(1, "-m", "mp_grpo.train", "--config", "gpu", "train.steps=3", "output.progress_bar=false",
                               f"output.dir={tmp_path}"), what="the learning job")
    assert "GPU: megatron-core GPTModel" in out
    steps = json.loads(log.read_text())["steps"]
    assert len(steps) == 3 and all(0.0 <= s["reward"] <= 1.0 for s in steps)


def case_forward_logprobs(dtype: str, output_path: str) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mp_grpo.config import load_config
    from mp_grpo.config.job import ModelConfig, OutputPath, ParallelConfig, ParamsDtype, RolloutConfig
    from mp_grpo.megatron import MegatronGRPO, ParallelGroups, prepare_micro_batch
    from mp_grpo.megatron.forward_only import forward_logprobs
    from mp_grpo.megatron.gpt import build_gpt_for_training
    from mp_grpo.train.synthetic import synthesize_rollouts
    from tests.reference import logprobs_reference
    from tests.tolerances import assert_close

    init_nccl()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        model_cfg = ModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_attention_heads=4,
                                max_sequence_length=64, params_dtype=ParamsDtype(dtype), init_seed=1234)
        built = build_gpt_for_training(model_cfg, ParallelConfig())
        model = built.model
        rollouts = synthesize_rollouts(RolloutConfig(group_size=4, completion_max_length=40), num_sequences=8,
                                       vocab_size=512, seed=3).rollouts
        micro = [prepare_micro_batch(rollouts.select(slice(i, i + 4)), seq_len=64).to("cuda") for i in (0, 4)]
        grpo = MegatronGRPO(load_config(None, []), temperature=0.8, num_microbatches=2, calculate_per_token_loss=False,
                            groups=ParallelGroups.from_parallel_state(), output_path=OutputPath(output_path))
        kwargs = {"fp32_output": False} if dtype == "bf16" else {}
        out = forward_logprobs(grpo, get_forward_backward_func(), model, micro, model_kwargs=kwargs)
        for i, (mb, lp, ent) in enumerate(zip(micro, out.logprobs, out.entropy)):
            with torch.no_grad():
                direct, direct_ent = grpo.model_logprobs(model, mb, model_kwargs=kwargs)
            assert_close(lp, direct, torch.float32, msg=f"micro-batch {i} vs model_logprobs")
            assert_close(ent, direct_ent, torch.float32, msg=f"entropy {i} vs model_logprobs")
            if dtype == "fp32":
                with torch.no_grad():
                    logits = model(mb.input_ids, mb.position_ids, None)
                ref, ref_ent = logprobs_reference(logits, mb.targets, temperature=0.8)
                # OutputRows.LOSS (the default): the output layer computes the loss rows alone, 0 elsewhere
                ref_ent = torch.where(mb.loss_mask, ref_ent, torch.zeros_like(ref_ent))
                assert_close(lp, ref, torch.float32, msg=f"micro-batch {i} vs float64")
                assert_close(ent, ref_ent, torch.float32, msg=f"entropy {i} vs float64")
        print(f"forward_logprobs == model_logprobs [{dtype}, {output_path}]: {len(micro)} micro-batches")
    finally:
        ps.destroy_model_parallel()


if __name__ == "__main__":
    worker_main({"case_forward_logprobs": case_forward_logprobs})
