"""How many examples the property tests ran, as hypothesis reports them (its observability callbacks).

With ``MP_GRPO_PROPERTY_STATS=<directory>`` set, every process that loads the hypothesis profiles
(tests/conftest.py, the torchrun workers of the CP properties — rank 0 only: the ranks draw the same examples)
writes ``<directory>/<pid>.json`` after each test case: per property, the test cases hypothesis ran outside its
shrink and explain phases by status (``passed``, ``failed``, ``gave_up`` — an ``assume`` rejected the draw), the
passing ones by the labels the test gave with ``hypothesis.event(name, value)`` (``backend=torch``,
``compute=float64``, …), and each failure's falsifying example as hypothesis reports it (its representation,
notes and ``@reproduce_failure`` decorator). The file is rewritten after every test case, so a run that is killed
(the soak driver's time limit) keeps what it counted. scripts/soak_properties.py sums the files. Observability's
line coverage is switched off (it traced every line: several times slower; also
``HYPOTHESIS_EXPERIMENTAL_OBSERVABILITY_NOCOVER``, which the soak driver sets for hypothesis releases that read it
at import).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

ENV = "MP_GRPO_PROPERTY_STATS"
COUNTED_PHASES = ("explicit", "reuse", "generate", "target")
"""Phases whose test cases count as examples run (shrinking and explaining re-run variants of a failure)."""
MAX_FAILURES_KEPT = 5
"""Falsifying examples kept per property (the first ones; the count covers all)."""
MAX_TEXT = 4000
"""Characters kept of a failure's representation and notes."""

_installed = False


def _field(observation, name: str, default=None):
    """A field of an observation: an object in current hypothesis, a dict in older releases."""
    if isinstance(observation, dict):
        return observation.get(name, default)
    return getattr(observation, name, default)


def _phase(observation) -> str:
    metadata = _field(observation, "metadata") or {}
    phase = metadata.get("phase") if isinstance(metadata, dict) else getattr(metadata, "phase", None)
    if phase:
        return str(phase)
    how = str(_field(observation, "how_generated", ""))  # "during generate phase", "minimal failing test case"
    if how.startswith("during "):
        return how.removeprefix("during ").split(" phase")[0]
    return "explicit" if how == "explicit example" else "final" if "failing" in how else how


class _Recorder:
    """The counts of this process, written to ``path`` after every test case."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.properties: dict[str, dict] = {}
        self.started = time.time()

    def _entry(self, name: str) -> dict:
        if name not in self.properties:
            self.properties[name] = {"passed": 0, "failed": 0, "gave_up": 0, "by": defaultdict(int),
                                     "failures": []}
        return self.properties[name]

    def __call__(self, observation, *_thread) -> None:
        if _field(observation, "type") != "test_case":
            return
        entry = self._entry(str(_field(observation, "property", "?")))
        status = str(_field(observation, "status", "?"))
        phase = _phase(observation)
        if phase in COUNTED_PHASES:
            entry[status] = entry.get(status, 0) + 1
            if status == "passed":
                for label, value in (_field(observation, "features") or {}).items():
                    if isinstance(value, str) and value and "=" not in label and not label.startswith(
                            ("invalid because", "gave up", "Retried")):
                        entry["by"][f"{label}={value}"] += 1
        if status == "failed" and phase == "final" and len(entry["failures"]) < MAX_FAILURES_KEPT:
            metadata = _field(observation, "metadata") or {}
            get = metadata.get if isinstance(metadata, dict) else lambda k, d=None: getattr(metadata, k, d)
            entry["failures"].append({
                "representation": str(_field(observation, "representation", ""))[:MAX_TEXT],
                "reason": str(_field(observation, "status_reason", ""))[:MAX_TEXT],
                "notes": "\n".join(map(str, get("notes", None) or []))[:MAX_TEXT],
                "reproduce": get("reproduction_decorator", None),
            })
        self.write()

    def write(self) -> None:
        data = {"pid": os.getpid(), "started": self.started, "updated": time.time(),
                "properties": {k: dict(v, by=dict(v["by"])) for k, v in self.properties.items()}}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        tmp.replace(self.path)  # atomic: a reader never sees half a file


def install() -> None:
    """Count this process's test cases when ``MP_GRPO_PROPERTY_STATS`` names a directory (once per process)."""
    global _installed
    directory = os.environ.get(ENV)
    if _installed or not directory or os.environ.get("RANK", "0") != "0":
        return
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    recorder = _Recorder(path / f"{os.getpid()}.json")
    from hypothesis.internal import observability

    # Observability's line coverage (sys.settrace) made a test case several times slower; the counts need none.
    observability.OBSERVABILITY_COLLECT_COVERAGE = False
    if hasattr(observability, "add_observability_callback"):  # hypothesis ≥ 6.135
        observability.add_observability_callback(recorder, all_threads=True)
    else:
        observability.TESTCASE_CALLBACKS.append(recorder)
    # HYPOTHESIS_EXPERIMENTAL_OBSERVABILITY_NOCOVER (which the soak driver sets) also makes hypothesis write every test
    # case as JSON to .hypothesis/observed/ (~7 kB each): nobody reads them; only the variable that asks for them
    # keeps them.
    deliver = getattr(observability, "_deliver_to_file", None)
    if deliver is not None and "HYPOTHESIS_EXPERIMENTAL_OBSERVABILITY" not in os.environ:
        if hasattr(observability, "remove_observability_callback"):
            observability.remove_observability_callback(deliver)
        elif deliver in getattr(observability, "TESTCASE_CALLBACKS", []):
            observability.TESTCASE_CALLBACKS.remove(deliver)
    _installed = True
