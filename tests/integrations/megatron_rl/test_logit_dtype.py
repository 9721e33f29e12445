"""``GRPOForwardStep`` and the logits' precision: ``--output-logit-dtype`` (``args.logit_dtype``, its ``dest``) read by
``from_args`` from the namespaces of Megatron-LM's own parser (skipped without its source; a mutant reading the
attribute name the plug-in read before, ``output_logit_dtype``, fails), every attribute the plug-in reads checked
to be one that parser sets, a bad value refused naming the argument, a GPTModel's own ``logit_dtype`` checked
against it, and the value reaching the output layer's GEMM: through ``_model_forward`` on the CPU stand-in for GPTModel in bf16 (its
output weight scaled to a trained model's logit range), the log-probs of the logits it returns are within
``CPU_FP32_MAX_ABS`` of float64 logits of the same bf16 operands with fp32, and not with bf16 (a bf16-rounding
mutant fails the fp32 check); with the pre-step's loss rows it returns their logits alone, equal to every row's
there."""

from __future__ import annotations

import ast
import inspect
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from mp_grpo.config.precision import LogitDtype
from mp_grpo.integrations.megatron_rl import GRPOForwardStep
from mp_grpo.integrations.megatron_rl.batch import loss_inputs
from mp_grpo.integrations.megatron_rl import config as config_module
from mp_grpo.integrations.megatron_rl import forward_step
from mp_grpo.integrations.megatron_rl.forward_step import check_model_logit_dtype, logit_dtype_from_args
from tests.distributed import torchrun, worker_main
from tests.integrations.megatron_rl.helpers import megatron_lm_args, unpacked
from tests.logit_precision import CPU_BF16_MIN_MAX_ABS, CPU_FP32_MAX_ABS
from tests.reference import logprobs_reference
from tests.tolerances import assert_close


def _args(**extra):
    return SimpleNamespace(grpo_clamp_eps_lower=0.2, grpo_clamp_eps_upper=0.2, grpo_kl_beta=0.0,
                           grpo_entropy_term_weight=0.0, rl_inference_logprobs_is_correction=False,
                           rl_importance_sampling_truncation_coef=None, **extra)


EXPECTED = {"defaults": (None, LogitDtype.BF16), "entropy_is_truncated": ("fp32", LogitDtype.FP32),
            "is_untruncated_no_kl": ("bf16", LogitDtype.BF16)}
"""``ARGV_CASES`` → (``--output-logit-dtype``'s value, the LogitDtype ``from_args`` must pick)."""
TORCH = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16}


def _check_from_args_on_megatron_lms_parser() -> None:
    """``from_args`` on the namespaces of Megatron-LM's own parser picks the run's logit dtype: from the string after
    ``parse_args``, from the torch dtype after ``validate_args``, and BF16 on a namespace without the argument (a
    Megatron-LM before ``--output-logit-dtype``: the real namespace less that attribute)."""
    for case, (given, want) in EXPECTED.items():
        for validated in (False, True):
            args = megatron_lm_args(case, validated=validated)
            assert args.logit_dtype == (TORCH[given] if validated else given), (case, validated, args.logit_dtype)
            assert logit_dtype_from_args(args) is want, (case, validated)
            assert GRPOForwardStep.from_args(args).logit_dtype is want, (case, validated)
    older = megatron_lm_args("entropy_is_truncated")
    del older.logit_dtype
    assert GRPOForwardStep.from_args(older).logit_dtype is LogitDtype.BF16


def test_from_args_reads_megatron_lms_logit_dtype() -> None:
    _check_from_args_on_megatron_lms_parser()


def test_a_mutant_reading_the_old_attribute_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attribute name before the fix (``args.output_logit_dtype``, which Megatron-LM's parser never sets): the
    check above must fail with it."""
    megatron_lm_args("defaults")  # skip without the source, before the mutant is in place

    def old_attribute(args):
        value = getattr(args, "output_logit_dtype", None)
        return LogitDtype.BF16 if value is None else LogitDtype(str(value))

    monkeypatch.setattr(forward_step, "logit_dtype_from_args", old_attribute)
    with pytest.raises(AssertionError):
        _check_from_args_on_megatron_lms_parser()


def _names_read_from_args(module) -> set[str]:
    """The attributes ``module`` reads from a Megatron-LM ``args``: ``args.X`` and ``getattr(args, X, ...)`` (X a
    string, or a module-level constant holding one)."""
    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and isinstance(node.args[0], ast.Name) and node.args[0].id == "args"):
            key = node.args[1]
            names.add(key.value if isinstance(key, ast.Constant) else getattr(module, key.id))
    return names


def test_every_argument_the_plug_in_reads_is_megatron_lms() -> None:
    """Each attribute the plug-in reads from ``args`` is one Megatron-LM's parser sets (``curr_iteration``: its
    training loop, checked in its source)."""
    args = vars(megatron_lm_args("defaults"))
    read = _names_read_from_args(forward_step) | _names_read_from_args(config_module)
    assert {"logit_dtype", "grpo_kl_beta", "rl_use_sequence_packing", "calculate_per_token_loss"} <= read, read
    training = Path(os.environ["MP_GRPO_MEGATRON_LM_SRC"]) / "megatron" / "training" / "training.py"
    assert "args.curr_iteration = " in training.read_text()
    assert read - {"curr_iteration"} <= set(args), sorted(read - set(args))


def test_bad_logit_dtype_refused_naming_the_argument() -> None:
    """Values Megatron-LM's parser cannot give (its ``choices`` are bf16 | fp32): a hand-built namespace."""
    for bad in ("fp16", torch.float16, "float32"):
        with pytest.raises(ValueError, match="^--output-logit-dtype \\(args.logit_dtype\\): got .*; allowed "
                                             "bf16 \\| fp32$"):
            GRPOForwardStep.from_args(_args(logit_dtype=bad))
    with pytest.raises(TypeError, match="logit_dtype must be a LogitDtype"):
        GRPOForwardStep("megatron_lm_grpo", logit_dtype="fp32")


