"""Diagnostic: the log-prob op's one collective at the floor — where its cost under tensor parallelism comes from.

    torchrun --nproc_per_node TP scripts/bench_tp_collective.py --out DIR        (TP = 2, 4; writes
        tp_collective_tp<TP>.{json,md} and redraws tp_collective.png from every tp_collective_tp*.json in DIR)
    torchrun --nproc_per_node 2 scripts/bench_tp_collective.py --dry-run --out /tmp/x   (CPU, gloo: a check only)
    python scripts/bench_tp_collective.py --report A/tp_collective_tp2.json ... --out DIR  (the reports from JSON)

The question. ``vocab_parallel_logprobs`` on this rank's shard (N = 16384, V = 151936 or 18992 split over TP
ranks, bf16, with entropy) against the same kernel on the same shard without its collective (``tp_group=None``,
targets folded into the shard): an independent harness measured TP = 4 forward +8.6 % and forward+backward
+17 %, though backward has no collective. This script separates the candidate causes in one run, each variant
beside its no-collective twin timed the same way: every variant of a mode and part timed in ``--iters``
interleaved rounds (``measure.interleaved_ms``: each round calls every variant once, the order reversed every
other round), a variant's time the slowest rank's median (every rank's kept), its figure against its twin the
median over the rounds of the per-round ratio of the slowest ranks' times, with a distribution-free 95 % interval
(``measure.ratio_to``):

Timing modes (how an iteration starts):
  eager          the harness's loop: one barrier, then back-to-back calls, each synchronized at its end. A rank
                 that finished its last call early waits in the next all-gather for the others; the host's time to
                 issue a call is inside the timed window.
  eager_barrier  as eager with ``torch.cuda.synchronize(); dist.barrier()`` before every call: the skew
                 carried over from the previous call removed (candidate: rank skew).
  host_ahead     every call starts with a one-element all-reduce (the GPUs aligned) and a ``--sleep-ms``
                 spin kernel, behind which the host issues the whole call: the GPU never waits for the host
                 (candidate: host-bound launches, e.g. the NCCL call's host path before the backward launch).
  graph          the call captured in a CUDA graph (NCCL inside) and replayed, aligned as host_ahead
                 (candidate: eager launch vs capture of the whole forward+backward; also checks that the op,
                 collective included, is capturable — with the default input checks too).

Variants (forward, and forward + backward with a fixed upstream gradient):
  op local / op tp                 the op itself without and with its group (``check_inputs=False``)
  op tp, checked                   the op with the default input checks (deferred: no host read)
  manual local / manual tp         the op's kernels called one by one (``mp_grpo.ops.logprob_launch``: statistics,
                                   all-gather, merge, backward; no autograd), with a CUDA event after each: the
                                   phases per rank, and the GPU idle between them (candidate: the merge; which
                                   phase grows)
  manual tp, no NCCL               the gathered tensor made by a local copy: the TP merge (TP rows a token) without
                                   the collective (candidate: the merge kernel)
  manual tp, preallocated          every buffer allocated once (candidate: the caching allocator; the cudaMalloc
                                   calls and allocator retries of each variant's timed loop are counted too)
  manual tp, 1-CTA NCCL            the all-gather on a communicator limited to one CTA (candidate: the NCCL
                                   kernel's SMs taken from the next kernel)
  manual tp, pipelined xK          the statistics in K row chunks, each chunk's all-gather issued at once
                                   (``async_op=True``) behind the next chunk's statistics: only the last chunk's
                                   gather exposed — a candidate schedule for the op, measured here before any
                                   library change
The op's eager forward+backward also records events at the end of its forward and at the start of its backward
(a tensor hook): the GPU idle between them is the host's lateness.

Rank skew: the host clock (CLOCK_MONOTONIC, shared by the processes of one machine) at each iteration's start,
gathered: the spread over ranks per iteration.

The predictions (``PREDICTIONS``) were written before the first run; the report prints them beside the
measurements. ``--dry-run`` runs every variant once on the CPU (gloo, Triton's interpreter, tiny sizes, host
clock, graph mode and the 1-CTA group skipped): a check of the script, never a measurement (its report says so).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure  # noqa: E402
from mp_grpo import CheckInputs, vocab_parallel_logprobs  # noqa: E402
from mp_grpo.ops.checks import kernel_counters, merge_error_kinds  # noqa: E402
from mp_grpo.ops.logprob_launch import logprob_backward, merge_statistics, new_stats_buffer, shard_statistics  # noqa: E402

TARGET = 1.05
"""The issue's target: the op within 5 % of the same kernel without its collective."""
LOGIT_SCALE = 3.0
"""Logits ~ N(0, 3²), as bench_logprob.py draws them."""
IGNORE_INDEX = -100
MODES = ("eager", "eager_barrier", "host_ahead", "graph")
PARTS = ("fwd", "fwd_bwd")
DRY_TOKENS, DRY_VOCAB = 8, 64

