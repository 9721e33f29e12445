"""Soak the property tests: many pytest runs of each property in parallel, each with its own seed, until every
suite has run its target number of examples (as hypothesis counts them) or the time is up; one JSON of the counts.

    python scripts/soak_properties.py run cp=2000 megatron-cp-tp=500 --time-limit 420 --cpus 8-63 \\
        --out OUT/soak_cpu.json
    python scripts/soak_properties.py run gpu --gpu 0 --cpus 8-39 --time-limit 420 --out OUT/properties_gpu.json
    python scripts/soak_properties.py report docs/benchmarks/properties_*.json --md docs/testing.md

Schedule of ``run``

1. Suites: presets (:data:`SUITES`; ``cpu`` and ``gpu`` name groups), each a pytest node, a hypothesis profile,
   environment variables, the cores one run takes (2 for the CP property's torchrun, 4 for CP×TP), and the event
   labels whose passing examples must each reach the target (``backend=torch``, ``compute=float64``, …; none: the
   total). ``NAME=N`` sets a suite's target (default ``--examples``).
2. A pool of cores (``--cpus``, default all this process may use): runs are started for the suite furthest from its
   target (the smallest fraction of it, each run going for it counted as ``--run-share``) as its cores come free,
   each pinned to its cores (``sched_setaffinity``), niced (``--nice``), ``OMP_NUM_THREADS=1``, with a seed of its
   own (drawn from ``--seed``; as ``--hypothesis-seed`` and ``MP_GRPO_CP_SEED``), a hypothesis storage directory of
   its own, and ``MP_GRPO_PROPERTY_STATS`` pointing at a directory of its own (tests/property_stats.py: hypothesis'
   count of the test cases it ran, by status and event label, rewritten after every test case). CPU suites see no
   GPU (``CUDA_VISIBLE_DEVICES=``: Triton's interpreter); GPU suites see one GPU of ``--gpu`` (a list: each run
   gets the one with the fewest GPU runs going). Before the first CPU run one
   small log-prob call under the interpreter (:data:`INTERPRETER_CHECK`): where it fails (Triton 3.6's interpreter
   with numpy >= 2.4 cannot take a loop bound, ``TypeError: only 0-dimensional arrays ...``) the CPU suites get no
   runs and are reported skipped with the error — not as failures of every example. A suite whose run skipped (no
   GPU) or that failed ``--max-failing-runs`` times gets no more runs.
3. At the time limit (or when a suite reaches its target) the runs still going are stopped (their process trees
   killed: torchrun's ranks run in sessions of their own); what they counted stays. A run that has failed is not
   stopped at its suite's target: it goes on until hypothesis reports its shrunk example (or the time limit).
4. The JSON: per suite, the examples hypothesis ran (passed, failed, rejected by ``assume``), the passing ones by
   label, the runs and their seeds, their CPU seconds (of every process of the run), and every failure: its seed,
   the command that reproduces it, hypothesis' falsifying example and the end of the run's output. A run that
   failed without a failing test case (an error outside hypothesis) counts as a failure too.

``merge`` sums soaks of the same suites (a soak continued in another process or on another machine) into one
JSON: counts, runs and failures added, each target checked against the sum; soaks of different code are refused.

``source`` prints the digest of this checkout's library and tests (the JSON keeps the one it ran: a GPU machine gets
the working tree without its history) and, given JSONs, says which of them soaked other code.

``report`` renders such JSONs as a markdown table; with ``--md FILE`` it replaces the part of FILE between
``<!-- soak-results:begin -->`` and ``<!-- soak-results:end -->``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("mp_grpo", "tests")
"""What a soak tests: the library and its tests. Their digest goes into the JSON, and ``merge`` sums only soaks of
the same digest (a soak of other code is not more examples of this code)."""
STATS_ENV = "MP_GRPO_PROPERTY_STATS"
OUTPUT_TAIL = 6000
"""Characters kept of a failed run's output."""
POLL_S = 1.0
KILL_GRACE_S = 5.0
BEGIN, END = "<!-- soak-results:begin -->", "<!-- soak-results:end -->"
INTERPRETER_CHECK = ("import torch; from mp_grpo import vocab_parallel_logprobs; "
                     "vocab_parallel_logprobs(torch.zeros(2, 3), torch.tensor([0, 1]))")
