"""The fused GRPO loss (mp_grpo/ops/grpo_loss.py) equals the torch path of GRPOLoss: loss, gradients under a
random upstream gradient, and every metric entry — padded and packed (sequences spanning several kernel
blocks, many short ones in one block, an empty one, positions after the last segment), mixed input dtypes
and non-contiguous inputs; the backend choice and its errors. Under the Triton interpreter (blocks of 16).

Values and gradients against the float64 reference, TRL's hand-checked numbers and NaN safety run on both
backends in tests/loss/test_grpo_loss.py; context parallelism in tests/loss/test_layout_invariance.py.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from mp_grpo.loss import GlobalBatch, GRPOLoss, LossBackend, PackedSequences, PaddedSequences
from mp_grpo.loss.sequence import SequenceLayout
from tests.loss.helpers import AGGREGATIONS, FEATURE_CONFIGS, config, make_batch
from tests.tolerances import tolerance

LENGTHS = [5, 3, 0, 6, 1, 4]
T = 7
# Packed: segment lengths (blocks are 16 positions): 41 spans three blocks, 1 1 2 0 1 share one, one empty
# segment; two positions after the last segment. Every segment's last position is masked out too.
SEGMENTS = [9, 41, 1, 1, 2, 0, 1, 13]
TRAILING = 2
# Every feature config once, the aggregation modes in turn.
CASES = [(f, list(AGGREGATIONS)[i % len(AGGREGATIONS)]) for i, f in enumerate(FEATURE_CONFIGS)]


def _packed_batch(seed: int, *, per_token_advantages: bool = False) -> tuple[dict, PackedSequences]:
    lengths = torch.tensor(SEGMENTS)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    n = int(cu[-1]) + TRAILING
    # make_batch's row 0 of length n - 1 gives masks with a masked tail; reuse its values and garbage.
    flat = make_batch(seed, [n - 1], n, per_token_advantages=per_token_advantages)
    batch = {k: v.reshape(-1) for k, v in flat.items() if k != "advantages"}
    ends = cu[1:] - 1
    batch["loss_mask"] = batch["loss_mask"].index_fill(0, ends[lengths > 0], False)
    gen = torch.Generator().manual_seed(seed + 1)
    batch["advantages"] = flat["advantages"].reshape(-1) if per_token_advantages else \
        torch.randn(len(SEGMENTS), generator=gen, dtype=torch.float64)
    return batch, PackedSequences(cu)


def _call(backend: LossBackend, cfg, inputs: dict, layout: SequenceLayout | None, g: float, **kwargs):
    """Loss, gradients w.r.t. log-probs and entropy (upstream gradient ``g``) and metrics of one call."""
    lp = inputs["logprobs"].clone().requires_grad_()
    ent = inputs["entropy"].clone().requires_grad_()
    loss, metrics = GRPOLoss(cfg, backend=backend)(
        lp, inputs["old_logprobs"], inputs["advantages"], inputs["loss_mask"],
        rollout_logprobs=inputs["rollout_logprobs"], ref_logprobs=inputs["ref_logprobs"], entropy=ent, layout=layout,
        **kwargs,
    )
    (loss * g).backward()
    zero = torch.zeros_like
    return loss.detach(), zero(lp) if lp.grad is None else lp.grad, zero(ent) if ent.grad is None else ent.grad, metrics


def _assert_same(fused, torch_path, dtype: torch.dtype) -> None:
    for name, a, b in zip(("loss", "d/dlogprobs", "d/dentropy"), fused[:3], torch_path[:3]):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, **tolerance(dtype), msg=name)
    assert list(fused[3]) == list(torch_path[3])  # same names, same order
    for name, value in torch_path[3].items():
        got = fused[3][name]
        assert got.dtype == value.dtype == torch.float64 and got.shape == value.shape, name
        torch.testing.assert_close(got, value, **tolerance(dtype), equal_nan=True, msg=name)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize(("feature", "aggregation"), CASES)
def test_equals_torch_path(feature: str, aggregation: str, layout: str) -> None:
    cfg = config(feature, aggregation)
    seed = zlib.crc32(f"{feature}/{aggregation}/{layout}".encode())
    g = float(torch.randn((), generator=torch.Generator().manual_seed(seed)))  # random upstream gradient
    if layout == "padded":
        batch, lay = make_batch(seed, LENGTHS, T), None
    else:
        batch, lay = _packed_batch(seed, per_token_advantages=feature == "gmpo")
    fused = _call(LossBackend.TRITON, cfg, batch, lay, g)
    reference = _call(LossBackend.TORCH, cfg, batch, lay, g)
    _assert_same(fused, reference, torch.float64)
    masked = ~batch["loss_mask"]
    assert (fused[1][masked] == 0).all() and (fused[2][masked] == 0).all()


@pytest.mark.parametrize("objective", ["gspo", "gmpo"])
def test_sequence_mean_objectives_with_a_global_batch(objective: str) -> None:
    """Gradient through the sequence mean when the step is split: each micro-batch's share from its own call."""
    cfg = config("gspo_seq_is_geo_reject" if objective == "gspo" else "gmpo", "seq_mean_token_sum")
    batch = make_batch(21, LENGTHS, T, per_token_advantages=True)
    parts = [{k: v[i:i + 3] for k, v in batch.items()} for i in (0, 3)]
    gb = GlobalBatch.from_masks([p["loss_mask"] for p in parts])
    for part in parts:
        fused = _call(LossBackend.TRITON, cfg, part, None, -1.7, batch=gb)
        reference = _call(LossBackend.TORCH, cfg, part, None, -1.7, batch=gb)
        _assert_same(fused, reference, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_dtypes_and_non_contiguous_inputs(dtype: torch.dtype) -> None:
    cfg = config("ppo_seq_reject_kl_st", "seq_mean_token_mean")
    batch = make_batch(22, LENGTHS, T, per_token_advantages=True)
    # Column-major views of [T, B] storage: non-contiguous [B, T] inputs of several dtypes.
    mixed = {k: v.t().contiguous().t() for k, v in batch.items()}
    mixed["logprobs"] = mixed["logprobs"].to(dtype)
    mixed["entropy"] = mixed["entropy"].to(dtype)
    mixed["old_logprobs"] = mixed["old_logprobs"].float()
    mixed["loss_mask"] = mixed["loss_mask"].to(torch.int32)
    assert not mixed["logprobs"].is_contiguous()
    fused = _call(LossBackend.TRITON, cfg, mixed, PaddedSequences(), 0.9)
    reference = _call(LossBackend.TORCH, cfg, mixed, PaddedSequences(), 0.9)
    assert fused[1].dtype == dtype and fused[2].dtype == dtype and fused[0].dtype == torch.float32
    _assert_same(fused, reference, dtype)


def test_empty_micro_batch() -> None:
    cfg = config("gspo_seq_is_geo_reject", "seq_mean_token_mean")
    batch = make_batch(23, [0, 0], 0)
    fused = _call(LossBackend.TRITON, cfg, batch, None, 1.0)
    _assert_same(fused, _call(LossBackend.TORCH, cfg, batch, None, 1.0), torch.float64)
    assert fused[0].item() == 0.0


# ------------------------------------------------------------------------------ backend choice
class _OtherLayout(SequenceLayout):
    """Padded rows, but a SequenceLayout the fused kernels do not know."""

    check_tokens = PaddedSequences.check_tokens
    num_sequences = PaddedSequences.num_sequences
    local_seq_sum = PaddedSequences.local_seq_sum
    broadcast = PaddedSequences.broadcast


def test_auto_runs_the_torch_path_on_cpu(monkeypatch) -> None:
    from mp_grpo.ops.grpo_loss import FusedGRPOLoss

    def fail(*args, **kwargs):
        raise AssertionError("AUTO took the fused path for CPU tensors")

    monkeypatch.setattr(FusedGRPOLoss, "__call__", fail)
    cfg = config("ppo_dual_delta", "token_mean")
    batch = make_batch(24, LENGTHS, T)
    assert GRPOLoss(cfg).backend == LossBackend.AUTO
    _call(LossBackend.AUTO, cfg, batch, None, 1.0)
    _call(LossBackend.AUTO, cfg, batch, _OtherLayout(), 1.0)  # any layout on the torch path


def test_backend_errors_name_the_argument() -> None:
    cfg = config("ppo_dual_delta", "token_mean")
    batch = make_batch(25, LENGTHS, T)
    with pytest.raises(TypeError, match="backend"):
        GRPOLoss(cfg, backend="triton")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="compile"):
        GRPOLoss(cfg, backend=LossBackend.TRITON, compile=True)
    with pytest.raises(ValueError, match="layout"):
        _call(LossBackend.TRITON, cfg, batch, _OtherLayout(), 1.0)
    elsewhere = GlobalBatch.from_masks([batch["loss_mask"].to("meta")])
    with pytest.raises(ValueError, match="batch.valid_tokens"):
        _call(LossBackend.TRITON, cfg, batch, None, 1.0, batch=elsewhere)
