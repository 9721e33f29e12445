"""Benchmark: a Qwen2.5-shaped GRPO step — mp_grpo against the no-loss floor and the common path, on one GPU or
split over a tensor-parallel group, on Transformer Engine's layer spec or megatron-core's local one.

    python scripts/bench_step.py --out docs/benchmarks                                  # TP = 1: step.{json,md,png}
    torchrun --nproc_per_node 2 scripts/bench_step.py --shape 1.5b --seq 2048 --recompute selective \\
        --out docs/benchmarks                                                           # TP = 2: step_tp.{json,md,png}
    torchrun --nproc_per_node 4 scripts/bench_step.py --shape 7b ...                    # TP = 4 (7B shape)

megatron-core GPTModel (bf16, ``Float16Module``, Megatron DDP with fp32 gradient buffers) in the Qwen2.5-1.5B and
-0.5B shapes (``step_model.SHAPES``; V = 151936, tied embeddings) and the -7B shape (V = 152064, untied), rows of
2048 and 8192 tokens, selective and full activation recompute. ``--spec te`` (the default wherever
``transformer_engine`` imports): Transformer Engine's layer spec, the decoder Megatron users train with; ``--spec
local``: megatron-core's local spec (unfused attention storing the S × S scores), for machines without TE. The spec
names the reports: ``step`` / ``step_tp`` on TE, ``step_local`` / ``step_tp_local`` on the local spec (a report
holds one spec's rows; another spec's run into it is refused). Under torchrun the model is split over ``--tp``
ranks (all of them: TP = world size; no sequence parallelism — the local spec's norms refuse it, and both specs run
alike), every rank fed the same micro-batches. The paths (``step_paths``): ``floor`` (the decoder alone; the bare
output-layer matmuls of this rank's vocabulary shard timed as one more call of each round and added), ``common``
(verl's Megatron path: fp32 logits, megatron-core's ``vocab_parallel_cross_entropy``, a torch PPO loss), mp_grpo's
``logits`` and ``fused`` paths, their fp32 logit precision (``logits_fp32``, ``fused_fp32``), the frameworks' fp32
head with TF32 on and off (``fp32_head_tf32``, ``fp32_head``), and on request ``logits_model_layer`` (the logits path
on GPTModel's own output layer, before the batch-major layer). Rows, each for every path:

- ``train``: one training ``forward_backward_func`` (forward, loss, backward, ``finalize_model_grads``) of one
  micro-batch of 8192 tokens (4 × 2048 or 1 × 8192); ``forward``: the forward-only log-prob pass (old / reference
  policy) of the same micro-batch under ``no_grad`` (floor: decoder forward + the output matmul). **Timing**: the
  passes of one kind, every path, in ``--rounds`` interleaved rounds in one process (``measure.interleaved_ms``:
  floor, its output matmuls, A, B, … and back in the next round; each call timed with CUDA events; under TP a
  barrier before every call and each round's slowest rank). A row's time is the median over the rounds; its figure
  against the floor (``vs_floor``) is the median of the per-round ratios path / (decoder + matmuls), with a
  distribution-free 95 % interval (``measure.ratio_to``); the JSON keeps every round's times. Then each path's peak
  allocated memory of one pass (weights and gradients included; the largest over ranks), and the largest
  micro-batch B that fits (``--search``);
- ``step`` (``--step-configs``, default the 1.5B shape at 2048 at TP = 1, none under TP): a whole GRPO step of
  ``--step-micro-batches`` micro-batches — the forward-only pass (old log-probs), the training pass on them,
  megatron-core's Adam step (fp32 master weights) — every path in ``--step-rounds`` interleaved rounds, and its peak.

The max-micro-batch search (``measure.largest_fitting``, exact to one sequence: it ends when the largest fit and
the smallest failure are one row apart): probes run one pass at B and catch the out-of-memory error
(``measure.fits_in_memory``: everything freed and the cache emptied between probes). The floor's first probe is
2·B₀; the line through the peaks at B₀ and 2·B₀ predicts the largest B that fits in the free memory, which is probed
next; then steps of 1, 2, 4, … and bisection. The other paths start from the floor's largest B (its own first
failure is the next probe): two probes when a path fits what the floor fits. ``--search-paths`` limits the search
to some paths. Capped at ``--max-tokens``. Under TP every rank probes the same B and a probe fits only where it
fits on every rank (the memory figures are agreed first: the largest peak, the smallest free memory); the ranks run
out of memory at the same allocation (the same shapes on every rank), and a rank left waiting in a collective is
ended by the process group's timeout (``--collective-timeout``).

``--memory-snapshot DIR``: after the search, one training pass of the floor, the fused path and (when run) the
fp32 fused path at the largest B all of them fit, each with ``torch.cuda.memory``'s history on: the snapshots
(``DIR/<path>.pickle``, readable at pytorch.org/memory_viz) and ``DIR/memory_snapshot.md`` — each peak, and what
the fused paths hold at their peak that the floor does not, by allocation site (``memory_snapshot.compare``; also
in the report).

Resumable: rows already in the JSON are skipped (``--force`` measures them again; a kind with a row to time is
timed again whole, the floor included, so that every ratio comes from its own rounds); ``--shape``, ``--seq``,
``--recompute``, ``--rows`` (``KIND`` or ``KIND:PATH``) and ``--paths`` select; the configurations run in the order
1.5B @ 2048 (selective, full), 0.5B @ 2048, 1.5B @ 8192, 0.5B @ 8192 (then any other shape). ``--time-budget`` stops
starting new parts after that many seconds; the JSON records how long each part took (``meta.phase_s``). The JSON
and the markdown are rewritten after every part, the plot at the end; under TP also ``step_tp_scaling.png`` (each
path's time and largest micro-batch against the floor's, per TP size). ``--profile KIND:PATH ...`` (for
``--profile-configs``) writes ``<report>_profile.txt``: per pass the host time to issue it, its kernel time against
its wall time (GPU idle), its memory statistics and its top kernels. Before timing, the loss paths are checked to
give the same gradients on a tiny model of the same spec (``check_paths``; under TP on every rank's shard).

``--loss-fraction F``: the completion (the tokens trained on) is the last F of every row instead of 7/8 (e.g. 0.5:
a 50 %-masked micro-batch). mp_grpo's paths compute the output layer on those rows alone (``OutputRows.LOSS``),
the floor's output matmuls stay on every token: the all-token floor. A JSON holds rows of one loss fraction (write
other fractions to another ``--out``).

``--dry-run``: the whole driver on the CPU (gloo, Triton's interpreter) with the CPU stand-in model
(``step_model.cpu_rig``: no attention, whatever ``--spec`` says — the spec is only recorded) at tiny sizes and
**stubbed measurements** (``step_meter.DryMeter``: times from the host clock, memory and snapshots from a fixed
per-token model, a fake memory limit for the search) — a check of the script's plumbing (arguments, TP groups, the
rounds, the rows, the search, the snapshot report, the reports), never a measurement: its reports say so and it
refuses to write under ``docs/``.

Needs (without ``--dry-run``) CUDA GPUs, megatron-core, torch, triton, matplotlib; Transformer Engine for ``--spec te``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path as FilePath

import torch
import torch.distributed as dist

sys.path.insert(0, str(FilePath(__file__).resolve().parents[1]))
sys.path.insert(0, str(FilePath(__file__).resolve().parent))

import measure  # noqa: E402
import memory_snapshot  # noqa: E402
from measure import GiB, largest_fitting  # noqa: E402
from step_meter import DRY_SEQ, DryMeter, GpuMeter  # noqa: E402
from step_model import SHAPES, LayerSpec, Recompute, cpu_rig, default_spec, gpu_rig, synthetic_micro_batches  # noqa: E402
from step_paths import Path, forward_pass, grpo_step, training_pass, unavailable  # noqa: E402
from step_report import PLAN, REPORT_NAMES, Results, report_name, row_key, write_reports  # noqa: E402

ALLOC_CONF = "expandable_segments:True"
TIMING_TOKENS = 8192
"""Tokens of the timed micro-batch: B₀ = 8192 / S rows."""
KINDS = ("train", "forward", "step")
FORWARD_RECOMPUTE = "selective"
"""The forward-only rows run with this model only: a no-grad pass recomputes nothing, so both modes run the
same code (megatron-core's checkpointing only wraps the forward)."""
DEFAULT_PATHS = (Path.FLOOR, Path.COMMON, Path.LOGITS, Path.FUSED)
CHECK_RTOL = 1.6e-2
"""bf16 tolerance on the relative L2 error of the gradients of the loss paths against each other (tests/tolerances)."""
COLLECTIVE_TIMEOUT_S = 300
"""Default process-group timeout under TP: a rank left in a collective (a probe that ran out of memory on another
rank only) ends the run after this long instead of NCCL's 10 minutes; rerun the command to resume."""
ROUNDS = 20
"""Interleaved rounds of the training and forward-only passes: 20 per-round ratios give a 95.9 % interval between
the 6th and the 15th smallest (``measure.median_interval``)."""
STEP_ROUNDS = 10
"""Interleaved rounds of the whole steps (each ~3× a training pass): a 97.9 % interval between the 2nd and 9th."""
FLOOR_MATMULS = "floor_matmuls"
"""The name, among a round's calls, of the floor's bare output-layer GEMMs."""
SNAPSHOT_PATHS = (Path.FLOOR, Path.FUSED, Path.FUSED_FP32)
"""``--memory-snapshot``: the passes snapshotted (those of them that run), the floor first: the base of the comparison."""
DRY_HIDDEN, DRY_VOCAB = 16, 64
"""``--dry-run``: the CPU stand-in's width and (global) vocabulary."""
LOSS_FRACTION: float | None = None
"""``--loss-fraction``: the trained share of every row of the synthetic micro-batches (None: 7/8)."""


def log(msg: str) -> None:
    if rank() == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


# ------------------------------------------------------------------------------------------------ measuring
METER: GpuMeter = GpuMeter()


def agreed(value: float, op: str) -> float:
    """``value`` as every rank will use it: the largest (``op="max"``) or smallest over the ranks."""
    if world() == 1:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=METER.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN)
    return float(t.item())