"""What the CPU suites' kernels need of Triton's interpreter: one log-prob call (stats, merge and their loops)."""


@dataclass(frozen=True)
class Suite:
    """One property and how to run it."""

    name: str
    node: str
    """The pytest node (file or file::test)."""
    profile: str
    labels: tuple[str, ...] = ()
    """Event labels whose passing examples must each reach the target (empty: all passing examples)."""
    cores: int = 1
    """Processes one run keeps busy (torchrun ranks)."""
    env: tuple[tuple[str, str], ...] = ()
    gpu: bool = False
    description: str = ""


def _gpu_suites() -> list[Suite]:
    suites = []
    for prop, what in (("single_call_matches_reference", "one call vs the float64 reference"),
                       ("split_matches_single_call", "micro-batch splits vs one call and the reference")):
        for backend in ("torch", "triton"):
            for compute in ("float32", "float64"):
                suites.append(Suite(
                    f"gpu:{prop.split('_')[0]}-{backend}:{compute}",
                    f"tests/loss/test_properties.py::test_{prop}_{backend}", "gpu", (f"compute={compute}",),
                    env=(("MP_GRPO_PROPERTY_COMPUTE", compute),), gpu=True,
                    description=f"GRPOLoss {what}, {backend} backend, {compute} compute, CUDA"))
    suites.append(Suite("gpu:on_logits", "tests/loss/test_properties.py::test_on_logits_matches_reference_and_the_two_ops",
                        "gpu", ("logits=float32", "logits=bfloat16"), gpu=True,
                        description="GRPOLoss.on_logits vs the float64 reference and the two ops, CUDA"))
    suites.append(Suite("gpu:logprob", "tests/ops/test_logprob_properties.py", "gpu",
                        ("logits=float32", "logits=bfloat16", "logits=float16"), gpu=True,
                        description="the log-prob op (and its sampling filter) vs float64, CUDA"))
    return suites


SUITES: dict[str, Suite] = {s.name: s for s in [
    Suite("cp", "tests/loss/test_properties_cp.py", "soak", ("backend=torch", "backend=triton"), cores=2,
          description="GRPOLoss under CP = 2 (torchrun, gloo) vs one call and the float64 reference"),
    Suite("megatron-cp-tp", "tests/megatron/test_properties_cp_tp.py", "soak", cores=4,
          description="MegatronGRPO under CP = 2 × TP = 2 (torchrun, gloo) vs one call and the float64 reference"),
    Suite("loss", "tests/loss/test_properties.py", "soak", ("compute=float32", "compute=float64"),
          description="the GRPOLoss properties on the CPU (Triton's interpreter)"),
    Suite("logprob", "tests/ops/test_logprob_properties.py", "soak",
          description="the log-prob op vs float64 on the CPU (Triton's interpreter)"),
    *_gpu_suites(),
]}
GROUPS = {"cpu": ["cp", "megatron-cp-tp"], "gpu": [s.name for s in SUITES.values() if s.gpu]}


# ----------------------------------------------------------------------------------------------- counting
def read_stats(directory: Path) -> dict:
    """The counts of one run: the per-process files of tests/property_stats.py summed over processes and
    properties."""
    total = {"passed": 0, "failed": 0, "gave_up": 0, "by": {}, "failures": [], "properties": []}
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):  # written atomically; a partial read cannot happen, but be safe
            continue
        for name, entry in data.get("properties", {}).items():
            if name not in total["properties"]:
                total["properties"].append(name)
            for key in ("passed", "failed", "gave_up"):
                total[key] += int(entry.get(key, 0))
            for label, n in entry.get("by", {}).items():
                total["by"][label] = total["by"].get(label, 0) + int(n)
            total["failures"].extend(entry.get("failures", []))
    return total


def progress(suite: Suite, counts: dict, target: int) -> float:
    """The fraction of its target the suite has reached (the least-covered label's)."""
    if not suite.labels:
        return counts["passed"] / target
    return min(counts["by"].get(label, 0) for label in suite.labels) / target


