"""Transformer Engine's layer spec on GPUs: packed (THD) micro-batches through ``MegatronGRPO`` give what padded ones
give; the learning job learns on packed micro-batches; context parallelism through TE's ring attention gives the
CP = 1 gradients. Skipped without CUDA, without Transformer Engine, or without the GPUs a case needs — saying which.

    PYTHONPATH=$PYTHONPATH:<TE's site> NVTE_FRAMEWORK=pytorch NCCL_NVLS_ENABLE=0 python -m pytest tests/gpu/test_megatron_te.py -v -s

Every case is a fresh ``torchrun`` (``tests/gpu/launch.py``: NCCL, ``NVIDIA_TF32_OVERRIDE=0`` — TE runs fp32 GEMMs on
TF32 tensor cores otherwise, and the fp32 comparisons below would miss by ~10×). The model: megatron-core's
GPTModel as the main job builds it (``mp_grpo.megatron.gpt``: TE's spec wherever TE imports — the cases check that
it did —, 2 layers, hidden 64, 4 heads, V = 512, learned positions), 8 synthetic sequences of 5–52 tokens in two
micro-batches of 4, the whole step through megatron-core's ``forward_backward_func``.

1. ``test_packed_thd_equals_padded`` (one GPU), fp32 and bf16 (``Float16Module``), logits and fused output paths,
   two loss configs (PPO + token TIS; GSPO + seq-mean + geometric IS weight + entropy bonus: per-sequence sums that
   must stay per segment): the same step with padded ``[B, S]`` micro-batches (TE's attention in ``sbhd``) and packed
   ``[1, T]`` ones (TE's attention with ``cu_seqlens``) — the reduced loss and every metric, every parameter's
   gradient (DDP's fp32 ``main_grad``) and the forward-only pass's log-probs (``forward_logprobs``, mapped to the
   packed layout) agree: fp32 within ``tests/tolerances``' fp32 rtol (relative L2, every parameter), bf16 within its
   rtol over all gradients and ``BF16_PER_PARAMETER_RTOL`` per parameter (``test_megatron_gpt``), log-probs at bf16
   tolerance. In bf16 also packed with every segment padded to a multiple of 4, as CP = 2 pads it
   (``cu_seqlens_padded`` ≠ ``cu_seqlens``: TE's attention skips the padding between sequences; what it leaves there
   must reach no gradient). Not in fp32: for padding between sequences TE 2.x has no fp32 attention backend (its
   unfused attention refuses it, its fused ones are 16-bit).
2. ``test_learning_job_packed_learns`` (one GPU): ``python -m mp_grpo.train --config gpu
   parallel.sequence_format=packed`` for ``LEARN_STEPS`` steps on TE's spec; its mean reward over the last steps
   rises beyond the 95 % interval of the first steps' (``mp_grpo.train.report.reward_change``).
3. ``test_context_parallel_through_te_equals_cp1`` (``cp2``: 2 GPUs; ``tp2_cp2``: 4): bf16 packed micro-batches cut
   over CP = 2 by ``prepare_micro_batch`` (segments padded to multiples of 4, chunks r and 3 − r of each), TE's ring
   attention, the same weights (sharded over TP): the loss, the metrics and the gradients (gathered over TP) equal
   the CP = 1 run's at bf16 tolerance, both output paths. bf16 only: TE's context-parallel attention runs on its
   fused (16-bit) backends.
"""

from __future__ import annotations

import math
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the worker processes run this file as a script

from tests.gpu.launch import gpu_run, init_nccl, needs_gpus, torchrun, torchrun_cmd, worker_main  # noqa: E402

NUM_SEQUENCES, NUM_MICROBATCHES = 8, 2
VOCAB, HIDDEN = 512, 64
TEMPERATURE = 0.8
CP_SEGMENT_MULTIPLE = 4
"""Segments padded to a multiple of 2·CP at CP = 2: the layout the one-GPU bf16 case imitates."""
LOSS_CONFIGS = {
    "ppo_token_tis": ["rollout_correction.weight_level=token", "rollout_correction.weight_max=2.0"],
    "gspo_seq_mean": ["policy.objective=gspo", "aggregation.mode=seq_mean_token_mean",
                      "rollout_correction.weight_level=geometric", "rollout_correction.weight_max=1.5",
                      "kl.coef=0.0", "entropy.bonus_coef=0.01"],
}
OUTPUT_PATHS = ("logits", "fused")
CP_LAYOUTS = {"cp2": dict(tp=1, cp=2, gpus=2), "tp2_cp2": dict(tp=2, cp=2, gpus=4)}
LEARN_STEPS = 20
"""Steps of the packed learning job: the issue's run went from a mean reward of 0.008 to 0.241 in 20 steps."""
TINY_NORM = 1e-30
"""Floor of a reference gradient's norm in the relative error."""


