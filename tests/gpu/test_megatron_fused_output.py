"""The fused output path's hidden states (mp_grpo/megatron/fused_output.py) with sequence parallelism, on two GPUs.

megatron-core's sequence-parallel mappings need CUDA, so the CPU tests (``tests/megatron/test_fused_output.py``)
run with sequence parallelism off; GPTModel with it on needs transformer-engine's layer spec
(``tests/gpu/test_megatron_gpt.py`` skips that case without it). This test needs neither: a model that ends
like GPTModel — megatron-core's ``ColumnParallelLinear`` output layer on ``[S(/TP), B, H]`` hidden states,
logits returned as ``[B, S, V_local]`` — run at TP = 2 (NCCL) with ``sequence_parallel`` on and off, fp32 and
bf16:

* logits path: ``vocab_parallel_logprobs(model(x), targets)`` — the layer's own input mapping;
* fused path: ``call_for_hidden_states(model, x)`` then ``fused_linear_logprobs(hidden, weight, targets)``;
* fused path with the loss in forward: the same hidden states into ``fused_linear_loss`` with the loss
  ``Σ g_lp·logp + Σ g_ent·entropy`` (gradients only: it returns no per-token log-probs).

Log-probs, entropy and the gradients of the layer's input ``x`` (this rank's sequence shard under SP) and of
the weight shard, for random upstream gradients, must agree: fp32 within ``tests/tolerances``, bf16 by
relative L2 error within its rtol.

    NCCL_NVLS_ENABLE=0 python -m pytest tests/gpu/test_megatron_fused_output.py -v
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the worker processes run this file as a script

from tests.gpu.launch import init_nccl, torchrun, worker_main  # noqa: E402

SEQ, BATCH, HIDDEN, VOCAB = 48, 3, 64, 1000
TEMPERATURE = 0.8
TINY_NORM = 1e-30
"""Floor of a reference gradient's norm in a relative error."""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["sp_off", "sp_on"])
def test_fused_hidden_states_equal_logits_path(sequence_parallel: bool) -> None:
    print(torchrun(__file__, "case_hidden_states", 2, sequence_parallel=sequence_parallel))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_in_forward_one_gpu_tied_and_main_grad(dtype: torch.dtype) -> None:
    """One GPU, real kernels (GRPOLoss on its Triton backend): ``MegatronGRPO.loss_func`` with the loss in forward
    equals the logits path — loss, hidden-state gradient, and the weight's gradient accumulated into an fp32
    ``main_grad`` through the placeholder with a tied embedding's lookup gradient added (``zero_out_wgrad``)."""
    from mp_grpo.config.job import OutputPath
    from mp_grpo.megatron import MegatronGRPO, ParallelGroups, prepare_micro_batch
    from mp_grpo.megatron.fused_output import OutputWeight, loss_in_forward
    from tests.megatron import helpers as H
    from tests.tolerances import assert_close, tolerance

    env_interpret = os.environ.get("TRITON_INTERPRET")
    assert env_interpret in (None, "0"), "run without TRITON_INTERPRET: this test is for the GPU kernels"
    mb = prepare_micro_batch(H.make_rollouts(4, seed=23)).to("cuda")
    assert loss_in_forward(H.loss_config("ppo_token_tis"), mb.sequences)
    gen = torch.Generator().manual_seed(24)
    hidden = torch.randn(*mb.targets.shape, H.HIDDEN, generator=gen).to(dtype).cuda()
    weight = (torch.randn(H.VOCAB, H.HIDDEN, generator=gen) * H.HIDDEN**-0.5).to(dtype).cuda()
    tokens = torch.randint(0, H.VOCAB, (7,), generator=gen).cuda()
    emb_grad = torch.randn(7, H.HIDDEN, generator=gen).to(dtype).cuda()
    results = {}
    for path in (OutputPath.LOGITS, OutputPath.FUSED):
        grpo = MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=H.TEMPERATURE, num_microbatches=1,
                            calculate_per_token_loss=False, groups=ParallelGroups(), vocab_size=H.VOCAB,
                            output_path=path)
        batch = grpo.global_batch([mb], step=1)
        h, w = hidden.clone().requires_grad_(), torch.nn.Parameter(weight.clone())
        w.main_grad = torch.zeros(w.shape, device="cuda")
        w.grad_added_to_main_grad = False
        w.zero_out_wgrad = True
        emb = torch.nn.functional.embedding(tokens, w)  # the tied embedding's lookup
        if path == OutputPath.FUSED:
            out = grpo.loss_func(mb, batch, h, output_weight=OutputWeight(w, accumulate_into_main_grad=True))
        else:
            out = grpo.loss_func(mb, batch, h @ w.t())
        torch.autograd.backward([out[0], emb], [torch.tensor(0.61, device="cuda"), emb_grad])
        if path == OutputPath.FUSED:
            assert w.grad_added_to_main_grad
        w.main_grad.add_(w.grad)  # Megatron DDP's hook: with zero_out_wgrad the whole .grad goes in
        results[path] = (out[0].detach(), h.grad.float(), w.main_grad.clone())
    for name, actual, expected in zip(("loss", "grad hidden", "main_grad"), results[OutputPath.FUSED],
                                      results[OutputPath.LOGITS]):
        if dtype == torch.float32:
            assert_close(actual, expected, torch.float32, msg=name)
        else:
            err = _relative_l2(actual, expected)
            assert err <= tolerance(dtype)["rtol"], f"{name}: relative L2 error {err:.2e} ({dtype})"


