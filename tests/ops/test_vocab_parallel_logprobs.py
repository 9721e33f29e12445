"""vocab_parallel_logprobs on one process (TP = 1) against the float64 reference."""

from __future__ import annotations

import pytest
import torch

from mp_grpo import vocab_parallel_logprobs
from tests.reference import logprobs_reference
from tests.tolerances import assert_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _random_case(shape, vocab, dtype, *, scale=3.0, ignore_frac=0.2, seed=None):
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    logits = (torch.randn(*shape, vocab, generator=gen) * scale).to(dtype)
    target = torch.randint(0, vocab, shape, generator=gen)
    ignored = torch.rand(shape, generator=gen) < ignore_frac
    target = torch.where(ignored, torch.full_like(target, -100), target)
    return logits, target


def _check_against_reference(logits, target, *, temperature=1.0, with_entropy=True, grad_dtype=None):
    """Forward values and the gradient under a random upstream gradient, vs. float64."""
    dtype = logits.dtype
    x = logits.clone().requires_grad_()
    out = vocab_parallel_logprobs(x, target, temperature=temperature, with_entropy=with_entropy)
    lp, ent = out if with_entropy else (out, None)
    x_ref = logits.detach().double().requires_grad_()
    lp_ref, ent_ref = logprobs_reference(x_ref, target, temperature=temperature)

    assert lp.dtype == torch.float32 and lp.shape == target.shape
    # Outputs are fp32 whatever the logits' dtype: the reference sees the same rounded inputs.
    assert_close(lp, lp_ref, torch.float32, "logprobs")
    g_lp = torch.randn_like(lp)
    loss, loss_ref = (lp * g_lp).sum(), (lp_ref * g_lp.double()).sum()
    if with_entropy:
        assert ent.dtype == torch.float32
        assert_close(ent, ent_ref, torch.float32, "entropy")
        g_ent = torch.randn_like(ent)
        loss, loss_ref = loss + (ent * g_ent).sum(), loss_ref + (ent_ref * g_ent.double()).sum()
    loss.backward()
    loss_ref.backward()
    assert x.grad.dtype == dtype and x.grad.shape == logits.shape
    assert_close(x.grad, x_ref.grad, grad_dtype or dtype, "grad logits")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_entropy", [False, True])
def test_matches_reference(dtype, with_entropy):
    # 100 columns: not a multiple of the block (64 under the interpreter).
    logits, target = _random_case((3, 7), 100, dtype)
    _check_against_reference(logits, target, with_entropy=with_entropy)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_temperature(temperature):
    logits, target = _random_case((11,), 130, torch.float32)
    _check_against_reference(logits, target, temperature=temperature)


@pytest.mark.parametrize("shape", [(13,), (4, 3), (2, 3, 2)])
@pytest.mark.parametrize("vocab", [1, 37, 129])
def test_leading_shapes_and_odd_vocab(shape, vocab):
    logits, target = _random_case(shape, vocab, torch.float32, ignore_frac=0.0)
    _check_against_reference(logits, target)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_logits(dtype):
    """Rows of ±1e4, all-equal rows and one dominant logit stay exact and finite."""
    vocab = 70
    logits, target = _random_case((6,), vocab, torch.float32, ignore_frac=0.0)
    logits[0] = 1e4
    logits[1] = -1e4
    logits[2] = torch.where(torch.rand(vocab) < 0.5, 1e4, -1e4)
    logits[3] = 0.25  # all equal: uniform distribution
    logits[4, 5] = 1e4  # one dominant logit
    target[4] = 5
    logits[5, 9] = 1e4
    target[5] = 3  # a target far below the dominant logit: log-prob ≈ -1e4
    _check_against_reference(logits.to(dtype), target)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_minus_inf_logits(dtype):
    """A filtered vocabulary (-inf entries): finite results and gradients where the target is finite."""
    logits, target = _random_case((5, 4), 90, torch.float32, ignore_frac=0.0)
    filtered = torch.rand(logits.shape) < 0.6
    filtered.scatter_(-1, target.unsqueeze(-1), False)  # the sampled token survives the filter
    filtered[0, 0] = True
    filtered[0, 0, target[0, 0]] = False  # a row with a single finite logit
    logits = torch.where(filtered, float("-inf"), logits).to(dtype)
    x = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(x, target, with_entropy=True)
    (lp * torch.randn_like(lp) + ent * torch.randn_like(ent)).sum().backward()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(x.grad).all()
    assert x.grad[filtered].eq(0).all()
    _check_against_reference(logits, target)


