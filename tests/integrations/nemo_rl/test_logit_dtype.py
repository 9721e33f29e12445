"""MPGRPOLossFn and NeMo-RL's ``policy.megatron_cfg.fp32_lm_head``: the key read by ``from_master_config`` (true and
"tf32" → ``LogitDtype.FP32``, false / null → ``BF16``, anything else refused naming the key), and the logit input at
fp32: NeMo-RL's output layer emulated on bf16 hidden states and a bf16 weight scaled to a trained model's logit range —
its fp32 head (the GEMM of the upcast operands, as NeMo-RL's ``true``) and its bf16 head (logits rounded to bf16, then
upcast as NeMo-RL does without ``defer_fp32_logits``). With the old log-probs set to the float64 log-probs of the same
bf16 operands, the loss's ratio π_θ/π_old is exp(error): within ``CPU_FP32_MAX_ABS`` of 1 at fp32 (a loss that
rounded its logits to bf16 fails this), beyond ``CPU_BF16_MIN_MAX_ABS`` at bf16; rounded logits refused at fp32."""

from __future__ import annotations

import math

import pytest
import torch

from mp_grpo.config.precision import LogitDtype
from mp_grpo.integrations.nemo_rl import InputType, MPGRPOLossFn
from mp_grpo.integrations.nemo_rl.loss import logit_dtype_of
from mp_grpo.megatron.groups import ParallelGroups
from tests.logit_precision import CPU_BF16_MIN_MAX_ABS, CPU_FP32_MAX_ABS
from tests.reference import logprobs_reference

B, S, H, V = 2, 24, 32, 96
LOGIT_MAX = 20.0
"""The weight's scale: the median row maximum of the logits (a trained model's reach ~15–30)."""


def _master(value=..., enabled=True):
    megatron = {"enabled": enabled}
    if value is not ...:
        megatron["fp32_lm_head"] = value
    return {"policy": {"megatron_cfg": megatron}, "grpo": {}}


def test_fp32_lm_head_is_read_and_checked() -> None:
    for value, want in ((True, LogitDtype.FP32), ("tf32", LogitDtype.FP32), (False, LogitDtype.BF16),
                        (None, LogitDtype.BF16), (..., LogitDtype.BF16)):
        assert MPGRPOLossFn.from_master_config(_master(value), "nemo_rl_grpo").logit_dtype is want, value
    for bad in ("TF32", "false", "true", 1, "fp32"):
        with pytest.raises(ValueError, match='^policy.megatron_cfg.fp32_lm_head: got .*; allowed true \\| "tf32" \\| false$'):
            MPGRPOLossFn.from_master_config(_master(bad), "nemo_rl_grpo")
    # the DTensor worker: NeMo-RL hands log-probs, the Megatron key is not read
    assert MPGRPOLossFn.from_master_config(_master(True, enabled=False), "nemo_rl_grpo").logit_dtype is LogitDtype.BF16
    with pytest.raises(ValueError, match="logit_dtype is for input_type=InputType.LOGIT"):
        MPGRPOLossFn("nemo_rl_grpo", logit_dtype=LogitDtype.FP32)
    with pytest.raises(TypeError, match="logit_dtype must be a LogitDtype"):
        MPGRPOLossFn("nemo_rl_grpo", input_type=InputType.LOGIT, logit_dtype="fp32")
    assert logit_dtype_of("tf32") is LogitDtype.FP32


def _case():
    """bf16 operands, NeMo-RL's two heads, the float64 reference log-probs of the sampled tokens, the data dict."""
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(B, S, H, generator=gen).to(torch.bfloat16)
    w = torch.randn(V, H, generator=gen)
    w *= LOGIT_MAX / (hidden.float() @ w.T).max(-1).values.median()
    weight = w.to(torch.bfloat16)
    reference = hidden.double() @ weight.double().T  # [B, S, V]
    input_ids = torch.randint(0, V, (B, S), generator=gen)
    lp, _ = logprobs_reference(reference[:, :-1], input_ids[:, 1:])  # position t predicts token t+1
    token_mask = torch.ones(B, S)
    token_mask[:, :3] = 0  # a prompt
    prev = torch.zeros(B, S, dtype=torch.float64)
    prev[:, 1:] = lp  # the old policy: exactly the float64 log-probs, so π_θ/π_old = exp(error)
    data = {"input_ids": input_ids, "token_mask": token_mask, "sample_mask": torch.ones(B),
            "advantages": torch.randn(B, 1, generator=gen).expand(B, S).clone(), "prev_logprobs": prev,
            "generation_logprobs": prev.clone(), "reference_policy_logprobs": prev.clone()}
    heads = {
        "fp32": torch.nn.functional.linear(hidden.float(), weight.float()),  # NeMo-RL's fp32_lm_head: true
        "bf16": torch.nn.functional.linear(hidden, weight).float(),  # a bf16 head, upcast (defer_fp32_logits false)
    }
    return heads, data


def _max_error(loss_fn, logits, data) -> float:
    seqs, toks = torch.tensor(float(B)), data["token_mask"][:, 1:].sum()
    _, metrics = loss_fn(data=data, global_valid_seqs=seqs, global_valid_toks=toks, logits=logits)
    return max(abs(math.log(metrics["probs_ratio_min"])), abs(math.log(metrics["probs_ratio_max"])))


def test_fp32_lm_head_gives_fp32_logprobs() -> None:
    heads, data = _case()
    exact = ["policy.log_ratio_clamp=null"]

    def loss(logit_dtype):
        return MPGRPOLossFn("nemo_rl_grpo", overrides=exact, input_type=InputType.LOGIT, groups=ParallelGroups(),
                            logit_dtype=logit_dtype)

    fp32 = _max_error(loss(LogitDtype.FP32), heads["fp32"], data)
    bf16 = _max_error(loss(LogitDtype.BF16), heads["bf16"], data)
    assert fp32 < CPU_FP32_MAX_ABS, fp32
    assert bf16 > CPU_BF16_MIN_MAX_ABS, bf16
    # at fp32, logits rounded to bf16 are refused: upcast (first call), or a bf16 tensor (every call)
    with pytest.raises(ValueError, match="^logits: every value is a bf16 number, but logit_dtype=fp32 "
                                         "\\(policy.megatron_cfg.fp32_lm_head\\)"):
        _max_error(loss(LogitDtype.FP32), heads["bf16"], data)
    with pytest.raises(ValueError, match="^logits are torch.bfloat16, but logit_dtype=fp32"):
        _max_error(loss(LogitDtype.FP32), heads["bf16"].to(torch.bfloat16), data)