# (TP, V, part, mode) -> predicted time of "op tp" / "op local"; written before the first run.
# Reasoning: on an H100 (~3 TB/s) the statistics kernel reads the shard once (V = 151936: 0.83 ms at TP = 2,
# 0.42 ms at TP = 4; V = 18992: 0.10 / 0.05 ms), the backward reads it and writes its gradient (2x that); the
# all-gather of [N + 1, 4] fp32 (256 KB a rank) costs ~15-25 µs on NVLink and the merge a few µs more for TP
# rows a token. Eager, the host issues the forward (argument checks, statistics launch, NCCL's host path, merge),
# then autograd and the backward launch: ~0.3-0.5 ms of host work. At TP = 4, V = 151936 that is about the GPU's
# forward (0.43 ms), so the backward kernel waits for the host — longer with the NCCL call on the host's path —
# which the forward alone (its end event issued right after the merge) does not show: hypothesis H1, the host.
# Rank skew (H2), the merge (H3), the allocator (H4) and NCCL's SMs (H5) are predicted to move nothing measurable.
PREDICTIONS = {
    (2, 151936, "fwd", "eager"): 1.03, (2, 151936, "fwd_bwd", "eager"): 1.01,
    (2, 151936, "fwd", "host_ahead"): 1.03, (2, 151936, "fwd_bwd", "host_ahead"): 1.01,
    (2, 151936, "fwd", "graph"): 1.03, (2, 151936, "fwd_bwd", "graph"): 1.01,
    (4, 151936, "fwd", "eager"): 1.08, (4, 151936, "fwd_bwd", "eager"): 1.15,
    (4, 151936, "fwd", "eager_barrier"): 1.08, (4, 151936, "fwd_bwd", "eager_barrier"): 1.15,
    (4, 151936, "fwd", "host_ahead"): 1.05, (4, 151936, "fwd_bwd", "host_ahead"): 1.02,
    (4, 151936, "fwd", "graph"): 1.05, (4, 151936, "fwd_bwd", "graph"): 1.02,
    (2, 18992, "fwd", "eager"): 1.3, (2, 18992, "fwd_bwd", "eager"): 1.2,
    (2, 18992, "fwd", "host_ahead"): 1.15, (2, 18992, "fwd_bwd", "host_ahead"): 1.05,
    (2, 18992, "fwd", "graph"): 1.15, (2, 18992, "fwd_bwd", "graph"): 1.05,
    (4, 18992, "fwd", "eager"): 1.4, (4, 18992, "fwd_bwd", "eager"): 1.3,
    (4, 18992, "fwd", "host_ahead"): 1.35, (4, 18992, "fwd_bwd", "host_ahead"): 1.12,
    (4, 18992, "fwd", "graph"): 1.35, (4, 18992, "fwd_bwd", "graph"): 1.12,
}
PREDICTION_NOTES = [
    "H1 (the host): in eager forward+backward at TP = 4, V = 151936 the GPU idles ~0.1-0.25 ms between the end of "
    "the op's forward and the start of its backward (its events), against ~0 for the op without its group; with "
    "the host ahead of the GPU (host_ahead, graph) the TP op is within 5 % of its twin in forward+backward.",
    "H2 (rank skew): eager_barrier within ±2 % of eager; the host clocks' spread at iteration start is tens of µs.",
    "H3 (the merge): 'manual tp, no NCCL' within 1 % of 'manual local' (TP rows a token in a few-µs kernel).",
    "H4 (the allocator): 'manual tp, preallocated' within 1 % of 'manual tp'; no cudaMalloc in any timed loop.",
    "H5 (NCCL's SMs): '1-CTA NCCL' within 1 % of 'manual tp' (nothing runs beside the all-gather: every next kernel "
    "depends on it).",
    "Pipelined ×4 (host_ahead, forward): V = 151936 at TP = 4 from ~1.05 to ~1.03 (one chunk's gather exposed); no "
    "gain at V = 18992, where each gather's latency, not its bytes, sets its cost.",
    "Not reachable by any schedule here: the forward at V = 18992 (a 50-110 µs kernel against a ≥ 10 µs collective "
    "latency): predicted 1.15 (TP = 2) and 1.35 (TP = 4) in GPU time.",
]