def slowest_rank(times: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each function's time per round as the slowest rank's (every rank holds the same names and rounds)."""
    if world() == 1:
        return times
    names = list(times)
    t = torch.tensor([times[n] for n in names], dtype=torch.float64, device=METER.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {n: [float(v) for v in row] for n, row in zip(names, t.tolist())}


def per_rank(value: float) -> list[float]:
    """``value`` of every rank, in rank order."""
    if world() == 1:
        return [float(value)]
    t = torch.tensor([float(value)], dtype=torch.float64, device=METER.device)
    out = torch.empty(world(), dtype=torch.float64, device=METER.device)
    dist.all_gather_into_tensor(out, t)
    return [float(v) for v in out.tolist()]


def past(deadline: float) -> bool:
    """Whether the time budget is spent — on any rank (every rank then stops at the same row)."""
    return agreed(float(time.monotonic() > deadline), "max") > 0


def resting_gib() -> float:
    return agreed(METER.resting_bytes(), "max") / GiB


# ------------------------------------------------------------------------------------------------ setup
def init_distributed(tp: int, *, dry: bool, timeout_s: float) -> None:
    """The process group (NCCL; gloo for ``--dry-run``) over every process and megatron-core's parallel_state at
    TP = ``tp``, which must be the number of processes (one process: TP = 1)."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("gloo" if dry else "nccl", rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)), timeout=timedelta(seconds=timeout_s))
    if tp != dist.get_world_size():
        raise SystemExit(f"--tp {tp}: must equal the number of processes ({dist.get_world_size()}): every rank is one "
                         "tensor-parallel rank (start the script with torchrun --nproc_per_node {tp})")
    if not dry:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)


