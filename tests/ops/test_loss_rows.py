"""mp_grpo/ops/loss_rows.py: the loss rows alone through the fused output-layer ops, one process (TP = 1).

- The gather and the scatter: values at the rows, the gradient of every other row exactly 0 (written: a mutant whose
  backward leaves the other rows unwritten fails), the sequence-major gather equal to the batch-major one.
- ``fused_linear_loss`` on the rows (``LossRows.loss_fn``: the caller's loss on full-size log-probs) and
  ``fused_linear_logprobs`` on the rows, scattered back: against the float64 reference of every row (the loss reads
  the loss rows only) with a random upstream gradient, for fp32 and bf16 operands with bf16 and fp32 logits and the
  entropy; the hidden gradient of every row outside the loss mask is exactly 0.
- A per-row sampling filter cut to the rows gives every row's filtered log-probs at the rows.
"""

from __future__ import annotations

import math

import pytest
import torch

from mp_grpo.config.precision import LogitDtype
from mp_grpo.ops.fused_linear_logprobs import fused_linear_logprobs
from mp_grpo.ops.fused_linear_loss import fused_linear_loss
from mp_grpo.ops import loss_rows as loss_rows_module
from mp_grpo.ops.loss_rows import LossRows, loss_rows
from mp_grpo.ops.sampling_filter import SamplingFilter
from tests.reference import filtered_logprobs_reference, linear_logprobs_reference
from tests.tolerances import assert_close

IGNORE = -100


def _case(shape, hidden_size, vocab, dtype, seed, loss_fraction=0.4):
    """hidden, weight, targets (``IGNORE`` outside the mask) and the loss mask; a few rows carry loss."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=gen).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * (2.0 / hidden_size**0.5)).to(dtype)
    mask = torch.rand(shape, generator=gen) < loss_fraction
    target = torch.where(mask, torch.randint(0, vocab, shape, generator=gen), torch.full(shape, IGNORE))
    return hidden, weight, target, mask, gen


def _rows_grad_check(grad: torch.Tensor, upstream: torch.Tensor, mask: torch.Tensor) -> None:
    """``grad`` [*mask, H] is ``upstream`` at the rows and exactly 0 at every other row."""
    assert torch.equal(grad[mask], upstream), "the rows' gradient"
    assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask])), "every other row's gradient must be exactly 0"


def test_gather_scatter_and_the_zero_gradient():
    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(3, 7, generator=gen) < 0.4
    rows = LossRows(loss_rows(mask), mask.shape)
    assert rows.count == int(mask.sum()) and rows.compact_shape == (1, rows.count)
    x = torch.randn(3, 7, 5, generator=gen, requires_grad=True)
    picked = rows.gather(x)
    assert torch.equal(picked, x[mask])
    # Megatron's sequence-major [S, B, H] activations give the same rows, in the same (batch-major) order
    x_sb = x.detach().transpose(0, 1).contiguous().requires_grad_()
    assert torch.equal(rows.gather_sequence_major(x_sb), picked)
    upstream = torch.randn(picked.shape, generator=gen)
    picked.backward(upstream)
    _rows_grad_check(x.grad, upstream, mask)
    rows.gather_sequence_major(x_sb).backward(upstream)
    _rows_grad_check(x_sb.grad.transpose(0, 1), upstream, mask)

    values = torch.randn(rows.count, generator=gen, requires_grad=True)
    fill, missing = rows.fill_outside(mask)
    assert int(missing) == 0 and torch.equal(fill, torch.zeros(mask.numel()))
    full = rows.scatter(values, fill)
    assert full.shape == mask.shape and torch.equal(full[mask], values.detach()) and not full[~mask].any()
    g_full = torch.randn(mask.shape, generator=gen)
    full.backward(g_full)
    assert torch.equal(values.grad, g_full[mask])
    # a trained position the rows miss: NaN there (never a silent 0), and counted
    fewer = LossRows(rows.index[1:], mask.shape)
    fill, missing = fewer.fill_outside(mask)
    assert int(missing) == 1 and int(fill.isnan().sum()) == 1


def test_a_gradient_left_unwritten_fails(monkeypatch):
    """Mutant: the gather's backward without the zero fill (garbage outside the rows) fails the zero-gradient check."""

    def unwritten(ctx, grad):
        (rows,) = ctx.saved_tensors
        return grad.new_full(ctx.x_shape, math.nan).index_copy_(0, rows, grad), None

    monkeypatch.setattr(loss_rows_module._GatherRows, "backward", staticmethod(unwritten))
    mask = torch.tensor([[True, False, True, False]])
    rows = LossRows(loss_rows(mask), mask.shape)
    x = torch.randn(1, 4, 3, requires_grad=True)
    upstream = torch.randn(2, 3)
    rows.gather(x).backward(upstream)
    with pytest.raises(AssertionError, match="exactly 0"):
        _rows_grad_check(x.grad, upstream, mask)