# ------------------------------------------------------------------------------------------------ clocks
class HostEvent:
    """``--dry-run``'s stand-in for a CUDA event: the host clock at ``record``."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.t - self.t) * 1e3


class Device:
    """CUDA (the measurement) or the CPU (``--dry-run``: host clock, no graphs, no spin kernel)."""

    def __init__(self, dry: bool) -> None:
        self.dry = dry
        self.name = "cpu" if dry else "cuda"
        self.cycles_per_ms = None

    def event(self):
        return HostEvent() if self.dry else torch.cuda.Event(enable_timing=True)

    def sync(self) -> None:
        if not self.dry:
            torch.cuda.synchronize()

    def sleep(self, ms: float) -> None:
        """Keep the GPU busy for ``ms`` (the spin kernel) so that the host gets ahead of it."""
        if self.dry or ms <= 0:
            return
        if self.cycles_per_ms is None:  # calibrate once: the spin kernel's cycles per ms on this GPU
            start, end = self.event(), self.event()
            start.record()
            torch.cuda._sleep(1_000_000)
            end.record()
            end.synchronize()
            self.cycles_per_ms = 1_000_000 / max(start.elapsed_time(end), 1e-3)
        torch.cuda._sleep(int(ms * self.cycles_per_ms))

    def memory_counts(self) -> tuple[int, int]:
        """(cudaMalloc calls so far, allocator retries so far)."""
        if self.dry:
            return 0, 0
        stats = torch.cuda.memory_stats()
        return stats.get("segment.all.allocated", 0), stats.get("num_alloc_retries", 0)


class Marks:
    """Events recorded inside one call (``mark(name)``), with the host clock at each."""

    def __init__(self, device: Device | None) -> None:
        self.device = device
        self.events: list[tuple[str, object, float]] = []

    def __call__(self, name: str) -> None:
        if self.device is None:
            return
        event = self.device.event()
        event.record()
        self.events.append((name, event, time.perf_counter()))


NO_MARKS = Marks(None)


# ------------------------------------------------------------------------------------------------ timing
def timed(fns: dict, mode: str, *, device: Device, group, iters: int, warmup: int, sleep_ms: float) -> dict[str, dict]:
    """Per-call times of every ``fns[name](mark)`` on this rank under ``mode`` (module docstring), in ``iters``
    interleaved rounds (``measure.interleaved_ms``); per function: its times, the phases between its marks (GPU ms
    since the call's start, host ms since the call's start; medians), its calls' host start times (CLOCK_MONOTONIC)
    and the allocator's counts over its calls."""
    one = torch.ones(1, device=device.name)
    for _ in range(warmup):
        for fn in fns.values():
            fn(NO_MARKS)
    device.sync()
    dist.barrier(group=group)
    seen = {name: {"starts": [], "phases": [], "cuda_mallocs": 0, "alloc_retries": 0} for name in fns}

    def align() -> None:
        if mode == "eager_barrier":
            device.sync()
            dist.barrier(group=group)
        elif mode in ("host_ahead", "graph"):
            dist.all_reduce(one, group=group)
            device.sleep(sleep_ms)

    def one_call(name: str, fn):
        def call() -> float:
            mallocs0, retries0 = device.memory_counts()
            marks = Marks(device if mode != "graph" else None)
            start, end = device.event(), device.event()
            seen[name]["starts"].append(time.monotonic())
            host0 = time.perf_counter()
            start.record()
            fn(marks)
            end.record()
            end.synchronize()
            mallocs1, retries1 = device.memory_counts()
            seen[name]["cuda_mallocs"] += mallocs1 - mallocs0
            seen[name]["alloc_retries"] += retries1 - retries0
            seen[name]["phases"].append({n: (start.elapsed_time(ev), (host - host0) * 1e3) for n, ev, host in marks.events})
            return start.elapsed_time(end)

        return call

    times = measure.interleaved_ms({name: one_call(name, fn) for name, fn in fns.items()}, iters, warmup=0,
                                   timer=lambda call: call(), before_each=align)
    out = {}
    for name, record in seen.items():
        phases = record.pop("phases")
        names = list(phases[0]) if phases else []
        out[name] = {"ms": statistics.median(times[name]), "times": times[name], **record,
                     "phases": {n: [statistics.median(p[n][0] for p in phases), statistics.median(p[n][1] for p in phases)]
                                for n in names}}
    return out


