"""The LM-head switch: mp_grpo.vocab_parallel_logprobs in place of verl's Megatron engine processor
(``MegatronEngineWithLMHead._lm_head_logits_processor``) — the switch from the environment through the plugin, and
the processor against verl's own under TP = 2 (torchrun, gloo): log-probs, entropy and the shard's gradient.

verl's processor divides by the temperature in place and takes megatron-core's ``vocab_parallel_cross_entropy``
and its own ``vocab_parallel_entropy``; both run in the logits' dtype, so each side is compared with a float64
reference and with the other at the tolerance of that dtype (tests/tolerances.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.integrations.verl.helpers import require_verl

if __name__ != "__main__":
    require_verl()

from tests.distributed import REPO_ROOT  # noqa: E402


def _switched(env_value: str | None) -> subprocess.CompletedProcess:
    code = ("import json, verl\n"
            "from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead as E\n"
            "from mp_grpo.integrations.verl.lm_head import lm_head_logprobs\n"
            "print(json.dumps(E._lm_head_logits_processor is lm_head_logprobs))")
    env = {k: v for k, v in os.environ.items() if k != "MP_GRPO_VERL_LOGPROBS"}
    if env_value is not None:
        env["MP_GRPO_VERL_LOGPROBS"] = env_value
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**env, "OMP_NUM_THREADS": "1"})


def test_switch_from_the_environment() -> None:
    """MP_GRPO_VERL_LOGPROBS=1 before ``import verl``: the plugin installs the processor; unset (this process):
    verl's stays; a bad value: the plugin says so (verl itself logs a failing plugin only at debug level)."""
    import verl  # noqa: F401
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead as Engine

    from mp_grpo.integrations.verl import ENV_SWITCH, lm_head_logprobs

    assert ENV_SWITCH not in os.environ and Engine._lm_head_logits_processor is not lm_head_logprobs
    on, bad = _switched("1"), _switched("yes")
    assert on.returncode == 0 and json.loads(on.stdout.splitlines()[-1]) is True, on.stderr[-3000:]
    assert "mp_grpo's verl plugin failed: ValueError: MP_GRPO_VERL_LOGPROBS='yes'" in bad.stderr


def test_switch_by_call_and_back() -> None:
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead as Engine

    from mp_grpo.integrations.verl import lm_head_logprobs, use_vocab_parallel_logprobs

    original = Engine.__dict__["_lm_head_logits_processor"]
    try:
        use_vocab_parallel_logprobs()
        assert Engine._lm_head_logits_processor is lm_head_logprobs
        use_vocab_parallel_logprobs(False)
        assert Engine.__dict__["_lm_head_logits_processor"] is original
    finally:
        Engine._lm_head_logits_processor = original


def test_switch_with_fp32_logits_and_back() -> None:
    """``logit_dtype=FP32`` also wraps the engine's forward_step (tests/integrations/verl/test_logit_dtype.py: what the
    wrapper does); switched back, verl's own."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead as Engine

    from mp_grpo.config.precision import LogitDtype
    from mp_grpo.integrations.verl import lm_head_logprobs, use_vocab_parallel_logprobs

    processor, forward_step = Engine.__dict__["_lm_head_logits_processor"], Engine.__dict__["forward_step"]
    try:
        use_vocab_parallel_logprobs(logit_dtype=LogitDtype.FP32)
        assert Engine._lm_head_logits_processor is lm_head_logprobs
        assert Engine.__dict__["forward_step"].__wrapped__ is forward_step
        use_vocab_parallel_logprobs()
        assert Engine.__dict__["forward_step"] is forward_step
        with pytest.raises(ValueError, match="logit_dtype=fp32 needs the switch on"):
            use_vocab_parallel_logprobs(False, logit_dtype=LogitDtype.FP32)
    finally:
        Engine._lm_head_logits_processor, Engine.forward_step = processor, forward_step


# ------------------------------------------------------------------------------------------ TP = 2 (torchrun)
def _engine():
    """What verl's processor reads from its engine."""
    return SimpleNamespace(engine_config=SimpleNamespace(entropy_from_logits_with_chunking=False,
                                                         entropy_from_logits_chunk_size=2048))


def _process(processor, logits_shard, label, temperature, g_lp, g_ent, **flags):
    """One processor call on a copy of the shard; its outputs and d(g_lp·log_probs + g_ent·entropy)/d shard."""
    shard = logits_shard.clone().requires_grad_()
    x = shard * 1  # the engine hands a non-leaf (the output layer's result); verl divides it in place
    kwargs = dict(calculate_sum_pi_squared=False, calculate_entropy=True, distillation_use_topk=False,
                  distillation_only=False, logits_processor_func=None, batch=None, data_format="bshd")
    kwargs.update(flags)
    out = processor(_engine(), x, label, temperature.clone(), **kwargs)
    total = (out["log_probs"].float() * g_lp).sum()
    if "entropy" in out:
        total = total + (out["entropy"].float() * g_ent).sum()
    total.backward()
    return {k: v.detach().float() for k, v in out.items()}, shard.grad.float()


