"""A tiny property for tests/scripts/test_soak_properties.py to soak: integers, an event label, a rejected draw,
and (with ``MP_GRPO_SOAK_DUMMY_FAIL=1``) a failure, slow with ``MP_GRPO_SOAK_DUMMY_SLOW=1``. Not collected by the suite (no ``test_`` file prefix); the soak
driver names the file."""

from __future__ import annotations

import os
import time

from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from tests.hypothesis_profiles import examples


_FAILURES: list[int] = []


@settings(max_examples=examples(1.0))
@given(x=st.integers(0, 9))
def test_dummy(x: int) -> None:
    event("parity", "even" if x % 2 == 0 else "odd")
    assume(x != 3)
    if os.environ.get("MP_GRPO_SOAK_DUMMY_FAIL"):
        if x >= 5 and os.environ.get("MP_GRPO_SOAK_DUMMY_SLOW"):
            _FAILURES.append(x)
            if len(_FAILURES) > 1:
                time.sleep(1.0)  # the first failure reported at once, shrinking then lasts seconds
        assert x < 5, f"x = {x}"