def graphed(fn, device: Device):
    """``fn`` captured in a CUDA graph after a warm-up on a side stream (every rank captures together); the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(NO_MARKS)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(NO_MARKS)
    return graph


# ------------------------------------------------------------------------------------------------ variants
class Shard:
    """This rank's inputs: a [N, V_local] bf16 shard of one full logits tensor (the same on every rank), the
    global targets, the targets folded into the shard (for the no-collective twin), the upstream gradients."""

    def __init__(self, n: int, v: int, rank: int, tp: int, device: Device) -> None:
        gen = torch.Generator(device=device.name).manual_seed(0)
        self.v_local = v // tp
        full = torch.randn(n, v, device=device.name, generator=gen)
        self.x = (full[:, rank * self.v_local:(rank + 1) * self.v_local] * LOGIT_SCALE).to(torch.bfloat16).contiguous()
        del full
        self.x.requires_grad_()
        self.t = torch.randint(0, self.v_local * tp, (n,), device=device.name, generator=gen)
        self.t_local = self.t % self.v_local
        self.g = torch.randn(n, device=device.name, generator=gen)
        self.vocab_start = rank * self.v_local
        self.n = n


def op_variant(s: Shard, group, check: CheckInputs):
    """The op (autograd); its forward+backward marks the end of forward and (a hook) the start of backward."""
    target = s.t if group is not None else s.t_local

    def call():
        return vocab_parallel_logprobs(s.x, target, tp_group=group, with_entropy=True, check_inputs=check)

    def fwd(mark):
        with torch.no_grad():
            call()

    def fwd_bwd(mark):
        s.x.grad = None
        lp, _ = call()
        mark("forward")
        if mark is not NO_MARKS:
            lp.register_hook(lambda grad: mark("backward starts"))
        lp.backward(s.g)
        mark("backward")

    return fwd, fwd_bwd


def manual_variant(s: Shard, group, tp: int, *, collective: str, prealloc: bool = False, chunks: int = 1):
    """The op's kernels one by one (no autograd): statistics, the gather (``collective``: "nccl", "copy" — a local
    copy into the [TP, N + 1, 4] layout —, or "none": TP = 1), the merge, the backward kernel; a mark after each."""
    n = s.n
    local = collective == "none"
    target = s.t_local if local else s.t
    vocab_start = 0 if local else s.vocab_start
    ranks = 1 if local else tp
    errors, _ = kernel_counters(merge_error_kinds(v_global=ranks * s.v_local, ignore_index=IGNORE_INDEX,
                                                  gathered_stats=torch.empty(0)), s.x.device, CheckInputs.OFF)
    fixed = {}
    if prealloc:
        fixed["stats"] = new_stats_buffer(n, s.x.device)
        fixed["gathered"] = torch.empty(ranks * (n + 1), 4, device=s.x.device)
        fixed["grad"] = torch.empty_like(s.x)
    bounds = [round(i * n / chunks) for i in range(chunks + 1)]

    def statistics_and_gather(mark):
        x = s.x.detach()
        if chunks == 1:
            stats = fixed["stats"] if prealloc else new_stats_buffer(n, x.device)
            shard_statistics(x, target, stats, vocab_start=vocab_start, inv_temperature=1.0, with_entropy=True)
            mark("statistics")
            if collective == "none":
                return stats.unsqueeze(0)
            out = fixed["gathered"] if prealloc else torch.empty(ranks * (n + 1), 4, device=x.device)
            if collective == "copy":
                out.view(ranks, n + 1, 4).copy_(stats.unsqueeze(0).expand(ranks, n + 1, 4))
            else:
                dist.all_gather_into_tensor(out, stats, group=group)
            mark("gather")
            return out.view(ranks, n + 1, 4)
        # pipelined: each chunk's gather behind the next chunk's statistics (async NCCL), joined before the merge
        outs, works = [], []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            stats = new_stats_buffer(hi - lo, x.device)
            shard_statistics(x[lo:hi], target[lo:hi], stats, vocab_start=vocab_start, inv_temperature=1.0,
                             with_entropy=True)
            out = torch.empty(ranks * (hi - lo + 1), 4, device=x.device)
            works.append(dist.all_gather_into_tensor(out, stats, group=group, async_op=True))
            outs.append(out.view(ranks, hi - lo + 1, 4))
        mark("statistics")
        for work in works:
            work.wait()
        gathered = torch.cat([o[:, :-1] for o in outs] + [outs[-1][:, -1:]], dim=1)
        mark("gather")
        return gathered

    def forward(mark):
        gathered = statistics_and_gather(mark)
        merged = merge_statistics(gathered, target, v_local=s.v_local, ignore_index=IGNORE_INDEX, inv_temperature=1.0,
                                  with_entropy=True, errors=errors)
        mark("merge")
        return merged

    def fwd(mark):
        forward(mark)

    def fwd_bwd(mark):
        merged = forward(mark)
        grad = fixed["grad"] if prealloc else torch.empty_like(s.x)
        logprob_backward(s.x.detach(), grad, target, merged.row_max, merged.log_sum, merged.complement, None, None,
                         s.g, None, vocab_start=vocab_start, ignore_index=IGNORE_INDEX, inv_temperature=1.0)
        mark("backward")
        return grad

    return fwd, fwd_bwd


def one_cta_group(tp: int):
    """A communicator of the same ranks limited to one CTA (None, and why, where this torch / NCCL cannot)."""
    try:
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.max_ctas = 1
        opts.config.min_ctas = 1
        return dist.new_group(ranks=list(range(tp)), backend="nccl", pg_options=opts), None
    except Exception as err:  # reported, not hidden
        return None, repr(err)[:200]


def variants(s: Shard, group, tp: int, *, chunks: int, cta_group) -> dict:
    """name -> (builder of (fwd, fwd_bwd), the modes it runs in, its no-collective twin)."""
    out = {
        "op local": (lambda: op_variant(s, None, CheckInputs.OFF), MODES, None),
        "op tp": (lambda: op_variant(s, group, CheckInputs.OFF), MODES, "op local"),
        "op tp, checked (default)": (lambda: op_variant(s, group, CheckInputs.DEFERRED), ("eager", "graph"), "op local"),
        "manual local": (lambda: manual_variant(s, None, tp, collective="none"), ("eager", "host_ahead"), None),
        "manual tp": (lambda: manual_variant(s, group, tp, collective="nccl"), ("eager", "host_ahead"), "manual local"),
        "manual tp, no NCCL": (lambda: manual_variant(s, group, tp, collective="copy"), ("eager", "host_ahead"),
                               "manual local"),
        "manual tp, preallocated": (lambda: manual_variant(s, group, tp, collective="nccl", prealloc=True),
                                    ("eager", "host_ahead"), "manual local"),
        f"manual tp, pipelined x{chunks}": (lambda: manual_variant(s, group, tp, collective="nccl", chunks=chunks),
                                            ("eager", "host_ahead"), "manual local"),
    }
    if cta_group is not None:
        out["manual tp, 1-CTA NCCL"] = (lambda: manual_variant(s, cta_group, tp, collective="nccl"),
                                        ("eager", "host_ahead"), "manual local")
    return out


# ------------------------------------------------------------------------------------------------ run
def manual_matches_op(s: Shard, group, tp: int, chunks: int) -> dict:
    """Whether the manual variants compute what the op computes: the gradient bit for bit (the same kernels; the
    statistics are per row, so row chunks change no bit)."""
    lp_op, _ = vocab_parallel_logprobs(s.x, s.t, tp_group=group, with_entropy=True, check_inputs=False)
    s.x.grad = None
    lp_op.backward(s.g)
    grad_op = s.x.grad
    s.x.grad = None
    out = {}
    for name, kwargs in (("manual tp", {}), (f"manual tp, pipelined x{chunks}", {"chunks": chunks})):
        _, fwd_bwd = manual_variant(s, group, tp, collective="nccl", **kwargs)
        out[name] = bool(torch.equal(fwd_bwd(NO_MARKS), grad_op))
    return out


def run_vocab(v: int, args, device: Device, group, cta_group) -> tuple[list[dict], dict]:
    rank, tp = dist.get_rank(), dist.get_world_size()
    n = args.tokens
    s = Shard(n, v, rank, tp, device)
    rows = []
    same = manual_matches_op(s, group, tp, args.chunks)
    check = {k: bool(min(o[k] for o in _gathered(same, tp))) for k in same}  # on every rank
    if rank == 0:
        print(json.dumps({"V": v, "manual gradient bitwise equal to the op's, every rank": check}), flush=True)
    table = variants(s, group, tp, chunks=args.chunks, cta_group=cta_group)
    built = {name: build() for name, (build, _, _) in table.items()}
    for mode in MODES:
        names = [name for name, (_, modes, _) in table.items() if mode in modes]
        for part_index, part in enumerate(PARTS):
            base = {"V": v, "N": n, "tp": tp, "mode": mode, "part": part}
            per_name = {name: {**base, "variant": name, "twin": table[name][2]} for name in names}
            calls = {}
            for name in names:  # each variant alone first: one that cannot run here is reported, the rest timed
                fn = built[name][part_index]
                try:
                    if mode == "graph" and device.dry:
                        per_name[name]["skipped"] = "dry run: no CUDA graphs on the CPU"
                        continue
                    if mode == "graph":
                        graph = graphed(fn, device)
                        fn = lambda mark, graph=graph: graph.replay()  # noqa: E731
                    fn(NO_MARKS)
                    calls[name] = fn
                except Exception as err:  # reported, not hidden (a variant that cannot run on this torch)
                    if rank == 0:
                        traceback.print_exc()
                    per_name[name]["error"] = repr(err)[:300]
            # every rank times the same variants (a variant that failed on one rank is left out on all)
            ok = [name for name in names if min(_gathered(name in calls, tp))]
            if ok:
                measured = timed({name: calls[name] for name in ok}, mode, device=device, group=group, iters=args.iters,
                                 warmup=args.warmup, sleep_ms=args.sleep_ms)
                for name in ok:
                    per_name[name].update(measured[name], interleaved_with=ok)
            for name in names:
                rows.append(merge_ranks(_gathered(per_name[name], tp)))
                if rank == 0:
                    r = rows[-1]
                    print(json.dumps({k: r[k] for k in ("V", "tp", "variant", "mode", "part")}
                                     | {"ms": r.get("ms"), "error": r.get("error"), "skipped": r.get("skipped")}),
                          flush=True)
            del calls
            if not device.dry:
                torch.cuda.empty_cache()
    del built, s
    order = list(table)
    rows.sort(key=lambda r: (order.index(r["variant"]), MODES.index(r["mode"]), PARTS.index(r["part"])))
    return rows, check


def _gathered(obj, tp: int) -> list:
    out = [None] * tp
    dist.all_gather_object(out, obj)
    return out


def merge_ranks(per_rank: list[dict]) -> dict:
    """One row from every rank's: the slowest rank's median, every rank's median and phases, the host clocks'
    spread over ranks at each iteration's start."""
    row = {k: v for k, v in per_rank[0].items() if k not in ("ms", "times", "starts", "phases", "cuda_mallocs",
                                                              "alloc_retries", "interleaved_with")}
    if any("error" in r for r in per_rank):
        row["error"] = next(r["error"] for r in per_rank if "error" in r)
        return row
    if "ms" not in per_rank[0]:
        return row
    row["ms"] = max(r["ms"] for r in per_rank)
    row["ms_per_rank"] = [r["ms"] for r in per_rank]
    row["phases_per_rank"] = [r["phases"] for r in per_rank]
    row["cuda_mallocs"] = max(r["cuda_mallocs"] for r in per_rank)
    row["alloc_retries"] = max(r["alloc_retries"] for r in per_rank)
    spreads = [1e6 * (max(t) - min(t)) for t in zip(*(r["starts"] for r in per_rank))]
    row["start_spread_us"] = {"median": statistics.median(spreads), "max": max(spreads)}
    # the per-round slowest rank (skew absorbed by the gather shows as equal times): the ratios' rounds
    row["round_max_ms"] = [max(ts) for ts in zip(*(r["times"] for r in per_rank))]
    row["iteration_max_over_ranks_median_ms"] = statistics.median(row["round_max_ms"])
    if "interleaved_with" in per_rank[0]:
        row["interleaved_with"] = per_rank[0]["interleaved_with"]
    return row