def _have_te() -> bool:
    from mp_grpo.megatron.gpt import have_transformer_engine

    return have_transformer_engine()


needs_te = pytest.mark.skipif(not _have_te(), reason="needs Transformer Engine: transformer_engine does not import "
                              "(PYTHONPATH with TE's site, NVTE_FRAMEWORK=pytorch)")
pytestmark = [pytest.mark.gpu, needs_te]


# ------------------------------------------------------------------------------------------------ pytest
@needs_gpus(1)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_packed_thd_equals_padded(dtype: str) -> None:
    print(torchrun(__file__, "case_packed_vs_padded", 1, dtype=dtype))


@needs_gpus(1)
def test_learning_job_packed_learns(tmp_path: Path) -> None:
    import json

    from mp_grpo.train.report import reward_change

    out = gpu_run(torchrun_cmd(1, "-m", "mp_grpo.train", "--config", "gpu", "parallel.sequence_format=packed",
                               f"train.steps={LEARN_STEPS}", "output.progress_bar=false", f"output.dir={tmp_path}"),
                  what="the learning job on packed micro-batches")
    print(out[-4000:])
    assert "(transformer_engine layer spec" in out, "the job did not build TE's layer spec"
    change = reward_change(json.loads((tmp_path / "log.json").read_text())["steps"])
    assert change.verdict == "rose", (f"mean reward {change.first:.3f} (steps {change.first_steps}) → {change.last:.3f} "
                                      f"(steps {change.last_steps}), noise ±{change.noise}: {change.verdict}")


@pytest.fixture(scope="module")
def cp1_reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("te_cp1_reference")
    print(torchrun(__file__, "case_cp_reference", 1, out_dir=str(out)))
    return out


@needs_gpus(2)
@pytest.mark.parametrize("layout", sorted(CP_LAYOUTS))
def test_context_parallel_through_te_equals_cp1(layout: str, cp1_reference: Path) -> None:
    gpus = CP_LAYOUTS[layout]["gpus"]
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"{layout} needs {gpus} CUDA GPUs, this machine has {torch.cuda.device_count()}")
    print(torchrun(__file__, "case_cp", gpus, out_dir=str(cp1_reference), layout=layout))


# ------------------------------------------------------------------------------------------------ workers
def _rollouts():
    from mp_grpo.config.job import RolloutConfig
    from mp_grpo.megatron.rollouts import Rollouts
    from mp_grpo.train.synthetic import synthesize_rollouts

    cfg = RolloutConfig(group_size=4, prompt_min_length=4, prompt_max_length=12, completion_min_length=1,
                        completion_max_length=40, tool_mask_fraction=0.2, mismatch_std=0.1)
    r = synthesize_rollouts(cfg, num_sequences=NUM_SEQUENCES, vocab_size=VOCAB, seed=5).rollouts
    gen = torch.Generator().manual_seed(6)
    rollout = -torch.rand(r.tokens.shape, generator=gen) * 6.0 - 2.0  # independent of the model: weights ≠ 1
    return Rollouts(tokens=r.tokens, lengths=r.lengths, loss_mask=r.loss_mask, advantages=r.advantages,
                    rollout_logprobs=rollout)


def _build(dtype: str, *, tp: int = 1, cp: int = 1):
    """GPTModel as the main job builds it, for packed micro-batches; refuses to run on any spec but TE's."""
    from mp_grpo.config.job import ModelConfig, ParallelConfig, ParamsDtype, SequenceFormat
    from mp_grpo.megatron.gpt import build_gpt_for_training

    model = ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=2, num_attention_heads=4,
                        max_sequence_length=64, params_dtype=ParamsDtype(dtype), init_seed=1234)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp,
                              sequence_format=SequenceFormat.PACKED)
    built = build_gpt_for_training(model, parallel)
    assert built.layer_spec == "transformer_engine", f"built the {built.layer_spec} layer spec"
    return built


@contextmanager
def segments_padded_to(multiple: int):
    """``prepare_micro_batch`` packing as it does under CP = multiple / 2 — every segment padded to a multiple of
    ``multiple`` — on one GPU (at CP = 1 it pads nothing); restored afterwards."""
    from mp_grpo.megatron.packed import PackedLayout

    descriptor, original = PackedLayout.__dict__["build"], PackedLayout.build

    def build(lengths, *, segment_multiple: int = 1, total_multiple: int | None = None):
        return original(lengths, segment_multiple=multiple, total_multiple=None)

    PackedLayout.build = staticmethod(build)
    try:
        yield
    finally:
        PackedLayout.build = descriptor


