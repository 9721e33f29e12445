"""Property-based test of the log-prob op (``vocab_parallel_logprobs``, TP = 1) against the float64 reference.

Drawn: the rows' leading shape (``[N]`` or ``[A, B]``), the vocabulary size, the logits' dtype (fp32 / bf16 / fp16),
scale and shape (Gaussian, one peaked token, flat rows of ties), the temperature, ignored rows, entropy or not,
``inplace_backward``, and a sampling filter (top-k / top-p / min-p, per call or per row) with targets drawn from
its kept set as a rollout engine samples them; in a second property a captured support per row instead (empty, one
id, half or all of the vocabulary). Log-probs, entropy and the logits' gradient under a random upstream
gradient must equal the float64 reference (``tests/reference.py``) within the float32 rounding of the kernels:
``eps32`` times the row's logit range (what a log-prob or an entropy of those logits is accurate to), plus the
output dtype's relative tolerance (tests/tolerances.py).

On the CPU the kernels run under Triton's interpreter (blocks of 8–64 columns: rows up to 300 columns span
them); on CUDA (``MP_GRPO_PROPERTY_DEVICE=cuda`` or the ``gpu`` profile) the compiled kernels, with vocabularies
up to 70001 columns (the 4096-column blocks and, past 2**16, the long-row launch configuration; the filter's
candidate path and its exact fallback). A draw whose kept set sits within float32 rounding of a filter's threshold
(a knife edge either side may take) is rejected with ``assume``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, event, given, note, settings
from hypothesis import strategies as st

from mp_grpo import CapturedSupport, check_errors, vocab_parallel_logprobs
from mp_grpo.kernels.launch_config import INTERPRETER
from mp_grpo.ops import SamplingFilter
from tests.hypothesis_profiles import examples, needs_property_device, on_gpu, property_device
from tests.reference import filtered_logprobs_reference, sampling_filter_keep_reference, support_keep_reference
from tests.tolerances import tolerance

EPS32 = torch.finfo(torch.float32).eps
ROUNDING = 8.0
"""Multiples of eps32 the kernel's float32 arithmetic may be off by, times the row's logit range."""
KNIFE_EDGE = 1e-4
"""A filter's threshold closer than this (relative: log space for min-p, probability mass for top-p) to a token is
a knife edge; such draws are rejected."""
WIDE_VOCABS = (4095, 4096, 4097, 8193, 65536, 65537, 70001)
"""Vocabulary sizes at the GPU kernels' block and launch-configuration boundaries."""


@st.composite
def _filters(draw, vocab: int, rows_shape: tuple[int, ...]) -> dict:
    """A sampling filter's fields (scalars, or per-row tensors of ``rows_shape``), possibly empty."""
    out: dict = {}
    per_row = draw(st.booleans())
    n = math.prod(rows_shape)
    for name, values in (("top_k", [1, 2, 5, 50, vocab - 1, vocab, vocab + 1]),
                         ("top_p", [0.1, 0.5, 0.9, 0.99, 1.0]),
                         ("min_p", [0.0, 0.01, 0.1, 0.5])):
        if not draw(st.booleans()):
            continue
        if per_row:
            if name == "top_k":
                values = values + [0, -1]  # off for that row (vLLM)
            row_values = draw(st.lists(st.sampled_from(values), min_size=n, max_size=n))
            dtype = torch.int64 if name == "top_k" else torch.float32
            out[name] = torch.tensor(row_values, dtype=dtype).reshape(rows_shape)
        else:
            value = draw(st.sampled_from(values))
            out[name] = max(value, 1) if name == "top_k" else value
    return out