# ------------------------------------------------------------------------------------------------ report
def _twin(rows: list[dict], row: dict) -> dict | None:
    if row.get("twin") is None or "ms" not in row:
        return None
    return next((r for r in rows if r["variant"] == row["twin"] and r["mode"] == row["mode"] and r["part"] == row["part"]
                 and r["V"] == row["V"] and "ms" in r), None)


def ratio_interval(rows: list[dict], row: dict) -> measure.MedianInterval | None:
    """The row against its twin round by round, where both were timed in the same interleaved rounds: the median of
    the per-round ratios of the slowest ranks' times and its 95 % interval (None otherwise)."""
    twin = _twin(rows, row)
    if twin is None or row["twin"] not in row.get("interleaved_with", ()) or "round_max_ms" not in twin:
        return None
    return measure.ratio_to(row["round_max_ms"], twin["round_max_ms"])


def ratio(rows: list[dict], row: dict) -> float | None:
    """The row's time against its twin's: the median per-round ratio (interleaved rounds), else the ratio of the two
    slowest-rank medians (rows timed before the rounds)."""
    twin = _twin(rows, row)
    if twin is None:
        return None
    interval = ratio_interval(rows, row)
    return row["ms"] / twin["ms"] if interval is None else interval.median


def _ratio_cell(rows: list[dict], row: dict) -> str:
    x, interval = ratio(rows, row), ratio_interval(rows, row)
    if x is None:
        return "—"
    return f"{x:.3f}" if interval is None else f"{x:.3f} ({interval.low:.3f}–{interval.high:.3f})"


