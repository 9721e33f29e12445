"""GRPOLoss on a CUDA GPU: the torch.compile'd path (``compile=True``) and the fused Triton path
(``backend=LossBackend.TRITON``) equal the eager torch path — loss, gradients and every metric — for every
objective, aggregation mode and correction, padded and packed; the fused path also at the benchmark's size
(16384 tokens, sequences spanning the GPU block sizes) and as the default (``AUTO``) on CUDA tensors.
Skipped without a GPU.

    python -m pytest tests/gpu/test_loss_compile.py -v

(The CPU suite runs the eager path and the fused path under the Triton interpreter: compiling with
torch.compile on 2 CPU cores takes minutes. scripts/bench_loss.py checks both again before timing them.)
"""

from __future__ import annotations

import pytest
import torch

from tests.loss.helpers import AGGREGATIONS, FEATURE_CONFIGS, config, make_batch
from tests.tolerances import tolerance

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LENGTHS = [5, 3, 0, 6, 1, 4]
T = 7
# Every feature config, the aggregation modes in turn (compiling is slow: 16 cases per variant, not 64).
CASES = [(f, list(AGGREGATIONS)[i % len(AGGREGATIONS)]) for i, f in enumerate(FEATURE_CONFIGS)]


def _run(loss_fn, batch, layout=None):
    lp = batch["logprobs"].clone().requires_grad_()
    ent = batch["entropy"].clone().requires_grad_()
    loss, metrics = loss_fn(lp, batch["old_logprobs"], batch["advantages"], batch["loss_mask"],
                            rollout_logprobs=batch["rollout_logprobs"], ref_logprobs=batch["ref_logprobs"],
                            entropy=ent, layout=layout)
    g = torch.tensor(-1.3, device=loss.device, dtype=loss.dtype)  # an upstream gradient other than 1
    loss.backward(g)
    zero = torch.zeros_like
    return loss.detach(), lp.grad, (zero(ent) if ent.grad is None else ent.grad), metrics


def _packed(batch):
    """Every row one segment of length T, back to back."""
    from mp_grpo.loss import PackedSequences

    flat = {k: (v if k == "advantages" else v.reshape(-1)) for k, v in batch.items()}
    return flat, PackedSequences(torch.arange(0, T * len(LENGTHS) + 1, T, device="cuda"))


def _variant(name: str, cfg):
    from mp_grpo.loss import GRPOLoss, LossBackend

    if name == "compiled":
        # Dynamo caches per code object with a recompile limit; a fresh cache per case keeps every case compiled.
        torch._dynamo.reset()
        return GRPOLoss(cfg, backend=LossBackend.TORCH, compile=True)
    return GRPOLoss(cfg, backend=LossBackend.TRITON)


def _assert_equal(got, want, rtol: float, atol: float) -> None:
    for name, a, b in zip(("loss", "d/dlogprobs", "d/dentropy"), got[:3], want[:3]):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=name)
    assert list(got[3]) == list(want[3])
    for k in want[3]:
        torch.testing.assert_close(got[3][k], want[3][k], rtol=rtol, atol=atol, equal_nan=True, msg=k)


@pytest.mark.parametrize("variant", ["compiled", "triton"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize(("feature", "aggregation"), CASES)
def test_equals_eager(feature: str, aggregation: str, layout: str, variant: str) -> None:
    from mp_grpo.loss import GRPOLoss, LossBackend

    cfg = config(feature, aggregation)
    batch = {k: v.cuda() for k, v in make_batch(0, LENGTHS, T, dtype=torch.float32).items()}
    seq_layout = None
    if layout == "packed":
        batch, seq_layout = _packed(batch)
    eager = _run(GRPOLoss(cfg, backend=LossBackend.TORCH), batch, seq_layout)
    other = _run(_variant(variant, cfg), batch, seq_layout)
    _assert_equal(other, eager, rtol=1e-5, atol=1e-6)


def _benchmark_batch(layout: str, seed: int):
    """16384 positions as 64 rows of 256 with random lengths (as scripts/bench_loss.py), or packed: 24 segments of
    random lengths up to 2000 (each spans several blocks of 256 and 1024) and a tail outside every segment."""
    from mp_grpo.loss import PackedSequences

    gen = torch.Generator(device="cuda").manual_seed(seed)
    n = 16384
    if layout == "padded":
        rows, width = 64, 256
        lengths = torch.randint(width // 8, width + 1, (rows,), generator=gen, device="cuda")
        mask = torch.arange(width, device="cuda").unsqueeze(0) < lengths.unsqueeze(1)
        shape, seq_layout, num_seqs = (rows, width), None, rows
    else:
        seg = torch.randint(1, 2000, (24,), generator=gen, device="cuda")
        cu = torch.cat([torch.zeros(1, dtype=torch.int64, device="cuda"), seg.cumsum(0)]).clamp(max=n - 5)
        mask = torch.rand(n, generator=gen, device="cuda") < 0.9
        shape, seq_layout, num_seqs = (n,), PackedSequences(cu), 24

    def noise(scale):
        return torch.randn(shape, generator=gen, device="cuda") * scale

    lp = -noise(1.0).abs()
    old = lp + noise(0.05)
    rollout = old + noise(0.05)
    batch = {"logprobs": lp, "old_logprobs": old, "rollout_logprobs": rollout, "ref_logprobs": lp + noise(0.1),
             "entropy": torch.rand(shape, generator=gen, device="cuda") * 3,
             "advantages": torch.randn(num_seqs, generator=gen, device="cuda"), "loss_mask": mask}
    return batch, seq_layout


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("feature", ["gspo_seq_is_geo_reject", "reinforce_opsm_skip", "ppo_seq_reject_kl_st",
                                     "sapo_entropy_kl"])
def test_triton_at_benchmark_size(feature: str, layout: str) -> None:
    from mp_grpo.loss import GRPOLoss, LossBackend

    cfg = config(feature, "seq_mean_token_mean")
    batch, seq_layout = _benchmark_batch(layout, seed=len(feature))
    eager = _run(GRPOLoss(cfg, backend=LossBackend.TORCH), batch, seq_layout)
    fused = _run(GRPOLoss(cfg, backend=LossBackend.TRITON), batch, seq_layout)
    _assert_equal(fused, eager, **tolerance(torch.float32))


def test_auto_is_triton_on_cuda() -> None:
    from mp_grpo.loss import GRPOLoss

    cfg = config("gspo_seq_is_geo_reject", "seq_mean_token_mean")
    batch = {k: v.cuda() for k, v in make_batch(1, LENGTHS, T, dtype=torch.float32).items()}
    lp = batch["logprobs"].clone().requires_grad_()
    loss, _ = GRPOLoss(cfg)(lp, batch["old_logprobs"], batch["advantages"], batch["loss_mask"],
                            rollout_logprobs=batch["rollout_logprobs"])
    assert "FusedGRPOLossFunction" in type(loss.grad_fn).__name__