def _masked_loss(mask: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    """A token-separable loss of the trained positions only (a clip and an entropy term), selected with where."""

    def loss_fn(lp, ent):
        ratio = torch.exp(lp - lp.detach().clamp(max=0.0) * 0.5)
        term = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a) + 0.3 * lp**2 - b * ent
        total = torch.where(mask, term, torch.zeros_like(term)).sum()
        return total, {"mean_lp": torch.where(mask, lp.detach(), 0.0).sum()}

    return loss_fn


@pytest.mark.parametrize("op", ["loss_in_forward", "per_token"])
@pytest.mark.parametrize("dtype,logit_dtype", [(torch.float32, LogitDtype.BF16), (torch.bfloat16, LogitDtype.BF16),
                                               (torch.bfloat16, LogitDtype.FP32)],
                         ids=["fp32", "bf16_logits", "bf16_operands_fp32_logits"])
def test_fused_ops_on_the_loss_rows_match_the_reference(op, dtype, logit_dtype):
    shape = (3, 6)
    hidden, weight, target, mask, gen = _case(shape, 16, 29, dtype, seed=5 + len(op))
    a, b = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    g = torch.rand((), generator=gen) * 3 + 0.5  # the upstream gradient (Megatron's loss scaling)
    loss_fn = _masked_loss(mask, a, b)
    rows = LossRows(loss_rows(mask), shape)
    fill, _ = rows.fill_outside(mask)

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    picked, targets = rows.gather(h).unsqueeze(0), rows.select(target)
    if op == "loss_in_forward":
        loss, aux = fused_linear_loss(picked, w, targets, rows.loss_fn(loss_fn, fill), with_entropy=True,
                                      chunk_tokens=2, logit_dtype=logit_dtype)
    else:
        lp, ent = fused_linear_logprobs(picked, w, targets, with_entropy=True, chunk_tokens=2, chunk_vocab=11,
                                        logit_dtype=logit_dtype)
        loss, aux = loss_fn(rows.scatter(lp, fill), rows.scatter(ent, fill))
    loss.backward(g)

    ref_h, ref_w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    rounding = dict(logits_dtype=dtype) if logit_dtype is LogitDtype.BF16 else dict(logits_grad_dtype=dtype)
    ref_lp, ref_ent = linear_logprobs_reference(ref_h, ref_w, target, **rounding)
    ref_loss, ref_aux = loss_fn(ref_lp, ref_ent)
    (ref_loss * g.double()).backward()

    tag = f"({op}, {dtype}, {logit_dtype.value} logits)"
    compute = torch.float32 if logit_dtype is LogitDtype.FP32 else dtype
    assert_close(loss, ref_loss, compute, f"loss {tag}")
    assert_close(aux["mean_lp"], ref_aux["mean_lp"], compute, f"aux {tag}")
    assert torch.equal(h.grad[~mask], torch.zeros_like(h.grad[~mask])), f"hidden gradient outside the rows {tag}"
    for name, actual, expected in (("hidden", h.grad, ref_h.grad), ("weight", w.grad, ref_w.grad)):
        scale = expected.abs().max()
        assert_close(actual.double() / scale, expected / scale, dtype, f"grad {name} {tag}")