def gather_times(rows: list[dict], v: int, variant: str, mode: str) -> list[float] | None:
    """Per rank: when its all-gather ended after the LAST rank's statistics ended (CUDA events, ms from each rank's
    iteration start: the ranks start aligned in host_ahead and graph modes), in the forward+backward row of
    ``variant`` / ``mode`` — the collective's own time, a wait for a slower rank's statistics left out. None when
    that row holds no phases."""
    r = next((x for x in rows if (x["V"], x["variant"], x["mode"], x["part"]) == (v, variant, mode, "fwd_bwd")), None)
    phases = (r or {}).get("phases_per_rank") or []
    if not phases or not all("gather" in ph and "statistics" in ph for ph in phases):
        return None
    last = max(ph["statistics"][0] for ph in phases)
    return [ph["gather"][0] - last for ph in phases]


def excess_lines(result: dict) -> list[str]:
    """Where the op's time over its twin goes, from the rows: per V, the graph replay's excess (op tp − op local, ms)
    in forward and forward+backward, and each rank's all-gather phase in host_ahead mode, with NCCL and with the
    local copy in its place (``manual tp, no NCCL``)."""
    rows, lines = result["rows"], []
    for v in result["vocab"]:
        def ms(variant: str, mode: str, part: str) -> float | None:
            r = next((x for x in rows if (x["V"], x["variant"], x["mode"], x["part"]) == (v, variant, mode, part)), {})
            return r.get("ms")

        excess = []
        for part, name in zip(PARTS, ("forward", "forward+backward")):
            tp_ms, local_ms = ms("op tp", "graph", part), ms("op local", "graph", part)
            if tp_ms is not None and local_ms is not None:
                excess.append(f"{name} {tp_ms - local_ms:+.3f} ms ({tp_ms / local_ms:.3f}×)")
        gathers = []
        for variant, label in (("manual tp", "NCCL's all-gather"), ("manual tp, no NCCL", "a local copy in its place")):
            g = gather_times(rows, v, variant, "host_ahead")
            if g is not None:
                gathers.append(f"{label} {' / '.join(f'{x:.3f}' for x in g)} ms")
        if excess or gathers:
            lines.append(f"- V = {v}: as a CUDA graph the op with its collective takes " + ", ".join(excess or ["—"])
                         + " over its twin; the gather's end after the last rank's statistics, ranks 0…{} (host_ahead): ".format(
                             result["tp"] - 1) + "; ".join(gathers or ["—"]) + ".")
    return lines


