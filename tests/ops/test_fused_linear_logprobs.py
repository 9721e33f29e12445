"""fused_linear_logprobs on one process (TP = 1): against the float64 reference and the logits path.

The float64 reference (``linear_logprobs_reference``) rounds the logits and their gradient to the
compute dtype, as any op that computes the logits in that dtype must (the logits path does too).
The gradients w.r.t. ``hidden`` and ``weight`` are sums over the vocabulary (or the tokens) of such
rounded terms: their error scales with the terms, not with the sum, which can cancel to near zero.
They are compared on the scale of their largest entry (:func:`_assert_sum_close`).
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from mp_grpo import fused_linear_logprobs, vocab_parallel_logprobs
from mp_grpo.ops.output_chunks import (
    GRAD_HIDDEN_BLOCK_BYTES,
    LOGITS_CHUNK_BYTES,
    plan_chunks,
)
from tests.reference import linear_logprobs_reference
from tests.tolerances import assert_close

CHUNKS = [  # (chunk_tokens, chunk_vocab)
    (None, None),  # automatic: one chunk at these sizes
    (1, None),  # one row per chunk
    (4, 5),  # neither divides N = 13 or V = 37
    (6, 1),  # one column per backward chunk
]


def _random_case(shape, hidden_size, vocab, dtype, *, seed=None, ignore_frac=0.2):
    seed = seed if seed is not None else torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=gen).to(dtype)
    # Logits of standard deviation ~2: a spread-out but not degenerate softmax.
    weight = (torch.randn(vocab, hidden_size, generator=gen) * (2.0 / hidden_size**0.5)).to(dtype)
    target = torch.randint(0, vocab, shape, generator=gen)
    ignored = torch.rand(shape, generator=gen) < ignore_frac
    target = torch.where(ignored, torch.full_like(target, -100), target)
    return hidden, weight, target, seed


def _assert_sum_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, msg: str) -> None:
    """``assert_close`` at ``dtype``'s tolerance, both sides divided by the largest ``|expected|``."""
    scale = expected.detach().abs().max().item()
    assert scale > 0, f"{msg}: the reference gradient is all zero, the test data is degenerate"
    assert_close(actual.detach().double() / scale, expected.detach().double() / scale, dtype, msg)


def _run(hidden, weight, target, *, with_entropy, fn, g_lp, g_ent, **kwargs):
    """Forward + backward with the upstream gradients; returns (logprobs, entropy, grad hidden, grad weight)."""
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    out = fn(h, w, target, with_entropy=with_entropy, **kwargs)
    lp, ent = out if with_entropy else (out, None)
    loss = (lp.double() * g_lp.double()).sum()
    if with_entropy:
        loss = loss + (ent.double() * g_ent.double()).sum()
    loss.backward()
    return lp, ent, h.grad, w.grad


def _logits_path(h, w, target, **kwargs):
    return vocab_parallel_logprobs(h @ w.T, target, **kwargs)


def _reference(h, w, target, *, with_entropy, temperature=1.0):
    lp, ent = linear_logprobs_reference(h, w, target, temperature=temperature, logits_dtype=h.dtype)
    return (lp, ent) if with_entropy else lp


def _check(hidden, weight, target, seed, *, with_entropy=True, temperature=1.0, **chunks):
    dtype = hidden.dtype
    g_lp, g_ent = torch.randn(target.shape), torch.randn(target.shape)
    common = dict(with_entropy=with_entropy, g_lp=g_lp, g_ent=g_ent)
    lp, ent, gh, gw = _run(hidden, weight, target, fn=fused_linear_logprobs, temperature=temperature, **chunks, **common)
    ref = _run(hidden, weight, target, fn=_reference, temperature=temperature, **common)
    path = _run(hidden, weight, target, fn=_logits_path, temperature=temperature, **common)
    tag = f"(seed {seed}, {dtype}, chunks {chunks})"

    assert lp.dtype == torch.float32 and lp.shape == target.shape
    assert gh.dtype == dtype and gh.shape == hidden.shape and gw.dtype == dtype and gw.shape == weight.shape
    # Values: the reference sees the same rounded logits, so fp32 arithmetic is all that remains.
    assert_close(lp, ref[0], torch.float32, f"logprobs vs reference {tag}")
    assert_close(lp, path[0], torch.float32, f"logprobs vs logits path {tag}")
    if with_entropy:
        assert ent.dtype == torch.float32
        assert_close(ent, ref[1], torch.float32, f"entropy vs reference {tag}")
        assert_close(ent, path[1], torch.float32, f"entropy vs logits path {tag}")
    for name, ours, r, p in (("hidden", gh, ref[2], path[2]), ("weight", gw, ref[3], path[3])):
        _assert_sum_close(ours, r, dtype, f"grad {name} vs reference {tag}")
        _assert_sum_close(ours, p, dtype, f"grad {name} vs logits path {tag}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunks", CHUNKS, ids=lambda c: f"tokens{c[0]}-vocab{c[1]}")