def test_a_gptmodel_logit_dtype_must_agree() -> None:
    inner = SimpleNamespace(output_layer=object(), logit_dtype=torch.float32)
    wrapped = SimpleNamespace(module=SimpleNamespace(module=inner))
    check_model_logit_dtype(wrapped, LogitDtype.FP32)
    with pytest.raises(ValueError, match="logit_dtype=bf16, but the model's GPTModel.logit_dtype is torch.float32"):
        check_model_logit_dtype(wrapped, LogitDtype.BF16)
    inner.logit_dtype = None  # megatron-core's default: the model's dtype
    check_model_logit_dtype(wrapped, LogitDtype.FP32)
    check_model_logit_dtype(SimpleNamespace(), LogitDtype.FP32)  # no output layer found (not the last stage)


def test_output_logit_dtype_reaches_the_output_layer() -> None:
    torchrun(__file__, "case_precision", nproc=1)


def case_precision() -> None:
    from megatron.core import parallel_state as ps

    from mp_grpo.megatron.groups import ParallelGroups
    from mp_grpo.ops.vocab_parallel_logprobs import vocab_parallel_logprobs
    from tests.megatron import helpers as H

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        groups = ParallelGroups.from_parallel_state()
        stand_in = H.trained_scale_stand_in(groups.tp)

        class MegatronLMModel(torch.nn.Module):
            """The stand-in called with ``train_rl.py``'s arguments (Float16Module-like: ``.module``)."""

            def __init__(self) -> None:
                super().__init__()
                self.module = stand_in

            def forward(self, tokens, position_ids, attention_mask, *, packed_seq_params, runtime_gather_output,
                        fp32_output):
                assert runtime_gather_output is False
                return self.module(tokens, position_ids)

        hidden = []
        stand_in.output_layer.register_forward_pre_hook(lambda module, inputs: hidden.append(inputs[0].detach()))
        mb, _ = unpacked(3, 3, 12, vocab=H.VOCAB, dtype=torch.float32)
        x = loss_inputs(mb, None)
        args = _args(rl_use_sequence_packing=False, fp16=False, bf16=True)
        errors = {}
        for value in ("fp32", "bf16"):
            step = GRPOForwardStep.from_args(_args(logit_dtype=value), groups=groups)
            hidden.clear()
            logits = step._model_forward(MegatronLMModel(), mb, x, args)
            assert logits.dtype == (torch.float32 if value == "fp32" else torch.bfloat16), (value, logits.dtype)
            reference = (hidden[0].double() @ stand_in.output_layer.weight.double().T).transpose(0, 1)  # [B, S, V]
            assert 10.0 < float(reference.max(-1).values.median()) < 40.0, "not a trained model's logit scale"
            valid = x.target != -100
            want, _ = logprobs_reference(reference[valid], x.target[valid])
            got = vocab_parallel_logprobs(logits.detach(), x.target, tp_group=groups.tp)[valid]
            errors[value] = float((got.double() - want).abs().max())
            # OutputRows.LOSS: the output layer on the loss rows alone, [1, K, V], those rows' logits
            rows = step.pre_step([mb], step=0).rows[0]
            on_rows = step._model_forward(MegatronLMModel(), mb, x, args, rows)
            assert on_rows.shape == (1, rows.count, H.VOCAB) and rows.count < x.target.numel()
            assert_close(on_rows[0], rows.gather(logits.detach()), logits.dtype, f"the loss rows' logits ({value})")
        assert errors["fp32"] < CPU_FP32_MAX_ABS, errors
        assert errors["bf16"] > CPU_BF16_MIN_MAX_ABS, errors
    finally:
        ps.destroy_model_parallel()
        dist.barrier()


if __name__ == "__main__":
    worker_main({"case_precision": case_precision})