def test_ignore_index_rows():
    logits, target = _random_case((8,), 50, torch.float32, ignore_frac=0.0)
    target[[1, 4]] = -7
    x = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(x, target, with_entropy=True, ignore_index=-7)
    assert lp[[1, 4]].eq(0).all()
    _, ent_ref = logprobs_reference(logits, target.clamp(min=0))
    assert_close(ent, ent_ref, torch.float32, "entropy of ignored rows is still computed")
    lp.sum().backward()
    assert x.grad[[1, 4]].eq(0).all() and x.grad[0].ne(0).any()


def test_non_contiguous_inputs():
    base, target = _random_case((6, 5), 80, torch.float32)
    for logits, tgt in [
        (base.transpose(0, 1), target.transpose(0, 1)),  # [S, B] vs [B, S]: leading dims permuted
        (base[:, :, 5:70], target.clamp(max=64)),  # a slice of the vocabulary dim: row stride != V
        (base.transpose(-1, -2).contiguous().transpose(-1, -2), target),  # last dim not contiguous
        (base[::2], target[::2]),
        (base[0, ::2], target[0, ::2]),  # a strided 1-D target (reshape keeps it a strided view)
        (base[0], target[:, 0].contiguous()[:5]),
    ]:
        _check_against_reference(logits, tgt)


def test_inputs_unchanged_and_inplace_backward():
    logits, target = _random_case((9,), 75, torch.bfloat16)
    x = logits.clone().requires_grad_()
    lp = vocab_parallel_logprobs(x, target)
    g = torch.randn_like(lp)
    lp.backward(g)
    assert torch.equal(x.detach(), logits), "forward/backward changed the logits"

    buf = logits.clone().requires_grad_()
    lp2 = vocab_parallel_logprobs(buf, target, inplace_backward=True)
    assert torch.equal(lp2, lp)
    lp2.backward(g)
    assert torch.equal(buf.grad, x.grad)
    assert buf.grad.data_ptr() == buf.data_ptr(), "in-place backward must reuse the logits buffer"


@pytest.mark.parametrize("with_entropy", [False, True])
def test_saved_tensors_hold_no_vocab_sized_buffer(with_entropy):
    rows, vocab = 12, 200
    logits, target = _random_case((rows,), vocab, torch.bfloat16)
    x = logits.clone().requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        vocab_parallel_logprobs(x, target, with_entropy=with_entropy)
    extra = [t for t in saved if t.data_ptr() != x.data_ptr()]
    assert all(t.numel() <= rows for t in extra), [tuple(t.shape) for t in extra]
    assert sum(t.numel() * t.element_size() for t in extra) <= 64 * rows


def test_bad_input_errors():
    logits, target = _random_case((4,), 10, torch.float32, ignore_frac=0.0)
    with pytest.raises(ValueError, match="target.*outside \\[0, 10\\)"):
        vocab_parallel_logprobs(logits, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="target.*outside"):
        vocab_parallel_logprobs(logits, torch.tensor([0, -1, 3, 2]))
    with pytest.raises(TypeError, match="target must be an int64"):
        vocab_parallel_logprobs(logits, target.float())
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_logprobs(logits, target[:3])
    with pytest.raises(TypeError, match="logits must be a float32"):
        vocab_parallel_logprobs(logits.long(), target)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            vocab_parallel_logprobs(logits, target, temperature=bad)


def test_unchecked_bad_targets_are_nan_not_wrong():
    """check_inputs=False skips the host read, but a bad target still cannot pass as a number."""
    logits, _ = _random_case((4,), 10, torch.float32, ignore_frac=0.0)
    target = torch.tensor([0, 10, -100, -3])
    lp = vocab_parallel_logprobs(logits, target, check_inputs=False)
    assert torch.isnan(lp[[1, 3]]).all()
    assert lp[2] == 0 and torch.isfinite(lp[0])