# ------------------------------------------------------------------------------------------------ worker
def _model(config, tp_group):
    """GPTModel's ending: the vocab-parallel output layer on [S, B, H], logits returned as [B, S, V_local]."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.module import MegatronModule

    class OutputLayerOnly(MegatronModule):
        def __init__(self) -> None:
            super().__init__(config=config)
            self.output_layer = ColumnParallelLinear(
                HIDDEN, VOCAB, config=config, init_method=torch.nn.init.normal_, bias=False, gather_output=False,
                tp_group=tp_group,
            )

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            logits, _ = self.output_layer(hidden_states, weight=None)
            return logits.transpose(0, 1).contiguous()

    return OutputLayerOnly().cuda()


def _relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm().clamp(min=TINY_NORM))


def case_hidden_states(sequence_parallel: bool) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mp_grpo import fused_linear_logprobs, vocab_parallel_logprobs
    from mp_grpo.megatron.fused_output import call_for_hidden_states
    from mp_grpo.ops.fused_linear_loss import fused_linear_loss
    from tests.tolerances import assert_close, tolerance

    init_nccl()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tp_group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, tensor_model_parallel_size=2,
                                   sequence_parallel=sequence_parallel, use_cpu_initialization=True, params_dtype=dtype,
                                   bf16=dtype == torch.bfloat16)
        gen = torch.Generator().manual_seed(5)  # the same full inputs on every rank
        full_weight = torch.randn(VOCAB, HIDDEN, generator=gen) * HIDDEN**-0.5 * 2.0
        hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
        targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        targets[torch.rand(BATCH, SEQ, generator=gen) < 0.2] = -100
        g_lp, g_ent = torch.randn(BATCH, SEQ, generator=gen), torch.randn(BATCH, SEQ, generator=gen)
        local = hidden.chunk(2, dim=0)[rank] if sequence_parallel else hidden
        targets, g_lp, g_ent = targets.cuda(), g_lp.cuda(), g_ent.cuda()

        results = {}
        for path in ("logits", "fused", "fused_loss"):
            model = _model(config, tp_group)
            with torch.no_grad():
                model.output_layer.weight.copy_(full_weight.chunk(2, dim=0)[rank].to(dtype))
            x = local.to(device="cuda", dtype=dtype).requires_grad_()
            common = dict(tp_group=tp_group, temperature=TEMPERATURE, with_entropy=True)
            if path == "logits":
                lp, ent = vocab_parallel_logprobs(model(x), targets, **common)
            else:
                h, output_weight = call_for_hidden_states(model, x)
                assert output_weight.weight is model.output_layer.weight
                assert h.shape == (BATCH, SEQ, HIDDEN), f"hidden states {tuple(h.shape)}: not the full sequence"
                if path == "fused":
                    lp, ent = fused_linear_logprobs(h, output_weight.weight, targets, **common)
                else:  # the loss in forward: the same (token-separable) upstream gradients, made in forward
                    def loss_fn(lp, ent):
                        return (lp * g_lp).sum() + (ent * g_ent).sum(), None

                    loss, _ = fused_linear_loss(h, output_weight.weight, targets, loss_fn, **common)
                    loss.backward()
                    results[path] = dict(grad_input=x.grad, grad_weight=model.output_layer.weight.grad)
                    continue
            ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
            results[path] = dict(logprobs=lp, entropy=ent, grad_input=x.grad, grad_weight=model.output_layer.weight.grad)

        for fused_path in ("fused", "fused_loss"):
            where = f"sequence_parallel={sequence_parallel} {dtype} {fused_path}"
            for name, actual in results[fused_path].items():
                expected = results["logits"][name]
                if dtype == torch.float32 or name in ("logprobs", "entropy"):
                    try:
                        assert_close(actual, expected, dtype, msg=f"{name} [{where}]")
                    except AssertionError as e:
                        failures.append(str(e))
                else:
                    err = _relative_l2(actual, expected)
                    if not err <= tolerance(dtype)["rtol"]:
                        failures.append(f"{name}: relative L2 error {err:.2e} [{where}]")
                if rank == 0:
                    print(f"{where} {name}: relative L2 error {_relative_l2(actual, expected):.2e}")
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    assert not failures, "\n".join(failures)


if __name__ == "__main__":
    worker_main({"case_hidden_states": case_hidden_states})