def write_report(result: dict, out: Path) -> None:
    tp = result["tp"]
    (out / f"tp_collective_tp{tp}.json").write_text(json.dumps(result, indent=1))
    rows = result["rows"]
    lines = [f"# The log-prob op's collective at TP = {tp} — {result['device']}", ""]
    if result.get("dry_run"):
        lines += ["**DRY RUN — not a measurement**: the CPU (gloo, Triton's interpreter, host clock), tiny sizes; a "
                  "check of the script only.", ""]
    lines += [
        f"Command: `{result['command']}`. `vocab_parallel_logprobs` on this rank's shard (N = {result['tokens']}, bf16 "
        "logits ~ N(0, 3²), with entropy, `check_inputs=False` unless the row says checked) against its no-collective "
        "twin (the same kernels on the same shard, `tp_group=None`, targets folded into the shard). Each figure: the "
        f"slowest rank's median of {result['iters']} iterations (every rank's in brackets); × = / the twin in the same "
        "mode: where the rows were timed in interleaved rounds, the median of the per-round ratios of the slowest "
        "ranks' times with its 95 % interval in parentheses (`scripts/measure.py`), else the ratio of the medians. "
        "Modes and variants: `scripts/bench_tp_collective.py`'s docstring. "
        f"Target: within {TARGET:.2f}×. torch {result['torch']}, triton {result['triton']}.",
        "",
    ]
    for v in result["vocab"]:
        check = result["manual_gradient_bitwise_equal_to_op"].get(str(v), {})
        lines += [f"## V = {v} (V_local = {v // tp})", "",
                  "The manual variants' gradient equals the op's bit for bit on every rank: "
                  + ", ".join(f"{k}: {'yes' if ok else 'NO'}" for k, ok in check.items()) + ".", "",
                  "| variant | mode | fwd ms | × | fwd+bwd ms | × | cudaMalloc / retries | host start spread µs (median / max) |",
                  "|---|---|---|---|---|---|---|---|"]
        keys = []
        for r in rows:
            if r["V"] == v and (r["variant"], r["mode"]) not in keys:
                keys.append((r["variant"], r["mode"]))
        for variant, mode in keys:
            cells = []
            extra = ""
            for part in PARTS:
                r = next((x for x in rows if (x["V"], x["variant"], x["mode"], x["part"]) == (v, variant, mode, part)), {})
                if "ms" in r:
                    cells += [f"{r['ms']:.3f} [{' / '.join(f'{m:.3f}' for m in r['ms_per_rank'])}]", _ratio_cell(rows, r)]
                    if part == "fwd_bwd":
                        extra = (f"| {r['cuda_mallocs']} / {r['alloc_retries']} | "
                                 f"{r['start_spread_us']['median']:.0f} / {r['start_spread_us']['max']:.0f} |")
                else:
                    cells += [r.get("error", r.get("skipped", "—")), ""]
            lines.append(f"| {variant} | {mode} | " + " | ".join(cells) + " " + (extra or "| | |"))
        lines += ["", "Phases (forward+backward; GPU ms from the iteration's start / host ms when issued, rank 0 and "
                  "the slowest other rank):", ""]
        for r in rows:
            if r["V"] == v and r["part"] == "fwd_bwd" and r.get("phases_per_rank") and r["phases_per_rank"][0]:
                worst = max(range(tp), key=lambda i: r["ms_per_rank"][i])
                for i in sorted({0, worst}):
                    ph = r["phases_per_rank"][i]
                    lines.append(f"- {r['variant']}, {r['mode']}, rank {i}: " + "; ".join(
                        f"{name} {gpu:.3f} / {host:.3f}" for name, (gpu, host) in ph.items()) + f"; end {r['ms_per_rank'][i]:.3f}")
        lines.append("")
    excess = excess_lines(result)
    if excess:
        lines += ["## Where the time over the twin goes", "",
                  "From the rows above: the excess of the op with its collective over its twin where the host is "
                  "out of the way (CUDA graph), and on each rank the end of its all-gather after the last rank's "
                  "statistics ended (its CUDA events' medians; every rank starts aligned in host_ahead mode).", "",
                  *excess, ""]
    lines += ["## Predictions (written before the first run) and measurements", "",
              "| V | part | mode | predicted op tp / op local | measured |", "|---|---|---|---|---|"]
    for (p_tp, v, part, mode), predicted in PREDICTIONS.items():
        if p_tp != tp or v not in result["vocab"]:
            continue
        r = next((x for x in rows if (x["V"], x["variant"], x["mode"], x["part"]) == (v, "op tp", mode, part)), {})
        x = ratio(rows, r) if r else None
        lines.append(f"| {v} | {part} | {mode} | {predicted} | {'—' if x is None else f'{x:.3f}'} |")
    lines += ["", *[f"- {note}" for note in PREDICTION_NOTES], ""]
    (out / f"tp_collective_tp{tp}.md").write_text("\n".join(lines) + "\n")