def _knife_edge(logits: torch.Tensor, filt: dict, temperature: float) -> bool:
    """Whether a token sits within float32 rounding of a filter threshold (float64, the reference's order of
    min-p, top-k, top-p)."""
    z = logits.double().reshape(-1, logits.shape[-1]) / temperature
    rows, vocab = z.shape
    z_max = z.max(dim=-1, keepdim=True).values
    scale = z.abs() + z_max.abs() + 1.0

    def per_row(value, dtype):
        return value.reshape(-1).to(dtype) if isinstance(value, torch.Tensor) else torch.full((rows,), value, dtype=dtype)

    if "min_p" in filt:
        mp = per_row(filt["min_p"], torch.float64)
        on = (mp > 0).unsqueeze(1)
        gap = (z - z_max) - torch.log(mp.clamp_min(1e-300)).unsqueeze(1)
        if bool((on & (gap.abs() <= KNIFE_EDGE * scale)).any()):
            return True
    if "top_p" in filt:
        keep = sampling_filter_keep_reference(logits, temperature=temperature,
                                              **{k: v for k, v in filt.items() if k != "top_p"})
        p = per_row(filt["top_p"], torch.float64)
        zk = torch.where(keep.reshape(rows, vocab), z, torch.tensor(float("-inf"), dtype=torch.float64))
        prob = torch.softmax(zk, dim=-1)
        # the mass strictly above each token (a tie group: one value), through the sort as the reference finds it
        ascending = zk.sort(dim=-1).values
        n_larger = vocab - torch.searchsorted(ascending, zk, right=True)
        desc = prob.gather(1, zk.sort(dim=-1, descending=True).indices)
        before = torch.cat([torch.zeros(rows, 1, dtype=torch.float64), desc.cumsum(-1)], dim=-1)
        above = before.gather(1, n_larger)
        on = (p < 1).unsqueeze(1) & torch.isfinite(zk)
        if bool((on & ((above - p.unsqueeze(1)).abs() <= KNIFE_EDGE)).any()):
            return True
    return False