def test_matches_reference_and_logits_path(dtype, chunks):
    hidden, weight, target, seed = _random_case((13,), 24, 37, dtype)
    _check(hidden, weight, target, seed, chunk_tokens=chunks[0], chunk_vocab=chunks[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_entropy(dtype):
    hidden, weight, target, seed = _random_case((13,), 24, 37, dtype)
    _check(hidden, weight, target, seed, with_entropy=False, chunk_tokens=4, chunk_vocab=5)


@pytest.mark.parametrize("temperature", [0.6, 1.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_temperature(temperature, dtype):
    hidden, weight, target, seed = _random_case((9,), 16, 45, dtype)
    _check(hidden, weight, target, seed, temperature=temperature, chunk_tokens=4, chunk_vocab=16)


def test_float16():
    hidden, weight, target, seed = _random_case((10,), 16, 33, torch.float16)
    _check(hidden, weight, target, seed, chunk_tokens=3, chunk_vocab=8)


def test_leading_shapes_and_non_contiguous_hidden():
    # Megatron's [S, B, H] layout, and a [B, S, H] view of it (not contiguous).
    hidden, weight, target, seed = _random_case((5, 3), 16, 29, torch.float32)
    _check(hidden, weight, target, seed, chunk_tokens=4, chunk_vocab=10)
    _check(hidden.transpose(0, 1), weight, target.transpose(0, 1), seed, chunk_tokens=4, chunk_vocab=10)


def test_only_one_input_needs_grad():
    hidden, weight, target, _ = _random_case((7,), 16, 21, torch.float32)
    ref_h = hidden.double().requires_grad_()
    ref_w = weight.double().requires_grad_()
    lp_ref, _ = linear_logprobs_reference(ref_h, ref_w, target)
    g = torch.randn(7)
    (lp_ref * g.double()).sum().backward()

    h = hidden.clone().requires_grad_()  # frozen output layer
    fused_linear_logprobs(h, weight, target, chunk_tokens=3, chunk_vocab=8).backward(g)
    _assert_sum_close(h.grad, ref_h.grad, torch.float32, "grad hidden, weight frozen")

    w = weight.clone().requires_grad_()  # hidden states that need no gradient
    fused_linear_logprobs(hidden, w, target, chunk_tokens=3, chunk_vocab=8).backward(g)
    _assert_sum_close(w.grad, ref_w.grad, torch.float32, "grad weight, hidden constant")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [None, 4])  # one token block; several (main_grad adds each)
def test_accumulate_into_main_grad(dtype, chunk_tokens):
    """Megatron's gradient-accumulation fusion: fp32 main_grad += grad, two micro-batches."""
    hidden, weight, target, seed = _random_case((11,), 16, 27, dtype)
    hidden2, _, target2, _ = _random_case((11,), 16, 27, dtype)
    g, g2 = torch.randn(11), torch.randn(11)
    ref_w = weight.double().requires_grad_()
    for hh, tt, gg in ((hidden, target, g), (hidden2, target2, g2)):
        lp_ref, _ = linear_logprobs_reference(hh, ref_w, tt, logits_dtype=dtype)
        (lp_ref * gg.double()).sum().backward()
    initial = torch.randn(weight.shape)

    w = torch.nn.Parameter(weight.clone())
    w.main_grad = initial.clone()
    w.grad_added_to_main_grad = False  # what Megatron's DDP sets on every parameter
    h = hidden.clone().requires_grad_()
    for hh, tt, gg in ((h, target, g), (hidden2, target2, g2)):
        fused_linear_logprobs(hh, w, tt, chunk_tokens=chunk_tokens, accumulate_into_main_grad=True).backward(gg)
    assert w.grad_added_to_main_grad is True
    assert w.grad is not None and w.grad.dtype == dtype and w.grad.eq(0).all(), "placeholder gradient must be zeros"
    assert w.main_grad.dtype == torch.float32
    _assert_sum_close(w.main_grad - initial, ref_w.grad, dtype, f"main_grad increment (seed {seed})")
    assert h.grad is not None

    # Without Megatron's DDP attribute nothing is returned for the weight (like Megatron's linear layer).
    w2 = torch.nn.Parameter(weight.clone())
    w2.main_grad = torch.zeros(weight.shape)
    fused_linear_logprobs(hidden, w2, target, accumulate_into_main_grad=True).backward(g)
    assert w2.grad is None and w2.main_grad.ne(0).any()


def test_empty_input():
    weight = torch.randn(10, 8, requires_grad=True)
    hidden = torch.randn(0, 8, requires_grad=True)
    lp, ent = fused_linear_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad.shape == (0, 8) and weight.grad.eq(0).all()


# ----------------------------------------------------------------------------- memory
def _allocations(fn) -> tuple[int, int]:
    """(peak of the bytes allocated and not yet freed, largest single allocation) while ``fn`` runs.

    Every allocation and free of the CPU allocator is a timestamped ``[memory]`` event of the
    profiler; the running sum starts at 0 (tensors alive before ``fn`` are not counted).
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = peak = largest = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
        largest = max(largest, nbytes)
    return peak, largest


def test_memory_bound():
    """Forward holds one [chunk_tokens, V] chunk and backward one [chunk_tokens, chunk_vocab] chunk,
    beside per-row vectors and the gradients — never the logits.

    fp32: CPU aten's bf16 GEMMs compute into an fp32 scratch of their own (cuBLAS does not), which would
    blur the budget here; test_cuda_memory_and_values checks bf16, with its fp32 accumulator, on a GPU.
    """
    n, hidden_size, vocab, rows, cols = 64, 16, 256, 8, 64
    hidden, weight, target, _ = _random_case((n,), hidden_size, vocab, torch.float32)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    full_logits = n * vocab * 4
    out = {}

    def forward():
        out["lp"] = fused_linear_logprobs(h, w, target, with_entropy=True, chunk_tokens=rows, chunk_vocab=cols)

    def backward():
        lp, ent = out.pop("lp")
        (lp.sum() + ent.sum()).backward()

    forward_peak, forward_largest = _allocations(forward)
    backward_peak, backward_largest = _allocations(backward)
    per_row = 64 * n  # statistics, merged outputs, targets, upstream gradients: a few words a row
    grad_weight, grads = vocab * hidden_size * 4, (n + vocab) * hidden_size * 4
    assert forward_largest == rows * vocab * 4, "the largest forward allocation is the one chunk"
    assert backward_largest == grad_weight, "the largest backward allocation is the weight gradient"
    assert forward_peak <= rows * vocab * 4 + per_row, (forward_peak, full_logits)
    assert backward_peak <= grads + rows * cols * 4 + per_row, (backward_peak, full_logits)
    assert max(forward_peak, backward_peak - grads) < full_logits / 4


def test_default_plan_fits_budget_at_benchmark_size():
    """N = 16384, H = 4096, V = 151936 (TP = 1) and its TP = 8 shard: extra memory ≤ 1.5 GiB."""
    n, hidden_size = 16384, 4096
    for v_local in (151936, 18992):
        plan = plan_chunks(n, hidden_size, v_local, torch.bfloat16)
        forward_chunk = plan.forward_rows * v_local * 2
        backward_chunk = plan.backward_rows * plan.backward_cols * 2
        accumulator = plan.backward_rows * hidden_size * 4
        assert forward_chunk <= LOGITS_CHUNK_BYTES and backward_chunk <= LOGITS_CHUNK_BYTES
        assert accumulator <= GRAD_HIDDEN_BLOCK_BYTES
        assert plan.backward_rows == n, "one token block: the weight gradient is written once, not accumulated"
        assert max(forward_chunk, backward_chunk + accumulator) <= 1.5 * 2**30
        assert forward_chunk <= n * v_local * 2 / 2, "the chunks must be a real fraction of the logits"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_memory_and_values():
    """On a GPU: the fp32-accumulating cuBLAS path against the reference, and the allocator's peak."""
    n, hidden_size, vocab, rows, cols = 4096, 1024, 32768, 512, 4096
    hidden, weight, target, seed = _random_case((n,), hidden_size, vocab, torch.bfloat16)
    hidden, weight, target = hidden.cuda(), weight.cuda(), target.cuda()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    g = torch.randn(n, device="cuda")

    def fwd_bwd():
        h.grad = w.grad = None
        out = fused_linear_logprobs(h, w, target, chunk_tokens=rows, chunk_vocab=cols)
        out.backward(g)
        return out

    lp = fwd_bwd()  # warm-up: cuBLAS allocates its workspace once, on first use
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # inputs and the gradients, which the next call frees and re-allocates
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    chunks = max(rows * vocab * 2, rows * cols * 2 + rows * hidden_size * 4)
    assert extra <= chunks + 64 * n + 2**20, (extra, chunks)

    ref_h, ref_w = hidden.double().requires_grad_(), weight.double().requires_grad_()  # float64, on the GPU
    lp_ref, _ = linear_logprobs_reference(ref_h, ref_w, target, logits_dtype=torch.bfloat16)
    (lp_ref * g.double()).sum().backward()
    # cuBLAS rounds its fp32 accumulator to the bf16 logits; the reference rounds the exact product. A
    # logit near a rounding boundary can land one bf16 ulp apart, so values are compared at bf16 tolerance.
    assert_close(lp, lp_ref, torch.bfloat16, f"logprobs (seed {seed})")
    _assert_sum_close(h.grad, ref_h.grad, torch.bfloat16, f"grad hidden (seed {seed})")
    _assert_sum_close(w.grad, ref_w.grad, torch.bfloat16, f"grad weight (seed {seed})")

    w.main_grad = torch.zeros(weight.shape, device="cuda")  # fp32 main_grad through out_dtype GEMMs
    fused_linear_logprobs(hidden, w, target, chunk_tokens=rows, accumulate_into_main_grad=True).backward(g)
    _assert_sum_close(w.main_grad, ref_w.grad, torch.bfloat16, f"main_grad (seed {seed})")


# ----------------------------------------------------------------------------- bad input
def test_bad_input_errors():
    hidden, weight, target, _ = _random_case((4,), 8, 10, torch.float32, ignore_frac=0.0)
    with pytest.raises(ValueError, match="weight shape \\(10, 8\\).*hidden's last dimension is 6"):
        fused_linear_logprobs(hidden[:, :6], weight, target)
    with pytest.raises(ValueError, match="weight must be a 2-D"):
        fused_linear_logprobs(hidden, weight[0], target)
    with pytest.raises(TypeError, match="weight dtype torch.bfloat16 must equal hidden dtype torch.float32"):
        fused_linear_logprobs(hidden, weight.bfloat16(), target)
    with pytest.raises(TypeError, match="hidden must be a float32"):
        fused_linear_logprobs(hidden.long(), weight, target)
    with pytest.raises(TypeError, match="weight must be a float32"):
        fused_linear_logprobs(hidden, weight.double(), target)
    with pytest.raises(ValueError, match="target shape \\(3,\\) must equal hidden.shape\\[:-1\\]"):
        fused_linear_logprobs(hidden, weight, target[:3])
    with pytest.raises(TypeError, match="target must be an int64"):
        fused_linear_logprobs(hidden, weight, target.float())
    with pytest.raises(ValueError, match="target.*outside \\[0, 10\\)"):
        fused_linear_logprobs(hidden, weight, torch.tensor([0, 1, 10, 2]))
    lp = fused_linear_logprobs(hidden, weight, torch.tensor([0, 1, 10, 2]), check_inputs=False)
    assert lp[2].isnan() and lp[[0, 1, 3]].isfinite().all(), "an unchecked bad target must be NaN, not wrong"
    for name in ("chunk_tokens", "chunk_vocab"):
        for bad in (0, -3, 2.5, True):
            with pytest.raises(ValueError, match=name):
                fused_linear_logprobs(hidden, weight, target, **{name: bad})
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_logprobs(hidden, weight, target, temperature=0.0)
    with pytest.raises(ValueError, match="needs weight.main_grad"):
        fused_linear_logprobs(hidden, weight, target, accumulate_into_main_grad=True)
    w = torch.nn.Parameter(weight.clone())
    w.main_grad = torch.zeros(10, 7)
    with pytest.raises(ValueError, match="main_grad must match weight's shape"):
        fused_linear_logprobs(hidden, w, target, accumulate_into_main_grad=True)
    w.main_grad = torch.zeros(10, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="main_grad must be float32"):
        fused_linear_logprobs(hidden, w, target, accumulate_into_main_grad=True)