def _micro_batches(fmt: str, cp_group=None) -> list:
    from mp_grpo.megatron import prepare_micro_batch

    rollouts, size = _rollouts(), NUM_SEQUENCES // NUM_MICROBATCHES
    return [prepare_micro_batch(rollouts.select(slice(i * size, (i + 1) * size)), sequence_format=fmt,
                                cp_group=cp_group).to("cuda") for i in range(NUM_MICROBATCHES)]


def _step(ddp, dtype: str, config_name: str, output_path: str, micro: list) -> dict:
    """One training ``forward_backward_func`` and one forward-only pass over ``micro``: the reduced metrics, every
    parameter's ``main_grad`` (this rank's shard, fp32, on the CPU) and the forward-only log-probs."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mp_grpo.config import load_config
    from mp_grpo.config.job import OutputPath
    from mp_grpo.megatron import MegatronGRPO
    from mp_grpo.megatron.forward_only import forward_logprobs

    kwargs = {"fp32_output": False} if dtype == "bf16" else None
    grpo = MegatronGRPO(load_config(None, LOSS_CONFIGS[config_name]), temperature=TEMPERATURE,
                        num_microbatches=len(micro), calculate_per_token_loss=False, output_path=OutputPath(output_path))
    batch = grpo.global_batch(micro, step=0)
    ddp.zero_grad_buffer()
    losses = get_forward_backward_func()(
        forward_step_func=grpo.forward_step_func(batch, step=0, model_kwargs=kwargs), data_iterator=iter(micro),
        model=ddp, num_microbatches=len(micro), seq_length=max(int(mb.input_ids.shape[1]) for mb in micro),
        micro_batch_size=int(micro[0].input_ids.shape[0]), forward_only=False)
    metrics = grpo.reduce_metrics(losses)
    grads = {name: p.main_grad.float().cpu().clone() for name, p in _unwrap(ddp).named_parameters()}
    logprobs = forward_logprobs(grpo, get_forward_backward_func(), ddp, micro, model_kwargs=kwargs).logprobs
    return {"metrics": metrics, "grads": grads, "logprobs": logprobs}


def _unwrap(ddp) -> torch.nn.Module:
    from megatron.core.transformer.module import Float16Module

    inner = ddp.module
    return inner.module if isinstance(inner, Float16Module) else inner


def _relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm().clamp(min=TINY_NORM))


def _differences(got: dict, ref: dict, dtype: str, where: str) -> list[str]:
    """What differs beyond the dtype's tolerance between two runs' metrics and gradients (empty: they agree)."""
    from tests.gpu.test_megatron_gpt import BF16_PER_PARAMETER_RTOL
    from tests.tolerances import tolerance

    rtol = tolerance(torch.float32 if dtype == "fp32" else torch.bfloat16)["rtol"]
    per_parameter = rtol if dtype == "fp32" else BF16_PER_PARAMETER_RTOL
    failures = []
    if set(got["metrics"]) != set(ref["metrics"]):
        failures.append(f"metrics {sorted(got['metrics'])} vs {sorted(ref['metrics'])} [{where}]")
    for key in sorted(set(got["metrics"]) & set(ref["metrics"])):
        a, b = got["metrics"][key], ref["metrics"][key]
        if not math.isclose(a, b, rel_tol=rtol, abs_tol=rtol):
            failures.append(f"metric {key}: {a:.8g} vs {b:.8g} [{where}]")
    errors = {n: _relative_l2(g, ref["grads"][n]) for n, g in got["grads"].items()}
    whole = _relative_l2(torch.cat([got["grads"][n].flatten() for n in ref["grads"]]),
                         torch.cat([g.flatten() for g in ref["grads"].values()]))
    if not whole <= rtol:
        failures.append(f"all gradients: relative L2 error {whole:.2e} > {rtol:.1e} [{where}]")
    failures += [f"grad {n}: relative L2 error {e:.2e} > {per_parameter:.1e} [{where}]" for n, e in errors.items()
                 if not e <= per_parameter]
    worst = max(errors, key=errors.get)
    print(f"{where}: loss {got['metrics']['loss']:.6f} (reference {ref['metrics']['loss']:.6f}); relative L2 error of "
          f"all gradients {whole:.2e}, worst parameter {errors[worst]:.2e} ({worst})", flush=True)
    return failures


def _logprob_differences(packed: list, padded_lp: list, packed_lp: list, dtype: str, where: str) -> list[str]:
    """The forward-only log-probs of the padded run, moved into each packed micro-batch's layout, against the packed
    run's, on the trained positions."""
    from tests.tolerances import assert_close

    failures = []
    for i, (mb, pad, pack) in enumerate(zip(packed, padded_lp, packed_lp)):
        expected = mb.layout.input_field(pad, 0.0)  # the padded rows' logit-aligned values, packed the same way
        mask = mb.loss_mask
        try:
            assert_close(torch.where(mask, pack, torch.zeros_like(pack)), torch.where(mask, expected, torch.zeros_like(pack)),
                         torch.float32 if dtype == "fp32" else torch.bfloat16, msg=f"log-probs, micro-batch {i} [{where}]")
        except AssertionError as err:
            failures.append(str(err))
    return failures