def build_rig(shape_name: str, recompute: Recompute, seq: int, spec: LayerSpec):
    if METER.dry:
        from mp_grpo.megatron import ParallelGroups

        return cpu_rig(ParallelGroups.from_parallel_state(), hidden=DRY_HIDDEN, vocab=DRY_VOCAB, seq_len=seq)
    return gpu_rig(SHAPES[shape_name], recompute, seq_len=seq, spec=spec)


def release_optimizer(rig, optimizer) -> None:
    """Drop megatron-core's Adam and its fp32 master weights (each model parameter keeps one as ``main_param``)."""
    for param in rig.model.parameters():
        if hasattr(param, "main_param"):
            del param.main_param
    del optimizer
    rig.zero_grad()
    METER.cleanup()


def release_rig(rig) -> None:
    """Free the model: Megatron DDP keeps its gradient hooks' nodes (which hold it) in ``grad_accs``."""
    getattr(rig.model, "grad_accs", []).clear()
    rig.model = None
    METER.cleanup()


def micro_batches(num: int, batch: int, seq: int, rig, *, seed: int):
    return synthetic_micro_batches(num, batch, seq, rig.vocab, seed=seed, device=METER.device,
                                   loss_fraction=LOSS_FRACTION)


def seq_of(seq: int) -> int:
    """The rows' length actually run: ``seq`` (the dry run's stand-in: ``DRY_SEQ``)."""
    return DRY_SEQ if METER.dry else seq