def test_sampling_filter_cut_to_the_rows():
    """Per-row top-k values cut to the rows: the rows' filtered log-probs are every row's at the rows."""
    shape = (2, 9)
    hidden, weight, target, mask, gen = _case(shape, 12, 23, torch.float32, seed=3, loss_fraction=0.5)
    top_k = torch.randint(1, 12, shape, generator=gen)
    filt = SamplingFilter(top_k=top_k, top_p=0.9)
    rows = LossRows(loss_rows(mask), shape)
    cut = rows.sampling_filter(filt)
    assert torch.equal(cut.top_k, top_k[mask].view(1, -1)) and cut.top_p == 0.9
    fill, _ = rows.fill_outside(mask)
    lp, ent = fused_linear_logprobs(rows.gather(hidden).unsqueeze(0), weight, rows.select(target), with_entropy=True,
                                    sampling_filter=cut, check_inputs=False)
    ref_lp, ref_ent = filtered_logprobs_reference(hidden.double() @ weight.double().t(), target, top_k=top_k, top_p=0.9)
    full_lp, full_ent = rows.scatter(lp, fill), rows.scatter(ent, fill)
    finite = torch.isfinite(ref_lp) & mask
    assert torch.equal(torch.isneginf(full_lp), torch.isneginf(ref_lp) & mask), "kept sets at the rows"
    assert_close(full_lp[finite], ref_lp[finite], torch.float32, "filtered log-probs at the rows")
    assert_close(full_ent[mask], ref_ent[mask], torch.float32, "filtered entropy at the rows")
    assert not full_lp[~mask].any() and not full_ent[~mask].any()


def test_no_rows_and_bad_rows():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    rows = LossRows(loss_rows(mask), mask.shape)
    hidden = torch.randn(2, 3, 8, requires_grad=True)
    weight = torch.randn(5, 8, requires_grad=True)
    lp = fused_linear_logprobs(rows.gather(hidden).unsqueeze(0), weight, rows.select(torch.zeros(2, 3, dtype=torch.long)))
    full = rows.scatter(lp, rows.fill_outside(mask)[0])
    assert full.shape == (2, 3) and not full.any()
    full.sum().backward()
    assert not hidden.grad.any() and not weight.grad.any()
    with pytest.raises(TypeError, match="loss_mask must be a bool tensor"):
        loss_rows(torch.ones(3))
    with pytest.raises(ValueError, match="int64"):
        LossRows(torch.zeros(2, dtype=torch.int32), mask.shape)
    with pytest.raises(ValueError, match="7 rows"):
        LossRows(torch.arange(7), mask.shape)
    with pytest.raises(ValueError, match="output layer's input"):
        rows.gather_sequence_major(torch.randn(2, 3, 8))


def test_token_id_lists_cut_to_the_rows_and_values_scattered_back():
    """A per-token id list (CSR: a captured support, top-K ids) cut to the rows keeps each row's ids in order and its
    type; per-entry values of the cut list go back to the whole list's entries, 0 at the other rows'."""
    from mp_grpo.ops.token_ids import CapturedSupport, TokenIds

    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(3, 5, generator=gen) < 0.5
    lists = [sorted(torch.randperm(11, generator=gen)[: int(torch.randint(0, 4, (), generator=gen))].tolist())
             for _ in range(mask.numel())]
    rows = LossRows(loss_rows(mask), mask.shape)
    for kind in (TokenIds, CapturedSupport):
        whole = kind.from_lists(lists)
        cut, positions = rows.token_ids(whole)
        assert type(cut) is kind
        want = [lists[i] for i in rows.index.tolist()]
        assert cut.indptr.tolist() == [0, *torch.tensor([len(x) for x in want]).cumsum(0).tolist()]
        assert cut.ids.tolist() == [i for x in want for i in x]
        assert torch.equal(whole.ids[positions], cut.ids)
        values = torch.randn(cut.nnz, generator=gen)
        back = LossRows.scatter_entries(values, positions, whole.nnz)
        entry_row = torch.arange(mask.numel()).repeat_interleave(whole.indptr.diff())
        kept = mask.reshape(-1)[entry_row]
        assert torch.equal(back[kept], values) and bool((back[~kept] == 0).all())