# ----------------------------------------------------------------------------------------------- running
@dataclass
class Run:
    suite: Suite
    seed: int
    cores: list[int]
    stats: Path
    log: Path
    proc: subprocess.Popen
    started: float
    stopped: bool = False
    rc: int | None = None
    cpu_s: float | None = None
    ended: float | None = None
    gpu: str | None = None
    seen: dict[int, int] = field(default_factory=dict)
    """The run's processes seen so far: pid → start time (a rank whose torchrun died is no longer a descendant)."""


@dataclass
class Account:
    suite: Suite
    target: int
    runs: list[Run] = field(default_factory=list)
    skipped: str | None = None
    """Why the suite got no runs (the interpreter check failed)."""

    def active(self, max_failing_runs: int) -> bool:
        """Whether to start more runs: not when a run ended by itself without a test case (the test skipped, e.g.
        no GPU; or collected nothing), nor after ``max_failing_runs`` failing runs (an error each seed repeats)."""
        if self.skipped:
            return False
        ended = [r for r in self.runs if r.rc is not None and not r.stopped]
        if any(r.rc == 0 and read_stats(r.stats)["passed"] + read_stats(r.stats)["gave_up"] == 0 for r in ended):
            return False
        return sum(r.rc != 0 for r in ended) < max_failing_runs

    def counts(self) -> dict:
        out = {"passed": 0, "failed": 0, "gave_up": 0, "by": {}}
        for run in self.runs:
            c = read_stats(run.stats)
            for key in ("passed", "failed", "gave_up"):
                out[key] += c[key]
            for label, n in c["by"].items():
                out["by"][label] = out["by"].get(label, 0) + n
        return out


def parse_cpus(text: str | None) -> list[int]:
    """``0-3,8,10-11`` → [0, 1, 2, 3, 8, 10, 11]; None: the cores this process may run on."""
    if not text:
        return sorted(os.sched_getaffinity(0))
    cpus = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def reproduce_command(suite: Suite, seed: int) -> str:
    env = " ".join(f"{k}={v}" for k, v in suite.env)
    device = "" if suite.gpu else "CUDA_VISIBLE_DEVICES= "
    return (f"{device}{env + ' ' if env else ''}MP_GRPO_HYPOTHESIS_PROFILE={suite.profile} MP_GRPO_CP_SEED={seed} "
            f"python -m pytest {suite.node} -x -p no:cacheprovider --hypothesis-seed={seed}")