def case_packed_vs_padded(dtype: str) -> None:
    from megatron.core import parallel_state as ps

    init_nccl()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        built = _build(dtype)
        formats = [("packed", False)] + ([("packed, segments padded to 4 (CP = 2's layout)", True)] if dtype == "bf16"
                                          else [])
        failures = []
        for output_path in OUTPUT_PATHS:
            for config_name in LOSS_CONFIGS:
                padded = _step(built.model, dtype, config_name, output_path, _micro_batches("padded"))
                for name, pad_segments in formats:
                    if pad_segments:
                        with segments_padded_to(CP_SEGMENT_MULTIPLE):
                            micro = _micro_batches("packed")
                        cu, cu_padded = (micro[0].packed_seq_params.cu_seqlens_q, micro[0].packed_seq_params.cu_seqlens_q_padded)
                        assert not torch.equal(cu, cu_padded), "the segments must carry padding between them"
                    else:
                        micro = _micro_batches("packed")
                    packed = _step(built.model, dtype, config_name, output_path, micro)
                    where = f"{dtype}, {output_path}, {config_name}, {name} vs padded"
                    failures += _differences(packed, padded, dtype, where)
                    failures += _logprob_differences(micro, padded["logprobs"], packed["logprobs"], dtype, where)
        assert not failures, "\n".join(failures)
    finally:
        ps.destroy_model_parallel()


def case_cp_reference(out_dir: str) -> None:
    """CP = 1 on one GPU: the weights and, per output path, the packed step's metrics and gradients (bf16)."""
    from megatron.core import parallel_state as ps

    init_nccl()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        built = _build("bf16")
        gpt = _unwrap(built.model)
        torch.save({n: p.detach().float().cpu().clone() for n, p in gpt.named_parameters()}, Path(out_dir) / "weights.pt")
        for output_path in OUTPUT_PATHS:
            run = _step(built.model, "bf16", "gspo_seq_mean", output_path, _micro_batches("packed"))
            torch.save({"metrics": run["metrics"], "grads": run["grads"]}, Path(out_dir) / f"ref_{output_path}.pt")
            print(f"CP = 1 reference, {output_path}: loss {run['metrics']['loss']:.6f}", flush=True)
    finally:
        ps.destroy_model_parallel()


def case_cp(out_dir: str, layout: str) -> None:
    """This layout's ranks: the reference weights (sharded over TP), packed micro-batches cut over CP, the step; the
    gradients gathered over TP against the CP = 1 run's."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from tests.gpu.test_megatron_gpt import _full_grads, _load_sharded

    init_nccl()
    tp, cp = CP_LAYOUTS[layout]["tp"], CP_LAYOUTS[layout]["cp"]
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    try:
        built = _build("bf16", tp=tp, cp=cp)
        gpt = _unwrap(built.model)
        _load_sharded(gpt, torch.load(Path(out_dir) / "weights.pt"))
        failures = []
        for output_path in OUTPUT_PATHS:
            micro = _micro_batches("packed", cp_group=ps.get_context_parallel_group())
            run = _step(built.model, "bf16", "gspo_seq_mean", output_path, micro)
            run["grads"] = _full_grads(gpt)
            ref = torch.load(Path(out_dir) / f"ref_{output_path}.pt")
            where = f"{layout} (TP = {tp}, CP = {cp}), {output_path}, rank {dist.get_rank()}"
            failures += _differences(run, ref, "bf16", where)
        assert not failures, "\n".join(failures)
    finally:
        ps.destroy_model_parallel()


if __name__ == "__main__":
    worker_main({"case_packed_vs_padded": case_packed_vs_padded, "case_cp_reference": case_cp_reference,
                 "case_cp": case_cp})