def timing_rows(seq: int) -> int:
    return max(1, TIMING_TOKENS // seq) if not METER.dry else 4


# ------------------------------------------------------------------------------------------------ check
def check_paths(paths: list[Path], spec: LayerSpec, seq: int = 128, batch: int = 2) -> float:
    """The loss paths on the tiny shape with the ``spec`` layer (dry run: the stand-in): the same objective, so the
    same gradients (relative L2 against the common path's, on this rank's shard, bf16 tolerance; the worst over ranks)."""
    seq = seq_of(seq)
    rig = build_rig("tiny", Recompute.SELECTIVE, seq, spec)
    micro = micro_batches(2, batch, seq, rig, seed=3)
    grads = {}
    for path in [Path.COMMON, *[p for p in paths if p not in (Path.FLOOR, Path.COMMON)]]:
        rig.zero_grad()
        training_pass(rig, path, micro)()
        grads[path] = torch.cat([p.main_grad.flatten().double() for p in rig.model.parameters()])
    ref = grads.pop(Path.COMMON)
    errors = {path.value: agreed(float((g - ref).norm() / ref.norm()), "max") for path, g in grads.items()}
    log(f"check: gradients of the loss paths vs the common path on the tiny model, relative L2: {errors}")
    worst = max(errors.values(), default=0.0)
    if not worst <= CHECK_RTOL:
        raise SystemExit(f"check failed: a loss path's gradients differ from the common path's by {worst:.3e}")
    release_rig(rig)
    return worst


# ------------------------------------------------------------------------------------------------ rows
def pass_closure(rig, kind: str, path: Path, micro):
    return (training_pass if kind == "train" else forward_pass)(rig, path, micro)


def round_names(paths: list[Path]) -> list[str]:
    """The calls of one round, in order: the floor, its output matmuls, then the other paths."""
    names = [p.value for p in paths]
    return names[:1] + [FLOOR_MATMULS] + names[1:] if Path.FLOOR in paths else names


def rows_from_rounds(paths: list[Path], mine: dict[str, list[float]], base: dict) -> dict[Path, dict]:
    """The rows of one group from this rank's per-round times: the slowest rank's per round, their median, each
    path's median per-round ratio to the floor's decoder + matmuls with its 95 % interval; ``base`` (B, tokens,
    resting memory) goes into every row."""
    times = slowest_rank(mine)
    floor = [d + m for d, m in zip(times[Path.FLOOR.value], times[FLOOR_MATMULS])] if Path.FLOOR in paths else None
    rows = {}
    for path in paths:
        own = floor if path == Path.FLOOR else times[path.value]
        row = {**base, "rounds": len(own), "times_ms": own, "ms": measure.median(own)}
        if path == Path.FLOOR:
            row.update(decoder_ms=measure.median(times[path.value]), matmul_ms=measure.median(times[FLOOR_MATMULS]),
                       decoder_times_ms=times[path.value], matmul_times_ms=times[FLOOR_MATMULS])
        elif floor is not None:
            row["vs_floor"] = measure.ratio_to(own, floor).as_dict()
        if world() > 1:
            local = ([d + m for d, m in zip(mine[path.value], mine[FLOOR_MATMULS])] if path == Path.FLOOR
                     else mine[path.value])
            row["tp"] = world()
            row["ms_per_rank"] = per_rank(measure.median(local))
        rows[path] = row
    return rows


def time_group(rig, kind: str, paths: list[Path], seq: int, args) -> dict[Path, dict]:
    """The ``kind`` pass of every path in ``paths`` on the timing micro-batch, in ``args.rounds`` interleaved
    rounds (the floor first, with its output matmuls of this rank's shard as one more call), then each path's peak
    of one pass alone."""
    b0 = timing_rows(seq)
    micro = micro_batches(1, b0, seq, rig, seed=11)
    base = {"B": b0, "tokens": b0 * seq, "resting_GiB": resting_gib()}
    runs = {p: pass_closure(rig, kind, p, micro) for p in paths}
    calls = {p.value: runs[p] for p in paths}
    if Path.FLOOR in paths:
        calls[FLOOR_MATMULS] = METER.output_matmuls(b0 * seq, rig.hidden, rig.vocab // world(), backward=kind == "train")
    mine = METER.rounds({name: calls[name] for name in round_names(paths)}, args.rounds,
                        warmup=args.warmup + (kind == "forward"))
    del calls
    METER.cleanup()
    rows = rows_from_rounds(paths, mine, base)
    for path in paths:
        peak = METER.peak(runs[path], tokens=b0 * seq, path=path, kind=kind)
        rows[path]["peak_bytes"] = int(agreed(peak, "max"))
        rows[path]["peak_GiB"] = rows[path]["peak_bytes"] / GiB
        METER.cleanup()
    del runs
    METER.cleanup()
    return rows


def memory_model_guess(b0: int, p0: int, b1: int, p1: int | None, *, usable: int, base: int) -> int:
    """The largest B whose peak stays within ``usable`` bytes: on the line through the peaks (B₀, p₀) and (B₁, p₁)
    when both were measured (B₁ ≠ B₀), else on the line from the resting memory ``base`` (B = 0) through (B₀, p₀)."""
    if p1 is not None and b1 != b0:
        slope = (p1 - p0) / (b1 - b0)
        return int(b0 + (usable - p0) / max(slope, 1.0))
    return int(b0 * (usable - base) / max(p0 - base, 1.0))


def search_row(rig, kind: str, path: Path, seq: int, row: dict, args, floor: dict | None = None) -> dict:
    """The largest micro-batch of ``seq``-token rows that fits (see the module docstring). ``floor``: the floor's
    row of the same kind, searched before: its largest B is this path's first probe."""
    start = time.monotonic()
    limit = max(1, args.max_tokens // seq)
    b0, p0 = row["B"], row["peak_bytes"]
    peaks: dict[int, int] = {b0: p0}

    def fits(b: int) -> bool:
        micro = micro_batches(1, b, seq, rig, seed=13)
        resting = resting_gib()
        ok, peak = METER.fits(pass_closure(rig, kind, path, micro), tokens=b * seq, path=path, kind=kind)
        ok = agreed(float(ok), "min") > 0  # a probe fits only where it fits on every rank
        log(f"  probe {kind}/{path.value} B = {b}: {'fits' if ok else 'out of memory'}"
            + (f", peak {peak / GiB:.2f} GiB" if ok and peak else "") + f" (resting {resting:.2f} GiB)")
        if ok:
            peaks[b] = int(agreed(peak, "max"))
        return ok

    base = int(resting_gib() * GiB)
    usable = int(agreed(METER.usable_bytes(), "min"))
    known_fit, known_failure, first = b0, None, []
    if floor is not None and floor.get("max_B", 0) > b0:  # start where the floor stopped
        guess = min(floor["max_B"], limit)
    else:
        b1 = min(2 * b0, limit)
        if b1 > b0:
            if fits(b1):
                known_fit = b1
            else:
                known_failure = b1
            first = [[b1, known_fit == b1]]
        guess = memory_model_guess(b0, p0, known_fit, peaks.get(known_fit), usable=usable, base=base)
    if known_fit >= limit:
        search = measure.Search(largest=known_fit, first_failure=None, probes=[])
    else:
        search = largest_fitting(fits, guess, limit=limit, known_fit=known_fit, known_failure=known_failure)
    out = {"max_B": search.largest, "max_tokens": search.largest * seq, "first_failure_B": search.first_failure,
           "guess_B": guess, "probes": [[b0, True]] + first + [list(p) for p in search.probes],
           "search_s": time.monotonic() - start, "search_limit_tokens": args.max_tokens}
    if floor is not None:
        out["search_started_at_floor"] = True
    if search.largest in peaks:
        out["peak_GiB_at_max"] = peaks[search.largest] / GiB
    return out


PROFILE_STEPS = 3
"""Steps per profile (back to back, as the timed rows run them)."""


def profile_row(rig, kind: str, path: Path, seq: int) -> str:
    """Where one pass's time goes: the host time to issue it, the summed kernel time of ``PROFILE_STEPS`` passes
    (torch.profiler, CUDA activity) against their wall time (the difference: the GPU idle), the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    b0 = timing_rows(seq)
    micro = micro_batches(1, b0, seq, rig, seed=11)
    run = pass_closure(rig, kind, path, micro)
    run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    issue_ms = (time.perf_counter() - t0) * 1e3  # an upper bound when the pass synchronizes inside
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(PROFILE_STEPS):
            run()
        end.record()
        torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    events = prof.key_averages()
    kernel_ms = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3 / PROFILE_STEPS
    wall_ms = start.elapsed_time(end) / PROFILE_STEPS
    text = (f"### {kind} / {path.value}, B = {b0} x S = {seq}" + (f", TP = {world()} (rank 0)" if world() > 1 else "")
            + f"\nhost time to issue one pass {issue_ms:.1f} ms; per pass: kernel time {kernel_ms:.1f} ms, wall "
            f"{wall_ms:.1f} ms, GPU idle {wall_ms - kernel_ms:.1f} ms\n"
            f"memory of one pass: peak allocated {stats['allocated_bytes.all.peak'] / GiB:.2f} GiB, peak reserved "
            f"{stats['reserved_bytes.all.peak'] / GiB:.2f} GiB, allocations {stats['allocation.all.allocated']}, "
            f"allocator retries {stats['num_alloc_retries']}\n\n"
            + events.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=80) + "\n")
    del run, prof, events
    METER.cleanup()
    return text


def step_group(rig, paths: list[Path], seq: int, optimizer, args) -> dict[Path, dict]:
    """A whole GRPO step of every path in ``args.step_rounds`` interleaved rounds (the floor's output matmuls — per
    micro-batch the forward-only pass's GEMM and the training pass's three — as one more call), then each step's peak."""
    b0 = timing_rows(seq)
    micro = micro_batches(args.step_micro_batches, b0, seq, rig, seed=17)
    base = {"B": b0, "micro_batches": len(micro), "tokens": b0 * seq * len(micro), "resting_GiB": resting_gib()}
    runs = {p: grpo_step(rig, p, micro, optimizer) for p in paths}
    calls = {p.value: runs[p] for p in paths}
    if Path.FLOOR in paths:
        tokens, v_local = b0 * seq, rig.vocab // world()
        fwd = METER.output_matmuls(tokens, rig.hidden, v_local, backward=False)
        fwd_bwd = METER.output_matmuls(tokens, rig.hidden, v_local, backward=True)

        def step_matmuls() -> None:
            for _ in micro:
                fwd()
                fwd_bwd()

        calls[FLOOR_MATMULS] = step_matmuls
    mine = METER.rounds({name: calls[name] for name in round_names(paths)}, args.step_rounds, warmup=args.warmup)
    del calls
    METER.cleanup()
    rows = rows_from_rounds(paths, mine, base)
    for path in paths:
        rows[path]["peak_bytes"] = int(agreed(METER.peak(runs[path], tokens=base["tokens"], path=path, kind="train"), "max"))
        rows[path]["peak_GiB"] = rows[path]["peak_bytes"] / GiB
        METER.cleanup()
    del runs
    METER.cleanup()
    return rows


def snapshot_group(rig, paths: list[Path], seq: int, results: Results, key_of, out: FilePath) -> list[str]:
    """``--memory-snapshot``: one training pass of each of ``paths`` (the floor first) at the largest B every one of
    them fit (B₀ where none was searched), each recorded (``METER.snapshot``); the pickles under ``out`` (rank 0)
    and the comparison lines of each path against the floor (``memory_snapshot.compare``)."""
    fitted = [results.row(key_of(p)).get("max_B") for p in paths]
    b = min((f for f in fitted if f), default=timing_rows(seq))
    micro = micro_batches(1, b, seq, rig, seed=13)
    peaks = {}
    for path in paths:
        snap = METER.snapshot(pass_closure(rig, "train", path, micro), tokens=b * seq, path=path, kind="train")
        if rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            memory_snapshot.save(snap, out / f"train_{path.value}.pickle")
        peaks[path] = memory_snapshot.at_peak(snap)
        del snap
        METER.cleanup()
    lines = [f"Training pass, B = {b} × S = {seq} ({b * seq} tokens)" + (f", TP = {world()} (rank 0)" if world() > 1 else "")
             + f": snapshots `{out}/train_<path>.pickle`."]
    for path in paths[1:]:
        lines += memory_snapshot.compare(path.value, peaks[path], Path.FLOOR.value, peaks[Path.FLOOR])
    return lines


# ------------------------------------------------------------------------------------------------ driver
def selected(kind: str, path: Path, rows: list[str] | None) -> bool:
    return rows is None or kind in rows or f"{kind}:{path.value}" in rows


@contextmanager
def phase(results: Results, where: str, name: str) -> Iterator[None]:
    """Adds the seconds the block takes to ``meta.phase_s[where][name]`` (how long each part of a run took)."""
    start = time.monotonic()
    try:
        yield
    finally:
        spent = results.meta.setdefault("phase_s", {}).setdefault(where, {})
        spent[name] = round(spent.get(name, 0.0) + time.monotonic() - start, 1)


def log_row(kind: str, path: Path, row: dict) -> None:
    ratio = row.get("vs_floor")
    versus = f"  {ratio['median']:.4f}x floor [{ratio['low']:.4f}, {ratio['high']:.4f}]" if ratio else ""
    log(f"{kind:<8} {path.value:<18} {row['ms']:9.2f} ms{versus}  peak {row['peak_GiB']:6.2f} GiB "
        f"(resting {row['resting_GiB']:.2f} GiB, {row['rounds']} rounds)")


def run(args) -> Results:
    tp = world()
    spec = LayerSpec(args.spec)
    results = Results.load(args.out / f"{args.report or report_name(tp, spec.value)}.json")
    launcher = "python" if tp == 1 else f"torchrun --nproc_per_node {tp}"
    results.meta["loss_fraction"] = LOSS_FRACTION
    results.start(command=" ".join([launcher, "scripts/bench_step.py", *sys.argv[1:]]), device=METER.device_name(),
                  dry_run=METER.dry, spec=spec.value)
    deadline = time.monotonic() + args.time_budget
    paths = []
    for p in map(Path, args.paths):
        why = unavailable(p)
        if why is None:
            paths.append(p)
        else:
            log(f"path {p.value} skipped: {why}")
            results.meta.setdefault("skipped_paths", {})[p.value] = why
    configs = [(s, q, r) for s, q, r in PLAN if s in args.shape and q in args.seq and r in args.recompute]
    configs += [(s, q, r) for s in args.shape for q in args.seq for r in args.recompute
                if (s, q, r) not in configs]  # shapes or lengths outside the plan (the tiny smoke test)
    if args.check:
        with phase(results, "all", "check"):
            results.meta[f"check_worst_relative_l2{'' if tp == 1 else f'_tp{tp}'}"] = check_paths(paths, spec)
    step_configs = args.step_configs if args.step_configs is not None else (["1.5b@2048"] if tp == 1 else [])

    def searched(kind: str, path: Path) -> bool:
        return args.search_paths is None or path.value in args.search_paths or f"{kind}:{path.value}" in args.search_paths

    for shape_name, seq, recompute in configs:
        where = f"{shape_name}@{seq}@{recompute}"

        def key_of(path: Path, kind: str = "train") -> str:
            return row_key(shape_name, seq, recompute, kind, path, tp)

        step_here = f"{shape_name}@{seq}" in step_configs
        todo = [(kind, path) for kind in KINDS for path in paths if selected(kind, path, args.rows)
                and (kind != "step" or step_here) and (kind != "forward" or recompute == FORWARD_RECOMPUTE)
                and (args.force or not results.complete(key_of(path, kind),
                                                        search=args.search and kind != "step" and searched(kind, path)))]
        profiles = [p for p in args.profile or [] if where in args.profile_configs]
        snap_paths = [p for p in SNAPSHOT_PATHS if p in paths] if args.memory_snapshot else []
        snap_here = Path.FLOOR in snap_paths and len(snap_paths) > 1 and (args.force or where not in results.meta.get("memory_snapshot", {}))
        if not todo and not profiles and not snap_here:
            continue
        if past(deadline):
            log("time budget reached: rerun the same command to continue")
            break
        run_seq = seq_of(seq)
        log(f"=== {shape_name} @ {seq}, {recompute} recompute, TP = {tp}, {spec.value} layer spec: {len(todo)} rows ===")
        with phase(results, where, "build"):
            rig = build_rig(shape_name, Recompute(recompute), run_seq, spec)

        def group(kind: str) -> list[Path]:
            """The paths of ``kind`` to time together: all selected ones and the floor, when one of them needs timing."""
            if not any(k == kind and (args.force or "ms" not in results.row(key_of(p, k))) for k, p in todo):
                return []
            return [p for p in paths if p == Path.FLOOR or selected(kind, p, args.rows)]

        # --- 1. times (interleaved rounds) and peaks at the timing micro-batch ---
        for kind in ("train", "forward"):
            timed = group(kind)
            if not timed or past(deadline):
                continue
            with phase(results, where, kind):
                rows = time_group(rig, kind, timed, run_seq, args)
            for path, row in rows.items():
                results.update(key_of(path, kind), row)
                log_row(kind, path, row)
            save(results, args)
        # --- 2. profiles ---
        for entry in profiles:
            kind, _, path = entry.partition(":")
            if past(deadline) or METER.dry:
                break
            text = profile_row(rig, kind, Path(path), run_seq)
            if rank() == 0:
                with open(args.out / f"{results.path.stem}_profile.txt", "a") as f:
                    f.write(f"## {shape_name} @ {seq}, {recompute} recompute ({results.meta.get('device')})\n{text}\n")
            log(text.splitlines()[1])
        # --- 3. the largest micro-batches (before the optimizer exists: its state is no part of these rows);
        #        the training pass before the forward-only one, the floor first: the other paths start from its B ---
        if args.search:
            order = sorted(todo, key=lambda kp: (KINDS.index(kp[0]), kp[1] != Path.FLOOR))
            for kind, path in order:
                key = key_of(path, kind)
                if (kind == "step" or not searched(kind, path) or "ms" not in results.row(key)
                        or (not args.force and "max_B" in results.row(key))):
                    continue
                if past(deadline):
                    break
                floor = results.row(key_of(Path.FLOOR, kind))
                floor = floor if path != Path.FLOOR and "max_B" in floor else None
                with phase(results, where, f"search_{kind}"):
                    found = search_row(rig, kind, path, run_seq, results.row(key), args, floor=floor)
                results.update(key, found)
                log(f"{kind:<8} {path.value:<18} max B = {found['max_B']} ({found['max_tokens']} tokens), "
                    f"{len(found['probes'])} probes, {found['search_s']:.0f} s")
                save(results, args)
        # --- 4. what the fused paths hold at their peak that the floor does not ---
        if snap_here and not past(deadline):
            with phase(results, where, "memory_snapshot"):
                lines = snapshot_group(rig, snap_paths, run_seq, results, key_of, args.memory_snapshot / where)
            results.meta.setdefault("memory_snapshot", {})[where] = lines
            if rank() == 0:
                (args.memory_snapshot / where / "memory_snapshot.md").write_text(
                    f"# Memory at the peak: {where}, {spec.value} layer spec — {results.meta.get('device')}\n\n"
                    + "\n".join(lines) + "\n")
            log("\n".join(lines))
            save(results, args)
        # --- 5. whole GRPO steps with megatron-core's optimizer ---
        stepped = group("step")
        if stepped and not past(deadline):
            with phase(results, where, "step"):
                optimizer = make_optimizer(rig)
                rows = step_group(rig, stepped, run_seq, optimizer, args)
                release_optimizer(rig, optimizer)
                del optimizer
            for path, row in rows.items():
                results.update(key_of(path, "step"), row)
                log_row("step", path, row)
            save(results, args)
        release_rig(rig)
        del rig
    save(results, args, plot=True)
    return results


def make_optimizer(rig):
    if METER.dry:  # the stand-in's parameters: plain SGD on main_grad, as the CPU tests step them
        class Sgd:
            def zero_grad(self) -> None:
                pass

            @torch.no_grad()
            def step(self) -> None:
                for p in rig.model.parameters():
                    p.sub_(1e-6 * p.main_grad)

        return Sgd()
    from mp_grpo.megatron.gpt import megatron_optimizer

    return megatron_optimizer(rig.model, lr=1e-6, clip_grad=1.0, bf16=True)


def save(results: Results, args, *, plot: bool = False) -> None:
    if rank() == 0:
        write_reports(results, args.out, plot=plot, tp1_json=args.tp1_json)


def main() -> None:
    global METER, LOSS_FRACTION
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=FilePath, default=FilePath("docs/benchmarks"))
    parser.add_argument("--shape", nargs="+", default=["1.5b", "0.5b"], choices=sorted(SHAPES))
    parser.add_argument("--seq", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--recompute", nargs="+", default=[r.value for r in Recompute], choices=[r.value for r in Recompute])
    parser.add_argument("--tp", type=int, default=int(os.environ.get("WORLD_SIZE", 1)),
                        help="tensor-parallel size: the number of processes (torchrun's --nproc_per_node)")
    parser.add_argument("--rows", nargs="+", metavar="KIND[:PATH]", help=f"kinds {', '.join(KINDS)}, optionally :path")
    parser.add_argument("--paths", nargs="+", default=[p.value for p in DEFAULT_PATHS], choices=[p.value for p in Path])
    parser.add_argument("--search-paths", nargs="+", metavar="[KIND:]PATH",
                        help="search the largest micro-batch of these paths only, in both kinds or in KIND "
                             "(train / forward) only (default: every path run)")
    parser.add_argument("--step-configs", nargs="*", default=None, metavar="SHAPE@SEQ",
                        help="whole-step rows (default: 1.5b@2048 at TP = 1, none under TP)")
    parser.add_argument("--step-micro-batches", type=int, default=2)
    parser.add_argument("--spec", choices=[s.value for s in LayerSpec], default=None,
                        help="the decoder's layer spec: te (Transformer Engine's; the default where transformer_engine "
                             "imports) or local (megatron-core's)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds of the training and forward passes")
    parser.add_argument("--step-rounds", type=int, default=STEP_ROUNDS, help="interleaved rounds of the whole steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls of every path before the rounds")
    parser.add_argument("--memory-snapshot", type=FilePath, default=None, metavar="DIR",
                        help="torch.cuda.memory snapshots of the floor's and the fused paths' training pass at the "
                             "largest B they all fit, and what the fused paths hold that the floor does not")
    parser.add_argument("--max-tokens", type=int, default=2**19, help="the search's cap on a micro-batch's tokens")
    parser.add_argument("--no-search", dest="search", action="store_false")
    parser.add_argument("--no-check", dest="check", action="store_false")
    parser.add_argument("--force", action="store_true", help="measure rows already in the JSON again")
    parser.add_argument("--profile", nargs="+", metavar="KIND:PATH", help="profile these passes (<report>_profile.txt)")
    parser.add_argument("--profile-configs", nargs="*", default=["1.5b@2048@selective"], metavar="SHAPE@SEQ@RECOMPUTE")
    parser.add_argument("--time-budget", type=float, default=float("inf"), help="seconds; no new row starts after")
    parser.add_argument("--collective-timeout", type=float, default=COLLECTIVE_TIMEOUT_S,
                        help="seconds a rank may wait in one collective (under TP) before the run ends")
    parser.add_argument("--report", choices=sorted(REPORT_NAMES.values()), default=None,
                        help="the report to write: step / step_local (TP = 1 only) or step_tp / step_tp_local (rows of "
                             "every TP size); default: by TP size and --spec (the _local names for the local spec)")
    parser.add_argument("--tp1-json", type=FilePath, default=None,
                        help="TP = 1 rows for the TP-scaling plot (default: the step_tp.json's own TP = 1 rows)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, gloo, the stand-in model, stubbed measurements: a check of the script only")
    parser.add_argument("--loss-fraction", type=float, default=None, metavar="F",
                        help="the trained share of every row, in (0, 1] (default 7/8); e.g. 0.5 for a 50 %%-masked batch")
    args = parser.parse_args()
    if args.loss_fraction is not None and not 0.0 < args.loss_fraction <= 1.0:
        parser.error(f"--loss-fraction: must lie in (0, 1], got {args.loss_fraction}")
    for spec in args.rows or []:
        kind, _, path = spec.partition(":")
        if kind not in KINDS or (path and path not in [p.value for p in Path]):
            parser.error(f"--rows: {spec!r} is not KIND or KIND:PATH (kinds {', '.join(KINDS)})")
    for spec in args.profile or []:
        kind, _, path = spec.partition(":")
        if kind not in ("train", "forward") or path not in [p.value for p in Path]:
            parser.error(f"--profile: {spec!r} is not KIND:PATH with KIND train or forward")
    for spec in args.search_paths or []:
        kind, _, path = spec.rpartition(":")
        if kind not in ("", "train", "forward") or path not in [p.value for p in Path]:
            parser.error(f"--search-paths: {spec!r} is not PATH or KIND:PATH with KIND train or forward")
    if args.tp < 1:
        parser.error(f"--tp: must be ≥ 1, got {args.tp}")
    for name, value, least in (("--rounds", args.rounds, 1), ("--step-rounds", args.step_rounds, 1),
                               ("--warmup", args.warmup, 0)):
        if value < least:
            parser.error(f"{name}: must be ≥ {least}, got {value}")
    if args.spec is None:
        args.spec = default_spec().value
        print(f"--spec {args.spec}: transformer_engine {'imports' if args.spec == 'te' else 'does not import'} here",
              flush=True)
    if args.report is not None and args.report.startswith("step_tp") != (args.tp != 1):
        parser.error(f"--report {args.report}: " + ("holds TP = 1 rows only" if args.tp != 1 else "is the TP report")
                     + f", got --tp {args.tp}")
    if args.report is not None and args.report.endswith("_local") != (args.spec == LayerSpec.LOCAL.value):
        parser.error(f"--report {args.report}: holds {'local' if args.report.endswith('_local') else 'te'}-spec rows, "
                     f"got --spec {args.spec}")
    if args.spec == LayerSpec.TE.value and not args.dry_run:
        from mp_grpo.megatron.gpt import have_transformer_engine

        if not have_transformer_engine():
            parser.error("--spec te: transformer_engine does not import here (PYTHONPATH, NVTE_FRAMEWORK=pytorch); "
                         "or --spec local")
    if not args.dry_run:
        for name in args.shape:
            try:
                SHAPES[name].check_tensor_parallel(args.tp)
            except ValueError as err:
                parser.error(str(err))
    if args.dry_run:
        docs = (FilePath(__file__).resolve().parents[1] / "docs").resolve()
        if args.out.resolve() == docs or docs in args.out.resolve().parents:
            parser.error(f"--out {args.out}: a dry run's stubbed figures never go under docs/")
        METER = DryMeter()
    elif not torch.cuda.is_available():
        sys.exit("bench_step.py needs CUDA GPUs (or --dry-run)")
    LOSS_FRACTION = args.loss_fraction
    existing = Results.load(args.out / f"{args.report or report_name(args.tp, args.spec)}.json")
    if existing.rows and existing.meta.get("loss_fraction") != LOSS_FRACTION:
        parser.error(f"--out {args.out}: its rows were measured with --loss-fraction "
                     f"{existing.meta.get('loss_fraction')}, this run has {LOSS_FRACTION}: use another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    # Before the first CUDA allocation: segments that grow in place, so that the search measures what the
    # passes hold rather than how the caching allocator's blocks happen to fragment.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
    init_distributed(args.tp, dry=args.dry_run, timeout_s=args.collective_timeout)
    results = run(args)
    if rank() == 0:
        print(results.summary(), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
