"""The LM-head switch's logit precision (``MP_GRPO_VERL_LOGIT_DTYPE``), without verl: the environment parsed and
refused naming the variable, and ``with_fp32_logits`` around an engine ``forward_step`` shaped like verl's (the model
called inside, the processor on its logits) on the CPU stand-in for GPTModel in bf16, its output weight scaled to a
trained model's logit range: with it the processor's log-probs are within ``CPU_FP32_MAX_ABS`` of float64 logits of
the same bf16 operands, without it (verl's bf16 head) they are not; verl's fused-kernel engine refused. (The switch
installing it in verl's engine: tests/integrations/verl/test_lm_head.py, with verl.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from mp_grpo.config.precision import LogitDtype
from mp_grpo.integrations.verl.lm_head import ENV_LOGIT_DTYPE, ENV_SWITCH, logit_dtype_from_env, switch_from_env
from tests.distributed import torchrun, worker_main
from tests.logit_precision import CPU_BF16_MIN_MAX_ABS, CPU_FP32_MAX_ABS
from tests.reference import logprobs_reference


def test_logit_dtype_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_LOGIT_DTYPE, raising=False)
    assert logit_dtype_from_env() is LogitDtype.BF16
    for value, want in (("fp32", LogitDtype.FP32), ("BF16", LogitDtype.BF16)):
        monkeypatch.setenv(ENV_LOGIT_DTYPE, value)
        assert logit_dtype_from_env() is want
    monkeypatch.setenv(ENV_LOGIT_DTYPE, "float32")
    with pytest.raises(ValueError, match=f"^{ENV_LOGIT_DTYPE}='float32': allowed bf16 \\| fp32$"):
        switch_from_env()
    monkeypatch.setenv(ENV_LOGIT_DTYPE, "fp32")
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    with pytest.raises(ValueError, match=f"^{ENV_LOGIT_DTYPE}=fp32 needs {ENV_SWITCH}=1"):
        switch_from_env()  # refused before verl is imported


def test_fp32_logits_reach_the_processor() -> None:
    torchrun(__file__, "case_precision", nproc=1)


def case_precision() -> None:
    from megatron.core import parallel_state as ps

    from mp_grpo.integrations.verl.lm_head import with_fp32_logits
    from mp_grpo.megatron.groups import ParallelGroups
    from mp_grpo.ops.vocab_parallel_logprobs import vocab_parallel_logprobs
    from tests.megatron import helpers as H

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        groups = ParallelGroups.from_parallel_state()
        stand_in = H.trained_scale_stand_in(groups.tp)
        hidden = []
        stand_in.output_layer.register_forward_pre_hook(lambda module, inputs: hidden.append(inputs[0].detach()))
        gen = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, H.VOCAB, (2, 12), generator=gen)
        positions = torch.arange(12).expand(2, 12)
        label = torch.randint(0, H.VOCAB, (2, 12), generator=gen)

        class Engine:
            """verl's ``MegatronEngineWithLMHead.forward_step`` in shape: the model, then the LM-head processor."""

            engine_config = SimpleNamespace(use_fused_kernels=False)

            def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
                logits = model(tokens, positions)
                return {"logits_dtype": logits.dtype,
                        "log_probs": vocab_parallel_logprobs(logits, label, tp_group=groups.tp).detach()}

        errors = {}
        for name, step in (("fp32", with_fp32_logits(Engine.forward_step)), ("bf16", Engine.forward_step)):
            hidden.clear()
            out = step(Engine(), iter(()), stand_in, None, None)
            assert out["logits_dtype"] == (torch.float32 if name == "fp32" else torch.bfloat16), (name, out)
            reference = (hidden[0].double() @ stand_in.output_layer.weight.double().T).transpose(0, 1)
            assert 10.0 < float(reference.max(-1).values.median()) < 40.0, "not a trained model's logit scale"
            want, _ = logprobs_reference(reference, label)
            errors[name] = float((out["log_probs"].double() - want).abs().max())
        assert errors["fp32"] < CPU_FP32_MAX_ABS, errors
        assert errors["bf16"] > CPU_BF16_MIN_MAX_ABS, errors
        fused = Engine()
        fused.engine_config = SimpleNamespace(use_fused_kernels=True)
        try:
            with_fp32_logits(Engine.forward_step)(fused, iter(()), stand_in, None, None)
        except ValueError as error:
            assert "use_fused_kernels=True" in str(error), error
        else:
            raise AssertionError("verl's fused-kernel engine was not refused at fp32")
    finally:
        ps.destroy_model_parallel()
        dist.barrier()


if __name__ == "__main__":
    worker_main({"case_precision": case_precision})