def plot(out: Path) -> None:
    """tp_collective.png: op tp / op local per mode, forward and forward+backward, every TP file in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.loads(p.read_text()) for p in sorted(out.glob("tp_collective_tp*.json"))]
    if not results:
        return
    vocabs = sorted({v for r in results for v in r["vocab"]}, reverse=True)
    fig, axes = plt.subplots(1, len(vocabs), figsize=(7 * len(vocabs), 4.5), squeeze=False)
    for ax, v in zip(axes[0], vocabs):
        labels, width = [], 0.2
        for i, res in enumerate(results):
            for j, part in enumerate(PARTS):
                for k, mode in enumerate(MODES):
                    r = next((x for x in res["rows"] if (x["V"], x["variant"], x["mode"], x["part"]) == (v, "op tp", mode, part)), None)
                    x = ratio(res["rows"], r) if r else None
                    if x is not None:
                        ax.bar(2 * i + j + (k - 1.5) * width, x, width, color=f"C{k}",
                               label=mode if (i, j) == (0, 0) else None)
                labels.append(f"TP = {res['tp']}\n{part}")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(TARGET, color="tab:red", ls="--", lw=0.8)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylabel("op with its collective / without")
        ax.set_title(f"V = {v}, N = {results[0]['tokens']}" + (" — DRY RUN" if results[0].get("dry_run") else ""))
        ax.legend(fontsize=7)
    fig.suptitle(f"vocab_parallel_logprobs: the collective's cost by timing mode — {results[0]['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "tp_collective.png", dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 18992])
    parser.add_argument("--iters", type=int, default=40, help="interleaved rounds (each: every variant of a mode once)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sleep-ms", type=float, default=1.5, help="host_ahead / graph: the spin kernel's length")
    parser.add_argument("--chunks", type=int, default=4, help="row chunks of the pipelined variant")
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny sizes: a check of the script only")
    parser.add_argument("--report", nargs="+", type=Path, metavar="TP_COLLECTIVE_JSON",
                        help="no measurement: rewrite the reports of these tp_collective_tp<TP>.json into --out, and "
                             "the plot from every tp_collective_tp*.json there")
    args = parser.parse_args()
    if args.report:
        args.out.mkdir(parents=True, exist_ok=True)
        for source in args.report:
            write_report(json.loads(source.read_text()), args.out)
        plot(args.out)
        return
    if "LOCAL_RANK" not in os.environ:
        parser.error("start it with torchrun --nproc_per_node TP (TP >= 2)")
    device = Device(args.dry_run)
    if args.dry_run:
        args.tokens, args.vocab, args.iters, args.warmup = DRY_TOKENS, [DRY_VOCAB], 1, 0
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    tp = dist.get_world_size()
    if tp < 2:
        parser.error("needs TP >= 2 processes: the question is the collective's cost")
    group = dist.group.WORLD
    cta_group, cta_error = (None, "dry run") if args.dry_run else one_cta_group(tp)
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    result = {"tp": tp, "tokens": args.tokens, "vocab": args.vocab, "iters": args.iters, "chunks": args.chunks,
              "sleep_ms": args.sleep_ms, "dry_run": args.dry_run,
              "device": "CPU DRY RUN (gloo, interpreter)" if args.dry_run else torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "one_cta_group_error": cta_error,
              "command": f"torchrun --nproc_per_node {tp} scripts/bench_tp_collective.py " + " ".join(sys.argv[1:]),
              "manual_gradient_bitwise_equal_to_op": {}, "rows": []}
    for v in args.vocab:
        rows, check = run_vocab(v, args, device, group, cta_group)
        result["rows"] += rows
        result["manual_gradient_bitwise_equal_to_op"][str(v)] = check
        if dist.get_rank() == 0:
            write_report(result, args.out)
    if dist.get_rank() == 0:
        plot(args.out)
        print((args.out / f"tp_collective_tp{tp}.md").read_text(), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
