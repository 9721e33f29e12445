"""A pytest plugin that replays the GPU profile's draws on the CPU (docs/testing.md, "Soaking").

    MP_GRPO_HYPOTHESIS_PROFILE=gpu MP_GRPO_PROPERTY_DEVICE=cpu python -m pytest -p tests.gpu_draws NODE
    MP_GRPO_REPLAY_BLOB=<blob> ... (the same, one falsifying example alone)

The property tests draw GPU-sized steps when ``tests.hypothesis_profiles.on_gpu()`` is true; this plugin makes it
true before the test modules import it, so the same seeds draw the same examples as on a GPU while the kernels run
under Triton's interpreter. With ``MP_GRPO_REPLAY_BLOB`` (the argument of a JSON's ``@reproduce_failure('<version>',
b'<blob>')``) every collected hypothesis test replays that example; hypothesis must be the version the JSON records
(``host.hypothesis``), given as ``MP_GRPO_REPLAY_VERSION`` (default: the installed one). An example that now
passes ends in hypothesis' ``DidNotReproduce`` ("completed successfully"); one now rejected by an ``assume``, in
``DidNotReproduce`` naming the assumption."""

from __future__ import annotations

import os

import hypothesis

import tests.hypothesis_profiles as profiles

profiles.on_gpu = lambda: True


def pytest_collection_modifyitems(items) -> None:
    blob = os.environ.get("MP_GRPO_REPLAY_BLOB")
    if not blob:
        return
    version = os.environ.get("MP_GRPO_REPLAY_VERSION", hypothesis.__version__)
    for item in items:
        test = getattr(item, "obj", None)
        if test is not None and hasattr(test, "hypothesis"):  # what @reproduce_failure sets, on the wrapped test
            test._hypothesis_internal_use_reproduce_failure = (version, blob.encode())
