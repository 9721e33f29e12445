"""``model.output_rows`` through the learning loop (mp_grpo/train/loop.py, CPU, TP = 1, one process).

The main job's output layer computes the completion tokens' rows alone (``output_rows=loss``, the default) in the
training step and in the forward-only pass of the old log-probs — the prompt rows, about a third of a micro-batch
here, are skipped (checked on the output layer's output). The learning curve is the same as with every row
(``output_rows=all``) for the same seed, in fp32 and in bf16 (the stand-in under Megatron's bf16 contract): the same
completions and rewards at every step, the loss and the gradient norm equal to fp32 reduction order (the weight
gradient sums the loss rows' products only, where every row's sum also adds the other rows' exact zeros). On the CPU
the GEMMs of the loss rows give the same bits as on every row, so bf16 takes the same trajectory too; on a GPU,
where cuBLAS may tile a GEMM of another shape differently, a bf16 run can tip one sample and then differs step by
step while learning alike (``docs/megatron.md``, "The loss rows alone").
"""

from __future__ import annotations

import pytest

from tests.train.test_loop_logit_dtype import world_of_one  # noqa: F401  (the fixture)

STEPS = 3
JOB = ("parallel.tensor_model_parallel_size=1", "parallel.sequence_format=padded", f"train.steps={STEPS}",
       "train.num_microbatches=2", "train.micro_batch_size=4", "rollout.group_size=8", "rollout.prompt_min_length=2",
       "rollout.prompt_max_length=5", "task.completion_length=4", "output.progress_bar=false", "train.lr=5e-2")
TOL_LOSS_ABS = 1e-6
"""fp32 reduction order: the loss is a sum of ~100 terms of size ~1, eps32 ≈ 1.2e-7 (as the layout-invariance test)."""
TOL_GRAD_NORM_REL = 1e-5
"""fp32 reduction order of the output weight's gradient (K rows instead of N), compounded over the steps."""


def _run(dtype: str, rows: str) -> tuple[list[dict], list[tuple[int, int]]]:
    """The records of a run, and per output-layer call (rows computed, rows of the micro-batch)."""
    from mp_grpo.config.job import load_job_config
    from mp_grpo.train.__main__ import config_path
    from mp_grpo.train.loop import run

    cfg = load_job_config(config_path("cpu"), [*JOB, f"model.params_dtype={dtype}", f"engine.dtype={dtype}",
                                               f"model.output_rows={rows}"])
    calls: list[tuple[int, int]] = []
    positions: list[int] = []

    def hook(trainer) -> None:
        def count(module, args, output):
            logits = output[0]
            calls.append((logits.shape[0] * logits.shape[1], positions[-1]))

        trainer.policy.output_layer.register_forward_hook(count)
        original = trainer.policy.forward

        def forward(input_ids, *args, **kwargs):
            positions.append(input_ids.numel())
            return original(input_ids, *args, **kwargs)

        trainer.policy.forward = forward

    return run(cfg, on_trainer=hook), calls


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_same_learning_curve_without_the_prompt_rows(world_of_one, dtype) -> None:  # noqa: F811
    every, every_calls = _run(dtype, "all")
    loss, loss_calls = _run(dtype, "loss")
    assert all(computed == held for computed, held in every_calls), every_calls
    skipped = [1 - computed / held for computed, held in loss_calls]
    assert len(loss_calls) == len(every_calls) and min(skipped) > 0.2, f"rows skipped per call: {skipped}"
    assert len(every) == len(loss) == STEPS
    for step, (a, b) in enumerate(zip(every, loss)):
        where = f"{dtype}, step {step}"
        assert b["completions"].tolist() == a["completions"].tolist(), f"completions differ: {where}"
        assert b["rewards"].tolist() == a["rewards"].tolist(), f"rewards differ: {where}"
        assert abs(b["metrics"]["loss"] - a["metrics"]["loss"]) <= TOL_LOSS_ABS, where
        assert abs(b["grad_norm"] - a["grad_norm"]) <= TOL_GRAD_NORM_REL * a["grad_norm"], where
    assert len({round(r["grad_norm"], 9) for r in every}) == STEPS  # the run moves: not a constant
    print(f"\n{dtype}: rows skipped by the output layer {min(skipped):.0%}–{max(skipped):.0%}; the same "
          f"{STEPS}-step trajectory (mean reward {sum(r['reward'] for r in loss) / STEPS:.3f})")