def interpreter_problem() -> str | None:
    """None when Triton's interpreter runs :data:`INTERPRETER_CHECK` in a CPU suite's environment (no GPU visible);
    else the error's last line, with the Triton and numpy versions."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", INTERPRETER_CHECK], env=env, cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=600)
    if out.returncode == 0:
        return None
    versions = subprocess.run([sys.executable, "-c", "import numpy, triton; print(f'triton {triton.__version__}, "
                               "numpy {numpy.__version__}')"], env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()] or [f"exit code {out.returncode}"]
    return f"{versions.stdout.strip() or 'versions unknown'}: {lines[-1].strip()}"


def pick_gpu(gpus: list[str], running: list[Run]) -> str:
    """The GPU of ``gpus`` with the fewest GPU runs going (the first of a tie)."""
    return min(gpus, key=lambda g: sum(r.gpu == g for r in running))


def start(suite: Suite, seed: int, cores: list[int], work: Path, args, gpu: str | None = None) -> Run:
    run_dir = Path(tempfile.mkdtemp(prefix=f"{suite.name.replace(':', '_')}-{seed}-", dir=work))
    env = dict(os.environ, MP_GRPO_HYPOTHESIS_PROFILE=args.profile or suite.profile, MP_GRPO_CP_SEED=str(seed),
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               HYPOTHESIS_EXPERIMENTAL_OBSERVABILITY_NOCOVER="1",
               HYPOTHESIS_STORAGE_DIRECTORY=str(run_dir / "hypothesis"), **{STATS_ENV: str(run_dir / "stats")},
               **dict(suite.env))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if suite.gpu:
        env["CUDA_VISIBLE_DEVICES"] = gpu if gpu is not None else str(args.gpu)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "pytest", suite.node, "-x", "-q", "-p", "no:cacheprovider",
           f"--hypothesis-seed={seed}"]
    log = run_dir / "output.log"

    def pin() -> None:
        os.sched_setaffinity(0, cores)
        os.nice(args.nice)

    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=pin, start_new_session=True)
    return Run(suite, seed, cores, run_dir / "stats", log, proc, time.time(), gpu=gpu if suite.gpu else None)


def reap(run: Run) -> bool:
    """Whether the run has ended (its exit status and CPU time recorded)."""
    try:
        pid, status, usage = os.wait4(run.proc.pid, os.WNOHANG)
    except ChildProcessError:
        return True
    if pid == 0:
        return False
    run.rc = os.waitstatus_to_exitcode(status)
    run.proc.returncode = run.rc
    run.cpu_s = usage.ru_utime + usage.ru_stime
    run.ended = time.time()
    return True


def _reap_stopped(run: Run) -> bool:
    """:func:`reap` for a stopped run, keeping the CPU time read before it was stopped."""
    cpu_s = run.cpu_s
    ended = run.rc is not None or reap(run)
    run.cpu_s = cpu_s if cpu_s is not None else run.cpu_s
    return ended


def _processes() -> dict[int, list[int]]:
    """Linux ``/proc``: pid → the fields of its ``stat`` after ``(comm)`` (state, ppid, …, utime, stime, cutime,
    cstime at 11–14, start time at 19)."""
    out = {}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(pid)] = [int(x) if x.lstrip("-").isdigit() else 0 for x in fields]
    return out


def _tree(root: int, procs: dict[int, list[int]]) -> list[int]:
    """``root`` and its live descendants (torchrun starts its workers in sessions of their own: a process group
    or session kill would miss them)."""
    children: dict[int, list[int]] = {}
    for pid, fields in procs.items():
        children.setdefault(fields[1], []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in procs:
            out.append(pid)
            todo.extend(children.get(pid, []))
    return out


def _tree_cpu_s(root: int) -> float | None:
    """CPU seconds of ``root``'s live process tree and of the children its processes reaped."""
    try:
        procs = _processes()
    except OSError:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(sum(procs[pid][11:15]) for pid in _tree(root, procs)) / ticks


def track(runs: list[Run]) -> None:
    """Note every live process of each run (pid and start time)."""
    try:
        procs = _processes()
    except OSError:
        return
    for run in runs:
        for pid in _tree(run.proc.pid, procs):
            run.seen.setdefault(pid, procs[pid][19])  # field 22 of stat: start time


