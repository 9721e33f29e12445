"""The deferred error ledger (mp_grpo/ops/checks.py): bad input is a named error, at once on CPU, at the
next sync point (``mp_grpo.check_errors``, ``reduce_metrics``) without a host read on a GPU.

The GPU side (no synchronization in a Megatron step) is tests/gpu/test_megatron_no_sync.py."""

from __future__ import annotations

import pytest
import torch

import mp_grpo
from mp_grpo.loss.metrics import reduce_metrics
from mp_grpo.ops.checks import deferred_checks


def _bad_target():
    logits = torch.randn(3, 8)
    target = torch.tensor([1, 9, -100])  # 9 is outside [0, 8)
    return logits, target


def test_bad_token_id_is_a_named_error_at_once_on_cpu() -> None:
    logits, target = _bad_target()
    with pytest.raises(ValueError, match=r"target has 1 token id\(s\) outside \[0, 8\)"):
        mp_grpo.vocab_parallel_logprobs(logits, target)
    mp_grpo.check_errors()  # nothing left pending


def test_deferred_error_is_raised_at_the_next_check() -> None:
    logits, target = _bad_target()
    with deferred_checks():
        out = mp_grpo.vocab_parallel_logprobs(logits, target)  # no host read: the error waits
        assert torch.isnan(out[1]) and not torch.isnan(out[0])
        mp_grpo.vocab_parallel_logprobs(logits, target)  # counts accumulate
        with pytest.raises(ValueError, match=r"target has 2 token id\(s\)") as info:
            mp_grpo.check_errors()
        assert "check_errors" in str(info.value)
        mp_grpo.check_errors()  # cleared once raised
        # reduce_metrics is a sync point a step already has: it raises pending errors too
        mp_grpo.vocab_parallel_logprobs(logits, target)
        with pytest.raises(ValueError, match="target has 1"):
            reduce_metrics([{"x/mean": torch.tensor([1.0, 1.0], dtype=torch.float64)}])
    good = mp_grpo.vocab_parallel_logprobs(logits, torch.tensor([1, 2, -100]))
    assert torch.isfinite(good).all()


def test_check_inputs_is_an_enum_with_a_sync_mode() -> None:
    logits, target = _bad_target()
    with deferred_checks():  # as on a GPU: DEFERRED waits, SYNC raises at the call, OFF records nothing
        with pytest.raises(ValueError, match=r"target has 1 token id\(s\)"):
            mp_grpo.vocab_parallel_logprobs(logits, target, check_inputs=mp_grpo.CheckInputs.SYNC)
        mp_grpo.check_errors()  # SYNC left nothing pending
        out = mp_grpo.vocab_parallel_logprobs(logits, target, check_inputs=mp_grpo.CheckInputs.OFF)
        assert torch.isnan(out[1])
        mp_grpo.check_errors()  # OFF recorded nothing
        mp_grpo.vocab_parallel_logprobs(logits, target, check_inputs=mp_grpo.CheckInputs.DEFERRED)
        with pytest.raises(ValueError, match="target has 1"):
            mp_grpo.check_errors()
    with pytest.raises(TypeError, match="check_inputs must be a bool or one of CheckInputs"):
        mp_grpo.vocab_parallel_logprobs(logits, target, check_inputs="sync")


def test_counts_added_after_a_check_are_seen_by_the_next_one() -> None:
    """A captured graph keeps adding into the same counter after check_errors() read it: the counter vector is
    zeroed in place, never replaced, so every later record (a graph replay) is seen."""
    from mp_grpo.ops import checks

    logits, target = _bad_target()
    with deferred_checks():
        mp_grpo.vocab_parallel_logprobs(logits, target)
        counter = checks._counters[logits.device]
        with pytest.raises(ValueError):
            mp_grpo.check_errors()
        assert checks._counters[logits.device] is counter and int(counter.sum()) == 0
        mp_grpo.vocab_parallel_logprobs(logits, target)
        assert checks._counters[logits.device] is counter and int(counter.sum()) == 1
        with pytest.raises(ValueError, match="target has 1"):
            mp_grpo.check_errors()