def case_matches_verl(dtypes: list[str]) -> None:
    for dtype in dtypes:
        _matches_verl(dtype)


def _matches_verl(dtype: str) -> None:
    """float32 logits: mp_grpo's processor against verl's on the same shard, and against float64.
    bfloat16 logits: mp_grpo's against verl's run on the same values in float32 (verl's bf16 run rounds the
    temperature division and its entropy in bf16: mp_grpo's result must be at least as close to float64, and
    the errors are printed)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    import verl  # noqa: F401
    from mp_grpo.integrations.verl.lm_head import lm_head_logprobs, verl_processor
    from tests.reference import logprobs_reference
    from tests.tolerances import assert_close

    tp = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        rank = parallel_state.get_tensor_model_parallel_rank()
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        gen = torch.Generator().manual_seed(17)
        B, S, V = 3, 5, 24 * tp
        logits = (torch.randn(B, S, V, generator=gen) * 3).to(torch_dtype)
        label = torch.randint(0, V, (B, S), generator=gen)
        g_lp, g_ent = torch.randn(B, S, generator=gen), torch.randn(B, S, generator=gen)
        cols = slice(rank * (V // tp), (rank + 1) * (V // tp))
        shard = logits[..., cols].contiguous()
        uniform = torch.full((B, S), 0.7)
        uniform[2, 3:] = 0.0  # padding positions: verl sets their temperature to 1e-8
        per_sequence = torch.tensor([[0.7], [1.3], [1.0]]).expand(B, S).contiguous()
        for name, temperature in (("uniform", uniform), ("per_sequence", per_sequence)):
            for entropy in (True, False):
                what = f"{name} entropy={entropy} rank {rank}"
                ours, g_ours = _process(lm_head_logprobs, shard, label, temperature, g_lp, g_ent,
                                        calculate_entropy=entropy)
                theirs, g_theirs = _process(verl_processor(), shard.float(), label, temperature, g_lp, g_ent,
                                            calculate_entropy=entropy)
                assert sorted(ours) == sorted(theirs), (sorted(ours), sorted(theirs))
                valid = temperature > 0  # verl's outputs at padding (temperature 1e-8) are not compared
                ref_logits = logits.double().requires_grad_()
                t = torch.where(valid, temperature, 1.0).double().unsqueeze(-1)
                lp_ref, ent_ref = logprobs_reference(ref_logits / t, label)
                ((lp_ref * g_lp * valid).sum() + ((ent_ref * g_ent * valid).sum() if entropy else 0)).backward()
                refs = {"log_probs": lp_ref, "entropy": ent_ref}
                # One temperature: the kernel divides in fp32. Per-sequence ones: the logits are divided in their
                # own dtype first, as verl does (the one rounding of that division is the dtype's).
                tol = torch.float32 if name == "uniform" else torch_dtype
                for key in ours:
                    assert_close(ours[key][valid], refs[key][valid], tol, f"{key} vs float64, {what}")
                    assert_close(ours[key][valid], theirs[key][valid], tol, f"{key} vs verl, {what}")
                if valid.all():  # verl's gradient at padding rows comes from its 1e-8 temperature
                    assert_close(g_ours, ref_logits.grad[..., cols], torch_dtype, f"grad vs float64, {what}")
                    assert_close(g_ours, g_theirs, torch_dtype, f"grad vs verl, {what}")
                if torch_dtype != torch.float32:  # verl on the bf16 shard itself: no closer to float64 than ours
                    bf16, _ = _process(verl_processor(), shard, label, temperature, g_lp, g_ent,
                                       calculate_entropy=entropy)
                    for key in ours:
                        err_ours = (ours[key][valid].double() - refs[key][valid]).abs().max().item()
                        err_verl = (bf16[key][valid].double() - refs[key][valid]).abs().max().item()
                        print(f"{what} {key}: max |error| vs float64 mp_grpo {err_ours:.1e}, verl bf16 "
                              f"{err_verl:.1e}")
                        assert err_ours <= err_verl, (key, err_ours, err_verl)
        # Σπ² (the optimal-token baseline) stays verl's: the call is handed to verl's processor.
        ours, _ = _process(lm_head_logprobs, shard, label, uniform, g_lp, g_ent, calculate_sum_pi_squared=True)
        theirs, _ = _process(verl_processor(), shard, label, uniform, g_lp, g_ent, calculate_sum_pi_squared=True)
        assert sorted(ours) == ["entropy", "log_probs", "sum_pi_squared"]
        for key in ours:
            assert torch.equal(ours[key], theirs[key]), key
    finally:
        parallel_state.destroy_model_parallel()


def test_tp2_matches_verl_processor() -> None:
    """TP = 2 (torchrun, gloo), float32 and bfloat16 logits in one launch; prints the bf16 errors."""
    from tests.distributed import torchrun

    print(torchrun(__file__, "case_matches_verl", 2, dtypes=["float32", "bfloat16"]))


if __name__ == "__main__":
    from tests.distributed import worker_main

    worker_main({"case_matches_verl": case_matches_verl})
