"""Non-finite logits in the log-prob ops (mp_grpo/kernels/logprob_merge.py, logprob_backward.py), on one process.

A NaN, +inf or −inf logit is put at a trained row's target, at another column of a trained row, or in a row
whose target is ``ignore_index``. Each case checks: what the ledger counts (a NaN / +inf logit, or a row that is
−inf throughout, in a trained row: "non-finite logits"; a −inf logit is probability 0 and allowed), the outputs
(the row's log-prob / entropy NaN, or −inf for a −inf target; every other row equal to the float64 reference),
and the gradient under a random upstream gradient: finite everywhere — 0 in the bad row — and equal to the
reference elsewhere. For ``vocab_parallel_logprobs`` and the fused output-layer op (NaN hidden states).
"""

from __future__ import annotations

import pytest
import torch

import mp_grpo
from mp_grpo import fused_linear_logprobs, vocab_parallel_logprobs
from mp_grpo.ops.checks import deferred_checks
from tests.reference import logprobs_reference
from tests.tolerances import assert_close

ROWS, VOCAB = 9, 100
BAD_ROW = 4
IGNORED_ROW = 6


def _case(seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, VOCAB, generator=gen) * 3
    target = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    target[IGNORED_ROW] = -100
    return logits, target, torch.randn(ROWS, generator=gen), torch.randn(ROWS, generator=gen)


def _where(where: str, target: torch.Tensor) -> tuple[int, int]:
    """(row, column) of the bad logit."""
    if where == "target":
        return BAD_ROW, int(target[BAD_ROW])
    if where == "other column":
        return BAD_ROW, (int(target[BAD_ROW]) + 17) % VOCAB
    return IGNORED_ROW, 3


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("where", ["target", "other column", "ignored row"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "+inf", "-inf"])
def test_vocab_parallel_logprobs(value: float, where: str, with_entropy: bool) -> None:
    logits, target, g_lp, g_ent = _case(3)
    row, col = _where(where, target)
    logits[row, col] = value
    x = logits.clone().requires_grad_()
    mp_grpo.check_errors()
    with deferred_checks():
        out = vocab_parallel_logprobs(x, target, with_entropy=with_entropy)
        lp, ent = out if with_entropy else (out, None)
        loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if with_entropy else 0.0)
        loss.backward()
        counted = where != "ignored row" and value != float("-inf")
        if counted:
            with pytest.raises(ValueError, match=r"logits: 1 row\(s\) whose target is not ignore_index hold a NaN"):
                mp_grpo.check_errors()
        mp_grpo.check_errors()  # nothing (else) recorded

    # --- the gradient: finite everywhere, 0 in a row with non-finite statistics ---
    assert torch.isfinite(x.grad).all(), "a non-finite logit leaked into the gradient"
    broken = value != value or value == float("inf")  # NaN / +inf: the row's statistics are NaN
    others = torch.ones(ROWS, dtype=torch.bool)
    if broken:
        assert (x.grad[row] == 0).all()
        others[row] = False
        if row == BAD_ROW:
            assert torch.isnan(lp[row])
            if with_entropy:
                assert torch.isnan(ent[row])
    # --- every other row as the float64 reference (a -inf logit: probability 0, the reference's own value) ---
    ref_x = logits.double().requires_grad_()
    lp_ref, ent_ref = logprobs_reference(ref_x, target)
    keep = others.clone()
    if value == float("-inf") and where == "target":  # log-prob -inf, its gradient still finite: checked apart
        assert lp[row] == float("-inf")
        keep[row] = False
    assert_close(lp[keep], lp_ref[keep], torch.float32, "logprobs")
    ref_loss = (torch.where(keep, lp_ref, 0.0) * g_lp.double()).sum()
    if with_entropy:
        assert_close(ent[others], ent_ref[others], torch.float32, "entropy")
        ref_loss = ref_loss + (torch.where(others, ent_ref, 0.0) * g_ent.double()).sum()
    ref_loss.backward()
    grad_ref = torch.where(keep[:, None], torch.nan_to_num(ref_x.grad), 0.0)
    assert_close(x.grad[keep], grad_ref[keep], torch.float32, "grad logits")


def test_ignored_row_with_nan_logits_gives_no_nan_gradient() -> None:
    """A row not trained on (ignore_index) full of NaN: nothing counted, no NaN in the gradient (0 there)."""
    logits, target, g_lp, _ = _case(4)
    logits[IGNORED_ROW] = float("nan")
    x = logits.clone().requires_grad_()
    with deferred_checks():
        lp = vocab_parallel_logprobs(x, target)
        (lp * g_lp).sum().backward()
        mp_grpo.check_errors()
    assert lp[IGNORED_ROW] == 0 and torch.isfinite(x.grad).all() and (x.grad[IGNORED_ROW] == 0).all()


def test_fused_output_op_counts_rows_of_nan_hidden_states() -> None:
    """The fused output-layer op: a NaN hidden row makes its logits NaN — counted, its log-prob NaN, the hidden
    gradient finite (0 in that row: its logits' gradient is 0 and the weight finite). The weight gradient reads
    the NaN hidden row in its GEMM (0 · NaN), as every layer before it would: the error raised is the signal."""
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(ROWS, 16, generator=gen)
    weight = torch.randn(VOCAB, 16, generator=gen) * 0.3
    target = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    hidden[BAD_ROW, 2] = float("nan")
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with deferred_checks():
        lp = fused_linear_logprobs(h, w, target, chunk_tokens=4)
        (lp * torch.randn(ROWS, generator=gen)).sum().backward()
        with pytest.raises(ValueError, match=r"logits: 1 row\(s\)"):
            mp_grpo.check_errors()
    assert torch.isnan(lp[BAD_ROW]) and torch.isfinite(lp[torch.arange(ROWS) != BAD_ROW]).all()
    assert torch.isfinite(h.grad).all() and (h.grad[BAD_ROW] == 0).all()


@pytest.mark.parametrize("filt", [dict(top_k=5), dict(top_p=0.9), dict(top_k=50, top_p=0.95), dict(min_p=0.1)],
                         ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "+inf"])
def test_a_sampling_filter_does_not_hide_a_nonfinite_logit(filt: dict, value: float) -> None:
    """With a sampling filter the statistics come from the kept set, which a NaN outside it never enters (the GPU's
    max skips NaN): the row must still be reported, its log-prob NaN, its gradient 0, as without a filter. The
    target is the row's largest finite logit, kept by every filter."""
    from mp_grpo.ops import SamplingFilter
    from tests.reference import filtered_logprobs_reference

    logits, _, upstream, _ = _case(11)
    target = logits.argmax(-1)
    logits[BAD_ROW, (int(target[BAD_ROW]) + 17) % VOCAB] = value
    x = logits.clone().requires_grad_(True)
    with deferred_checks():
        lp = vocab_parallel_logprobs(x, target, sampling_filter=SamplingFilter(**filt))
        with pytest.raises(ValueError, match=r"logits: 1 row\(s\) .* NaN or \+inf logit"):
            mp_grpo.check_errors()
    (lp * upstream).sum().backward()
    assert bool(torch.isnan(lp[BAD_ROW])) and bool((x.grad[BAD_ROW] == 0).all())
    good = torch.arange(ROWS) != BAD_ROW
    ref, _ = filtered_logprobs_reference(logits[good].double(), target[good], **filt)
    assert_close(lp[good], ref, torch.float32, msg="other rows vs float64")
    assert bool(torch.isfinite(x.grad).all())