def kill_leftovers(run: Run) -> None:
    """SIGKILL the processes the run had that still live (the same pid and start time): ranks left behind."""
    try:
        procs = _processes()
    except OSError:
        return
    for pid, started in run.seen.items():
        if pid != run.proc.pid and pid in procs and procs[pid][19] == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _signal_tree(root: int, sig: int) -> None:
    try:
        pids = _tree(root, _processes())
    except OSError:
        pids = [root]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop(runs: list[Run]) -> None:
    """Stop the runs still going (SIGTERM, then SIGKILL): their counts so far stay in their stats files; their CPU
    time is read from ``/proc`` first."""
    trees = {}
    for run in runs:
        run.stopped = True
        run.cpu_s = _tree_cpu_s(run.proc.pid) or None  # None: gone already, wait4 tells
        trees[run.proc.pid] = _tree(run.proc.pid, _processes())
        _signal_tree(run.proc.pid, signal.SIGTERM)
    deadline = time.time() + KILL_GRACE_S
    while time.time() < deadline and not all(_reap_stopped(r) for r in runs):
        time.sleep(0.2)
    for run in runs:  # what is left of each tree (torchrun ranks a killed torchrun no longer stops)
        for pid in trees[run.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        kill_leftovers(run)
        if run.rc is None:
            run.proc.wait()
            run.rc = run.proc.returncode
            run.ended = time.time()


def run_suites(args) -> dict:
    names = []
    targets = {}
    for item in args.suites:
        name, _, target = item.partition("=")
        for n in GROUPS.get(name, [name]):
            if n not in SUITES:
                raise SystemExit(f"unknown suite {n!r}; known: {', '.join(list(GROUPS) + list(SUITES))}")
            names.append(n)
            targets[n] = int(target) if target else args.examples
    accounts = {n: Account(SUITES[n], targets[n]) for n in dict.fromkeys(names)}
    if any(not a.suite.gpu for a in accounts.values()):
        problem = interpreter_problem()
        for account in accounts.values():
            if problem and not account.suite.gpu:
                account.skipped = f"interpreter check: {problem}\n(no run started)"
                print(f"{account.suite.name}: skipped, Triton's interpreter fails here ({problem})", flush=True)
    cpus = parse_cpus(args.cpus)
    biggest = max(a.suite.cores for a in accounts.values())
    if len(cpus) < biggest:
        raise SystemExit(f"--cpus gives {len(cpus)} cores; a run of this selection needs {biggest}")
    work = Path(args.work or tempfile.mkdtemp(prefix="soak-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    gpus = [g.strip() for g in str(args.gpu).split(",") if g.strip()]
    free = list(cpus)
    running: list[Run] = []
    began = time.time()
    deadline = began + args.time_limit
    print(f"soak: {', '.join(f'{n} (target {a.target})' for n, a in accounts.items())} on {len(set(cpus))} cores "
          f"({len(cpus)} processes), "
          f"{args.time_limit:.0f} s; work directory {work}", flush=True)
    last_print = 0.0
    source, changed = source_digest(), None
    while True:
        track(running)
        for run in [r for r in running if reap(r)]:
            kill_leftovers(run)
            running.remove(run)
            free.extend(run.cores)
        now = time.time()
        fractions = {n: progress(a.suite, a.counts(), a.target) for n, a in accounts.items()}
        if now - last_print > args.print_every:
            last_print = now
            print(f"[{now - began:5.0f} s] " + ", ".join(f"{n} {fractions[n]:.0%}" for n in accounts)
                  + f"; {len(running)} runs", flush=True)
        if now >= deadline:
            break
        # The code under test changed on disk (a checkout, a copy over the tree): runs started from now on would test
        # other code than those before. Stop, keeping what was counted, and say so.
        current = source_digest()
        if current != source:
            changed = {"after_s": round(now - began, 1), "files": source_changes(source, current)}
            print(f"[{now - began:5.0f} s] the code under test changed ({', '.join(changed['files'][:5])}): "
                  "stopping the soak", flush=True)
            break
        # A suite at its target: its runs stop (what they counted stays), their cores go to the others — except a run
        # that has failed, which goes on until hypothesis has shrunk and reported its failing example (or the time
        # limit): stopped, it would leave a failure count and no example.
        done = [r for r in running if fractions[r.suite.name] >= 1.0 and not read_stats(r.stats)["failed"]]
        if done:
            stop(done)
            for run in done:
                running.remove(run)
                free.extend(run.cores)
        pending = {n: f for n, f in fractions.items() if f < 1.0 and accounts[n].active(args.max_failing_runs)}
        if not pending and not any(read_stats(r.stats)["failed"] for r in running):
            break  # every target reached (or the suites stopped), no failing run still shrinking: the rest counted
        if not pending:  # failing runs still going: wait for their examples
            time.sleep(POLL_S)
            continue
        # Fill the free cores, each run for the suite furthest from its target (the runs going for it counted); when
        # that suite's run does not fit, wait for cores rather than give them to another (a 4-rank suite would
        # starve beside a 2-rank one).
        while not args.max_runs or len(running) < args.max_runs:
            n = min(pending, key=lambda n: pending[n] + args.run_share * sum(r.suite.name == n for r in running))
            suite = accounts[n].suite
            if suite.cores > len(free):
                break
            cores, free[:] = free[:suite.cores], free[suite.cores:]
            gpu = pick_gpu(gpus, running) if suite.gpu else None
            run = start(suite, rng.randrange(2**32), cores, work, args, gpu)
            accounts[n].runs.append(run)
            running.append(run)
        time.sleep(POLL_S)
    stop(running)
    return summarize(accounts, args, began, cpus, source, changed)


def _run_record(run: Run) -> dict:
    c = read_stats(run.stats)
    return {"seed": run.seed, "rc": run.rc, **({"gpu": run.gpu} if run.gpu is not None else {}), "stopped": run.stopped,  # by the driver: time limit or target reached
            "wall_s": round((run.ended or time.time()) - run.started, 1),
            "cpu_s": None if run.cpu_s is None else round(run.cpu_s, 1),
            "passed": c["passed"], "failed": c["failed"], "gave_up": c["gave_up"]}


def summarize(accounts: dict[str, Account], args, began: float, cpus: list[int], source: dict,
              changed: dict | None = None) -> dict:
    suites = {}
    for name, account in accounts.items():
        suite = account.suite
        counts = account.counts()
        failures = []
        for run in account.runs:
            c = read_stats(run.stats)
            failed_run = (run.rc not in (0, None) and not run.stopped) or c["failed"]
            if not failed_run:
                continue
            tail = run.log.read_text(errors="replace")[-OUTPUT_TAIL:] if run.log.exists() else ""
            failures.append({"seed": run.seed, "rc": run.rc, "reproduce": reproduce_command(suite, run.seed),
                             "falsifying": c["failures"], "output_tail": tail})
        ended = [r for r in account.runs if not r.stopped and r.cpu_s is not None]
        skipped = next((r for r in ended if r.rc == 0 and read_stats(r.stats)["passed"] == 0), None)
        skip_text = account.skipped or (None if skipped is None else
                                        skipped.log.read_text(errors="replace")[-400:].strip())
        cpu_s = sum(r.cpu_s for r in account.runs if r.cpu_s is not None)
        suites[name] = {
            "skipped": skip_text,
            "description": suite.description, "node": suite.node, "profile": args.profile or suite.profile,
            "device": "cuda" if suite.gpu else "cpu", "env": dict(suite.env), "labels": list(suite.labels),
            "target": account.target, "reached": progress(suite, counts, account.target) >= 1.0,
            "passed": counts["passed"], "failed": counts["failed"], "gave_up": counts["gave_up"],
            "by": dict(sorted(counts["by"].items())),
            "runs": [_run_record(r) for r in account.runs],
            "failing_runs": len(failures), "failures": failures,
            "cpu_s": round(cpu_s, 1),
            "cpu_s_per_example": round(cpu_s / max(counts["passed"] + counts["gave_up"], 1), 3),
        }
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "started": datetime.fromtimestamp(began, timezone.utc).isoformat(timespec="seconds"),
        "wall_s": round(time.time() - began, 1), "cores": len(set(cpus)), "slots": len(cpus),
        "host": _host(args.gpu if any(a.suite.gpu for a in accounts.values()) else None),
        "source": source,  # read when the soak began: every run of it imported this code
        **({"stopped_on_source_change": changed} if changed else {}),
        "suites": suites,
    }


def source_digest(root: Path = REPO_ROOT) -> dict:
    """The code a soak ran: for each of :data:`SOURCE_DIRS`, the SHA-256 (first 16 hex digits) of its Python files'
    paths and contents in path order, and under ``files`` each file's own (so that a later checkout can name what
    changed since: ``soak_properties.py source JSON``). A GPU machine gets the working tree without its git history, so
    a commit id could not be read there."""
    digest: dict = {}
    files: dict[str, str] = {}
    for name in SOURCE_DIRS:
        h = hashlib.sha256()
        for path in sorted((root / name).rglob("*.py")):
            rel, data = path.relative_to(root).as_posix(), path.read_bytes()
            h.update(rel.encode() + b"\0" + data + b"\0")
            files[rel] = hashlib.sha256(data).hexdigest()[:16]
        digest[name] = h.hexdigest()[:16]
    return {**digest, "files": files}


def source_changes(soaked: dict | None, here: dict) -> list[str]:
    """The files added, removed or changed between a soak's ``source`` and ``here`` (all of them when the soak kept
    none)."""
    if not soaked:
        return sorted(here["files"])
    before, after = soaked.get("files", {}), here["files"]
    return sorted(path for path in before.keys() | after.keys() if before.get(path) != after.get(path))


def _host(gpu: str | None) -> dict:
    """Versions and, for GPU suites, the GPU's name (from nvidia-smi: this process makes no CUDA context, which
    would land on GPU 0 beside whatever runs there)."""
    info = {"python": platform.python_version(), "machine": platform.machine(), "cpu_count": os.cpu_count()}
    try:
        import hypothesis
        import torch
        import triton

        info.update(torch=torch.__version__, triton=triton.__version__, hypothesis=hypothesis.__version__)
    except Exception as error:  # noqa: BLE001 — the versions are informative only
        info["versions"] = f"unavailable: {error}"
    if gpu is not None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i",
                                  str(gpu).split(",")[0]],
                                 capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and out.stdout.strip():
                info["gpu"] = out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return info


# ----------------------------------------------------------------------------------------------- merge
def merge(datas: list[dict]) -> dict:
    """One soak JSON from several of the same suites (in the order given): passed / failed / rejected counts and
    each label's count summed, runs and failures concatenated, each suite's target (the largest asked) checked
    against the sum; a suite in some of the JSONs only is taken as it is. Suites whose profiles or environments
    differ are refused (their examples are not the same draws)."""
    if not datas:
        raise ValueError("merge: no JSON given")
    for data in datas[1:]:
        if data.get("source") != datas[0].get("source"):
            changed = source_changes(datas[0].get("source"), data.get("source") or {"files": {}})
            raise ValueError(f"merge: the soaks ran different code ({', '.join(changed[:5]) or 'digests differ'}): "
                             "only soaks of the same library and tests add up")
    suites: dict[str, dict] = {}
    for data in datas:
        for name, s in data["suites"].items():
            if name not in suites:
                suites[name] = json.loads(json.dumps(s))
                continue
            m = suites[name]
            for key in ("node", "profile", "device", "env", "labels"):
                if m[key] != s[key]:
                    raise ValueError(f"merge: suite {name!r} has {key} {m[key]!r} in one JSON, {s[key]!r} in another")
            for key in ("passed", "failed", "gave_up", "failing_runs", "cpu_s"):
                m[key] = round(m[key] + s[key], 1) if key == "cpu_s" else m[key] + s[key]
            for label, n in s["by"].items():
                m["by"][label] = m["by"].get(label, 0) + n
            m["by"] = dict(sorted(m["by"].items()))
            m["runs"] += s["runs"]
            m["failures"] += s["failures"]
            m["target"] = max(m["target"], s["target"])
            m["skipped"] = m["skipped"] if m["skipped"] and s["skipped"] else None
    for m in suites.values():
        counts = {"passed": m["passed"], "by": m["by"]}
        m["reached"] = progress(Suite(m.get("name", ""), m["node"], m["profile"], tuple(m["labels"])), counts,
                                m["target"]) >= 1.0
        m["cpu_s_per_example"] = round(m["cpu_s"] / max(m["passed"] + m["gave_up"], 1), 3)
    first = datas[0]
    return {
        "command": " + ".join(d["command"] for d in datas),
        "started": first["started"], "wall_s": round(sum(d["wall_s"] for d in datas), 1),
        "cores": max(d["cores"] for d in datas), "slots": max(d["slots"] for d in datas),
        "host": first["host"], "source": first.get("source"), "merged_from": len(datas),
        "suites": suites,
    }


# ----------------------------------------------------------------------------------------------- report
def _fmt_by(suite: dict) -> str:
    labels = suite["labels"] or sorted(suite["by"])
    return ", ".join(f"{label} {suite['by'].get(label, 0)}" for label in labels)


def report(paths: list[Path]) -> str:
    """A markdown table of the soak JSONs ``paths``: one row per suite."""
    lines = ["| suite | what | device, profile | examples passed | by label | failed | rejected (`assume`) | "
             "runs (seeds) | wall | file |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        data = json.loads(Path(path).read_text())
        host = data.get("host", {})
        cores = data.get("cores", "?")
        for name, s in data["suites"].items():
            where = f"{host['gpu']}, " if host.get("gpu") and s["device"] == "cuda" else ""
            where += f"{cores} CPU core{'' if cores == 1 else 's'}"
            status = "" if s["reached"] else f" (target {s['target']} not reached)"
            if s.get("skipped"):
                status = " (skipped: " + s["skipped"].splitlines()[-2].split(": ", 1)[-1][:80] + ")"
            failed = f"**{s['failed']}** in {s['failing_runs']} runs" if s["failing_runs"] else str(s["failed"])
            lines.append(
                f"| `{name}` | {s['description']} | {s['device']} ({where}), `{s['profile']}` | {s['passed']}{status} | "
                f"{_fmt_by(s)} | {failed} | {s['gave_up']} | {len(s['runs'])} | {data['wall_s']:.0f} s | "
                f"`{Path(path).name}` |")
    return "\n".join(lines) + "\n"


def write_between_markers(md: Path, table: str) -> None:
    text = md.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{md} has no {BEGIN} … {END} section")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    md.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="soak suites in parallel")
    r.add_argument("suites", nargs="+", help=f"NAME or NAME=TARGET; names: {', '.join(list(GROUPS) + list(SUITES))}")
    r.add_argument("--examples", type=int, default=2000, help="default target per label (or in all)")
    r.add_argument("--time-limit", type=float, default=420.0, help="seconds; runs still going are stopped")
    r.add_argument("--cpus", help="cores to use, e.g. 8-63 (default: all this process may use); a core listed "
                                  "twice takes two processes (0-1,0-1: four on two cores)")
    r.add_argument("--gpu", default="0",
                   help="the GPU suites' GPUs, e.g. 0,1: each run sees one (CUDA_VISIBLE_DEVICES), the least busy")
    r.add_argument("--nice", type=int, default=10)
    r.add_argument("--profile", help="override the suites' hypothesis profiles")
    r.add_argument("--seed", type=int, help="seed of the runs' seeds (default: random)")
    r.add_argument("--max-runs", type=int, default=0, help="most runs at once (0: as the cores allow)")
    r.add_argument("--run-share", type=float, default=0.1,
                   help="fraction of a target one run going is counted as (spreads the cores over the suites)")
    r.add_argument("--max-failing-runs", type=int, default=3, help="runs of a suite that may fail before it stops")
    r.add_argument("--print-every", type=float, default=30.0)
    r.add_argument("--work", help="directory of the runs' logs and counts (default: a new temporary one)")
    r.add_argument("--out", type=Path, required=True, help="the JSON to write")
    g = sub.add_parser("merge", help="sum soak JSONs of the same suites into one")
    g.add_argument("json", nargs="+", type=Path)
    g.add_argument("--out", type=Path, required=True, help="the JSON to write")
    p = sub.add_parser("report", help="a markdown table of soak JSONs")
    p.add_argument("json", nargs="+", type=Path)
    p.add_argument("--md", type=Path, help="replace the table between the soak-results markers of this file")
    c = sub.add_parser("source", help="this checkout's source digest; with JSONs: whether they soaked this code")
    c.add_argument("json", nargs="*", type=Path)
    args = parser.parse_args(argv)
    if args.command == "source":
        here = source_digest()
        print(json.dumps({name: here[name] for name in SOURCE_DIRS}))
        stale = 0
        for path in args.json:
            changed = source_changes(json.loads(path.read_text()).get("source"), here)
            stale += bool(changed)
            print(f"{path}: " + (f"{len(changed)} files differ from this checkout: {', '.join(changed[:20])}"
                                 f"{' …' if len(changed) > 20 else ''}" if changed else "soaked this code"))
        return 1 if stale else 0
    if args.command == "merge":
        merged = merge([json.loads(path.read_text()) for path in args.json])
        args.out.write_text(json.dumps(merged, indent=1) + "\n")
        for name, s in merged["suites"].items():
            print(f"{name}: {s['passed']} passed ({_fmt_by(s)}), {s['failed']} failed in {s['failing_runs']} runs"
                  f"{'' if s['reached'] else ' — target not reached'}")
        return 0
    if args.command == "report":
        table = report(args.json)
        if args.md:
            write_between_markers(args.md, table)
        print(table, end="")
        return 0
    result = run_suites(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    bad = {n: s["failing_runs"] for n, s in result["suites"].items() if s["failing_runs"]}
    for name, s in result["suites"].items():
        print(f"{name}: {s['passed']} passed ({_fmt_by(s)}), {s['failed']} failed, {s['gave_up']} rejected, "
              f"{len(s['runs'])} runs{'' if s['reached'] else ' — target not reached'}")
    print(f"wrote {args.out}" + (f"; FAILURES in {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