def _close(got: torch.Tensor, want: torch.Tensor, atol: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """|got − want| ≤ rtol(dtype) · |want| + atol, elementwise; both finite (or both −inf)."""
    g, w = got.detach().double().cpu(), want.detach().double()
    same_inf = torch.isneginf(g) & torch.isneginf(w)
    assert bool((torch.isfinite(g) | same_inf).all()), f"{what}: non-finite values {g[~torch.isfinite(g)]}"
    err = torch.where(same_inf, 0.0, (g - w).abs())
    allowed = tolerance(dtype)["rtol"] * torch.where(same_inf, 0.0, w.abs()) + atol
    if not bool((err <= allowed).all()):
        i = int(torch.argmax(err - allowed))
        raise AssertionError(f"{what}: differs at flat index {i}: {g.reshape(-1)[i].item()!r} vs "
                             f"{w.reshape(-1)[i].item()!r} (allowed {allowed.reshape(-1)[i].item():.3g})")


def _grad_atol(z: torch.Tensor, keep: torch.Tensor, target: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor | None,
               row_range: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """The logits gradient's absolute tolerance, ``[..., V]``. ∂/∂logits = (1 / T) ∂/∂z: a row's gradient is
    g_lp · (onehot − p) + g_ent · ∂H/∂z, over T. The kernel's p_j is exp of its log p_j, which is off by what a
    log-prob is off by (ROUNDING · eps32 · row_range, the log-prob check): p_j carries that relative error, so
    g_lp · (onehot − p_j) carries it times g_lp · p_j; plus the rounding of the product itself. The logits' own
    magnitude does not enter: the kernels form (x − M) / T, never x / T − M / T
    (``test_large_logits_at_a_low_temperature_are_exact_to_their_range``)."""
    p = torch.softmax(torch.where(keep, z, torch.tensor(float("-inf"), dtype=torch.float64)), dim=-1)
    lp_weight = (g_lp.abs() * (target != -100)).unsqueeze(-1) * (1.0 + p * row_range.unsqueeze(-1))
    ent_weight = torch.zeros_like(g_lp) if g_ent is None else g_ent.abs() * row_range
    return ROUNDING * EPS32 * (lp_weight + ent_weight.unsqueeze(-1)) / temperature + torch.finfo(dtype).tiny


def _row_range(z: torch.Tensor) -> torch.Tensor:
    """What a row's float32 log-probs are accurate to, in units of eps32: its logit range (of z = logits / T) + 1."""
    return (z.amax(-1) - z.amin(-1)) + 1.0


@needs_property_device()
@settings(max_examples=examples(1.0))
@given(data=st.data())
def test_logprobs_match_float64_reference(data) -> None:
    device = property_device()
    gpu = on_gpu()
    two_d = data.draw(st.booleans())
    if gpu:
        vocab = data.draw(st.one_of(st.integers(2, 300), st.integers(301, 10000), st.sampled_from(WIDE_VOCABS)))
        most_rows = 64 if vocab <= 10000 else 8
    else:
        vocab = data.draw(st.integers(2, 300))
        most_rows = 8
    rows_shape = (data.draw(st.integers(1, most_rows // 2)), data.draw(st.integers(1, 2))) if two_d else \
        (data.draw(st.integers(1, most_rows)),)
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    scale = data.draw(st.sampled_from([0.1, 1.0, 5.0, 30.0]))
    kind = data.draw(st.sampled_from(["gaussian", "gaussian", "peaked", "ties"]))
    temperature = data.draw(st.sampled_from([1.0, 1.0, 0.7, 2.0, 0.3]))
    with_entropy = data.draw(st.booleans())
    inplace = data.draw(st.booleans())
    filt = data.draw(_filters(vocab, rows_shape)) if data.draw(st.booleans()) else {}
    seed = data.draw(st.integers(0, 2**32 - 1))
    note(f"rows {rows_shape}, vocab {vocab}, {dtype}, scale {scale} {kind}, temperature {temperature}, "
         f"entropy {with_entropy}, inplace {inplace}, filter {filt}, seed {seed}")
    event("logits", str(dtype).removeprefix("torch."))
    event("filter", "on" if filt else "off")

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(*rows_shape, vocab, generator=gen, dtype=torch.float64) * scale
    if kind == "peaked":  # one token far above the rest
        top = torch.randint(0, vocab, rows_shape, generator=gen)
        logits.scatter_add_(-1, top.unsqueeze(-1), torch.full((*rows_shape, 1), 20.0 * scale, dtype=torch.float64))
    elif kind == "ties":  # a few distinct values: tie groups at every threshold
        logits = torch.randint(0, 3, logits.shape, generator=gen).double() * scale
    logits = logits.to(dtype)
    assume(not (filt and _knife_edge(logits, filt, temperature)))
    keep = sampling_filter_keep_reference(logits, temperature=temperature, **filt) if filt else \
        torch.ones(logits.shape, dtype=torch.bool)
    target = torch.multinomial(keep.reshape(-1, vocab).double(), 1, generator=gen).reshape(rows_shape)
    ignored = torch.rand(rows_shape, generator=gen) < data.draw(st.sampled_from([0.0, 0.3, 1.0]))
    target = torch.where(ignored, -100, target)

    # --- the op, on the property device ---
    x = logits.detach().clone().to(device).requires_grad_()
    sampling_filter = SamplingFilter(**{k: v.to(device) if isinstance(v, torch.Tensor) else v
                                        for k, v in filt.items()}) if filt else None
    out = vocab_parallel_logprobs(x if not inplace else x.clone(), target.to(device), temperature=temperature,
                                  with_entropy=with_entropy, inplace_backward=inplace, sampling_filter=sampling_filter)
    lp, ent = out if with_entropy else (out, None)
    g_lp = torch.randn(rows_shape, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(rows_shape, generator=gen, dtype=torch.float64)
    total = (lp.double() * g_lp.to(device)).sum()
    if with_entropy:
        total = total + (ent.double() * g_ent.to(device)).sum()
    total.backward()
    # --- the float64 reference ---
    r = logits.double().requires_grad_()
    lp_r, ent_r = filtered_logprobs_reference(r, target, temperature=temperature, keep=keep)
    total_r = (lp_r * g_lp).sum() + ((ent_r * g_ent).sum() if with_entropy else 0.0)
    total_r.backward()
    # --- within the kernels' float32 rounding of each row's logit range ---
    z = logits.double() / temperature
    row_range = _row_range(z)
    assert lp.dtype == torch.float32 and lp.shape == target.shape
    _close(lp, lp_r, ROUNDING * EPS32 * row_range, torch.float32, "log-probs")
    if with_entropy:
        _close(ent, ent_r, ROUNDING * EPS32 * row_range, torch.float32, "entropy")
    grad_atol = _grad_atol(z, keep, target, g_lp, g_ent if with_entropy else None, row_range, temperature, dtype)
    assert x.grad.dtype == dtype and x.grad.shape == logits.shape
    _close(x.grad, r.grad, grad_atol, dtype, "d/dlogits")
    check_errors()  # on a GPU the op's input checks are deferred to here: every target is valid


@pytest.mark.skipif(not INTERPRETER, reason="CPU tensors (Triton's interpreter); on a GPU the property above draws "
                    "large logits (the GPU profile)")
def test_large_logits_at_a_low_temperature_are_exact_to_their_range() -> None:
    """Two logits ~60 apart from nothing, at T = 0.3 (|z| ~ 200, p ≈ ½ each): within the tolerance of the rows'
    logit range. The kernels formed x / T − M / T before: each term rounded at |z|, ~eps32 · |z| · g · p / T off,
    9× this tolerance (and the GPU soak's on_logits failure through a KL term,
    ``tests/loss/test_property_regressions.py``)."""
    logits = torch.tensor([[61.7, 61.45], [33.1, 32.98]])
    target = torch.tensor([1, 0])
    x = logits.clone().requires_grad_()
    g_lp = torch.tensor([1.0, -0.7], dtype=torch.float64)
    lp = vocab_parallel_logprobs(x, target, temperature=0.3)
    (lp.double() * g_lp).sum().backward()
    r = logits.double().requires_grad_()
    keep = torch.ones(logits.shape, dtype=torch.bool)
    lp_r, _ = filtered_logprobs_reference(r, target, temperature=0.3, keep=keep)
    (lp_r * g_lp).sum().backward()
    z = logits.double() / 0.3
    row_range = _row_range(z)
    _close(lp, lp_r, ROUNDING * EPS32 * row_range, torch.float32, "log-probs")
    atol = _grad_atol(z, keep, target, g_lp, None, row_range, 0.3, torch.float32)
    err = (x.grad.double() - r.grad).abs()
    assert bool((err <= atol).all()), (err, atol)


@st.composite
def _supports(draw, vocab: int, rows: int, gen: torch.Generator) -> CapturedSupport:
    """A captured support per row: empty (the whole vocabulary), one id, or a random set of 2 … V ids, increasing."""
    lists = []
    for _ in range(rows):
        size = draw(st.sampled_from([0, 1, 2, vocab // 2, vocab]))
        lists.append(sorted(torch.randperm(vocab, generator=gen)[:max(size, 0)].tolist()))
    return CapturedSupport.from_lists(lists)


@needs_property_device()
@settings(max_examples=examples(0.5))
@given(data=st.data())
def test_logprobs_over_a_captured_support_match_float64_reference(data) -> None:
    """The property above with a captured support instead of a filter (``captured_support=``): each row's log-prob,
    entropy and logits gradient of its distribution renormalized over its support (rows without one: the whole
    vocabulary), targets drawn from the support, within the same float32 rounding."""
    device = property_device()
    vocab = data.draw(st.integers(2, 300) if not on_gpu() else st.one_of(st.integers(2, 300),
                                                                         st.sampled_from(WIDE_VOCABS)))
    rows_shape = (data.draw(st.integers(1, 8)),)
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    scale = data.draw(st.sampled_from([0.1, 1.0, 5.0, 30.0]))
    temperature = data.draw(st.sampled_from([1.0, 0.7, 2.0, 0.3]))
    with_entropy = data.draw(st.booleans())
    inplace = data.draw(st.booleans())
    seed = data.draw(st.integers(0, 2**32 - 1))
    gen = torch.Generator().manual_seed(seed)
    support = data.draw(_supports(vocab, rows_shape[0], gen))
    note(f"rows {rows_shape}, vocab {vocab}, {dtype}, scale {scale}, temperature {temperature}, "
         f"entropy {with_entropy}, inplace {inplace}, support sizes {support.indptr.diff().tolist()}, seed {seed}")
    logits = (torch.randn(*rows_shape, vocab, generator=gen, dtype=torch.float64) * scale).to(dtype)
    keep = support_keep_reference(support.indptr, support.ids, logits.shape)
    target = torch.multinomial(keep.double(), 1, generator=gen).reshape(rows_shape)
    target = torch.where(torch.rand(rows_shape, generator=gen) < 0.2, -100, target)

    x = logits.detach().clone().to(device).requires_grad_()
    out = vocab_parallel_logprobs(x if not inplace else x.clone(), target.to(device), temperature=temperature,
                                  with_entropy=with_entropy, inplace_backward=inplace,
                                  captured_support=support.to(device))
    lp, ent = out if with_entropy else (out, None)
    g_lp = torch.randn(rows_shape, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(rows_shape, generator=gen, dtype=torch.float64)
    total = (lp.double() * g_lp.to(device)).sum() + ((ent.double() * g_ent.to(device)).sum() if with_entropy else 0.0)
    total.backward()
    r = logits.double().requires_grad_()
    lp_r, ent_r = filtered_logprobs_reference(r, target, temperature=temperature, keep=keep)
    ((lp_r * g_lp).sum() + ((ent_r * g_ent).sum() if with_entropy else 0.0)).backward()
    z = logits.double() / temperature
    row_range = _row_range(z)
    _close(lp, lp_r, ROUNDING * EPS32 * row_range, torch.float32, "log-probs")
    if with_entropy:
        _close(ent, ent_r, ROUNDING * EPS32 * row_range, torch.float32, "entropy")
    grad_atol = _grad_atol(z, keep, target, g_lp, g_ent if with_entropy else None, row_range, temperature, dtype)
    _close(x.grad, r.grad, grad_atol, dtype, "d/dlogits")
    assert bool((x.grad.cpu()[~keep] == 0).all()), "a gradient outside the support"
    check_errors()
