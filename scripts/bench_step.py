"""Benchmark: a Qwen2.5-shaped GRPO step on one GPU — mp_grpo against the no-loss floor and the common path.

    python scripts/bench_step.py --out docs/benchmarks

megatron-core GPTModel (local layer spec, bf16, ``Float16Module``, Megatron DDP with fp32 gradient buffers) in
the Qwen2.5-1.5B and -0.5B shapes (``step_model.SHAPES``; V = 151936, tied embeddings), rows of 2048 and 8192
tokens, selective and full activation recompute. The paths (``step_paths``): ``floor`` (the decoder alone;
the bare output-layer matmuls timed apart and added), ``common`` (verl's Megatron path: fp32 logits,
megatron-core's ``vocab_parallel_cross_entropy``, a torch PPO loss), mp_grpo's ``logits`` and ``fused`` paths,
and on request ``logits_model_layer`` (the logits path on GPTModel's own output layer, before the batch-major
layer). Rows, each for every path:

- ``train``: one training ``forward_backward_func`` (forward, loss, backward, ``finalize_model_grads``) of one
  micro-batch of 8192 tokens (4 × 2048 or 1 × 8192): median time over ``--iters`` steps after ``--warmup``
  (CUDA events, ``measure.timed_ms``), peak allocated memory of one step (weights and gradients included), and
  the largest micro-batch B that fits (``--search``);
- ``forward``: the forward-only log-prob pass (old / reference policy) of the same micro-batch under
  ``no_grad`` (floor: decoder forward + the output matmul), same three figures;
- ``step`` (``--step-configs``, default the 1.5B shape at 2048): a whole GRPO step of ``--step-micro-batches``
  micro-batches — the forward-only pass (old log-probs), the training pass on them, megatron-core's Adam step
  (fp32 master weights) — time and peak.

The max-micro-batch search (``measure.largest_fitting``): probes run one step (or pass) at B and catch the
out-of-memory error (``measure.fits_in_memory``: everything freed and the cache emptied between probes). The
first probe is 2·B₀; the line through the peaks at B₀ and 2·B₀ predicts the largest B that fits in the free
memory, which is probed next; then steps of 1, 2, 4, … and bisection. Capped at ``--max-tokens``.

Resumable: rows already in ``<out>/step.json`` are skipped (``--force`` measures them again); ``--shape``,
``--seq``, ``--recompute``, ``--rows`` (``KIND`` or ``KIND:PATH``) and ``--paths`` select; the configurations run
in the order 1.5B @ 2048 (selective, full), 0.5B @ 2048, 1.5B @ 8192, 0.5B @ 8192. ``--time-budget`` stops
starting new rows after that many seconds. The JSON and ``step.md`` are rewritten after every row, ``step.png``
at the end. ``--profile KIND:PATH ...`` (for ``--profile-configs``) writes ``step_profile.txt``: per pass the host
time to issue it, its kernel time against its wall time (GPU idle), its memory statistics and its top kernels. Before timing, the loss paths are checked to give the same gradients on a tiny model
(``check_paths``).

Needs a CUDA GPU, megatron-core, torch, triton, matplotlib.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path as FilePath

import torch

sys.path.insert(0, str(FilePath(__file__).resolve().parents[1]))
sys.path.insert(0, str(FilePath(__file__).resolve().parent))

from measure import GiB, fits_in_memory, largest_fitting, median_ms, peak_bytes, timed_ms  # noqa: E402
from step_model import SHAPES, Recompute, gpu_rig, synthetic_micro_batches  # noqa: E402
from step_paths import Path, forward_pass, grpo_step, output_matmuls, training_pass  # noqa: E402
from step_report import PLAN, Results, row_key, write_reports  # noqa: E402

DEVICE = "cuda"
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


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def init_distributed() -> None:
    """One process: a process group of size 1 (NCCL) and megatron-core's parallel_state at TP = 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=1)


def cleanup() -> None:
    """Free what the last pass left: megatron-core's global memory buffer (the local attention writes its S × S
    scores there, and the buffer keeps the largest size ever asked for: without this a probe at a large B
    would stay resident through every later row), garbage cycles, the caching allocator's free blocks."""
    import gc

    from megatron.core import parallel_state as ps

    if ps._GLOBAL_MEMORY_BUFFER is not None:
        ps.get_global_memory_buffer().buffer.clear()
    gc.collect()
    torch.cuda.empty_cache()


def release_optimizer(rig, optimizer) -> None:
    """Drop megatron-core's Adam and its fp32 master weights (each model parameter keeps one as ``main_param``)."""
    for param in rig.model.parameters():
        if hasattr(param, "main_param"):
            del param.main_param
    del optimizer
    rig.zero_grad()
    cleanup()


def release_rig(rig) -> None:
    """Free the model: Megatron DDP keeps its gradient hooks' nodes (which hold it) in ``grad_accs``."""
    getattr(rig.model, "grad_accs", []).clear()
    rig.model = None
    cleanup()


def resting_gib() -> float:
    cleanup()
    return torch.cuda.memory_allocated() / GiB


# ------------------------------------------------------------------------------------------------ check
def check_paths(seq: int = 128, batch: int = 2) -> float:
    """The loss paths on the tiny shape: the same objective, so the same gradients (relative L2 against the
    common path's, bf16 tolerance). Returns the worst error."""
    rig = gpu_rig(SHAPES["tiny"], Recompute.SELECTIVE, seq_len=seq)
    micro = synthetic_micro_batches(2, batch, seq, rig.vocab, seed=3, device=DEVICE)
    grads = {}
    for path in (Path.COMMON, Path.LOGITS, Path.FUSED, Path.LOGITS_MODEL_LAYER):
        rig.zero_grad()
        training_pass(rig, path, micro)()
        grads[path] = torch.cat([p.main_grad.flatten().double() for p in rig.model.parameters()])
    ref = grads.pop(Path.COMMON)
    errors = {path.value: float((g - ref).norm() / ref.norm()) for path, g in grads.items()}
    log(f"check: gradients of the loss paths vs the common path on the tiny model, relative L2: {errors}")
    worst = max(errors.values())
    if not worst <= CHECK_RTOL:
        raise SystemExit(f"check failed: a loss path's gradients differ from the common path's by {worst:.3e}")
    del rig
    cleanup()
    return worst


# ------------------------------------------------------------------------------------------------ rows
def pass_closure(rig, kind: str, path: Path, micro):
    return (training_pass if kind == "train" else forward_pass)(rig, path, micro)


def time_row(rig, kind: str, path: Path, seq: int, args) -> dict:
    """Median time and peak of one pass on the timing micro-batch (floor: + the output matmuls)."""
    b0 = max(1, TIMING_TOKENS // seq)
    micro = synthetic_micro_batches(1, b0, seq, rig.vocab, seed=11, device=DEVICE)
    run = pass_closure(rig, kind, path, micro)
    row = {"B": b0, "tokens": b0 * seq, "resting_GiB": resting_gib(),
           "ms": timed_ms(run, args.iters, warmup=args.warmup + (kind == "forward"))}
    row["peak_bytes"] = peak_bytes(run)
    row["peak_GiB"] = row["peak_bytes"] / GiB
    del run
    cleanup()
    if path == Path.FLOOR:
        matmuls = output_matmuls(b0 * seq, rig.hidden, rig.vocab, backward=kind == "train", device=DEVICE)
        row["decoder_ms"] = row["ms"]
        row["matmul_ms"] = median_ms(matmuls, warmup_ms=50, rep_ms=200)
        row["ms"] = row["decoder_ms"] + row["matmul_ms"]
        del matmuls
        cleanup()
    return row


def memory_model_guess(b0: int, p0: int, b1: int, p1: int | None, *, usable: int, base: int) -> int:
    """The largest B whose peak stays within ``usable`` bytes: on the line through the peaks (B₀, p₀) and (B₁, p₁)
    when both were measured (B₁ ≠ B₀), else on the line from the resting memory ``base`` (B = 0) through (B₀, p₀)."""
    if p1 is not None and b1 != b0:
        slope = (p1 - p0) / (b1 - b0)
        return int(b0 + (usable - p0) / max(slope, 1.0))
    return int(b0 * (usable - base) / max(p0 - base, 1.0))


def search_row(rig, kind: str, path: Path, seq: int, row: dict, args) -> dict:
    """The largest micro-batch of ``seq``-token rows that fits (see the module docstring)."""
    start = time.monotonic()
    limit = max(1, args.max_tokens // seq)
    b0, p0 = row["B"], row["peak_bytes"]
    peaks: dict[int, int] = {b0: p0}

    def fits(b: int) -> bool:
        micro = synthetic_micro_batches(1, b, seq, rig.vocab, seed=13, device=DEVICE)
        resting = resting_gib()
        ok, peak = fits_in_memory(pass_closure(rig, kind, path, micro))
        log(f"  probe {kind}/{path.value} B = {b}: {'fits' if ok else 'out of memory'}"
            + (f", peak {peak / GiB:.2f} GiB" if ok else "") + f" (resting {resting:.2f} GiB)")
        if ok:
            peaks[b] = peak
        return ok

    base = int(resting_gib() * GiB)
    usable = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()
    b1 = min(2 * b0, limit)
    known_fit, known_failure = b0, None
    if b1 > b0:
        if fits(b1):
            known_fit = b1
        else:
            known_failure = b1
    guess = memory_model_guess(b0, p0, known_fit, peaks.get(known_fit), usable=usable, base=base)
    search = largest_fitting(fits, guess, limit=limit, known_fit=known_fit, known_failure=known_failure)
    out = {"max_B": search.largest, "max_tokens": search.largest * seq, "first_failure_B": search.first_failure,
           "guess_B": guess, "probes": [[b0, True]] + ([[b1, known_fit == b1]] if b1 > b0 else []) + search.probes,
           "search_s": time.monotonic() - start, "search_limit_tokens": args.max_tokens}
    if search.largest in peaks:
        out["peak_GiB_at_max"] = peaks[search.largest] / GiB
    return out


PROFILE_STEPS = 3
"""Steps per profile (back to back, as the timed rows run them)."""


def profile_row(rig, kind: str, path: Path, seq: int) -> str:
    """Where one pass's time goes: the host time to issue it, the summed kernel time of ``PROFILE_STEPS`` passes
    (torch.profiler, CUDA activity) against their wall time (the difference: the GPU idle), the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    b0 = max(1, TIMING_TOKENS // seq)
    micro = synthetic_micro_batches(1, b0, seq, rig.vocab, seed=11, device=DEVICE)
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
    text = (f"### {kind} / {path.value}, B = {b0} x S = {seq}\n"
            f"host time to issue one pass {issue_ms:.1f} ms; per pass: kernel time {kernel_ms:.1f} ms, wall {wall_ms:.1f} ms, "
            f"GPU idle {wall_ms - kernel_ms:.1f} ms\n"
            f"memory of one pass: peak allocated {stats['allocated_bytes.all.peak'] / GiB:.2f} GiB, peak reserved "
            f"{stats['reserved_bytes.all.peak'] / GiB:.2f} GiB, allocations {stats['allocation.all.allocated']}, "
            f"allocator retries {stats['num_alloc_retries']}\n\n"
            + events.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=80) + "\n")
    del run, prof, events
    cleanup()
    return text


def step_row(rig, path: Path, seq: int, optimizer, args) -> dict:
    b0 = max(1, TIMING_TOKENS // seq)
    micro = synthetic_micro_batches(args.step_micro_batches, b0, seq, rig.vocab, seed=17, device=DEVICE)
    run = grpo_step(rig, path, micro, optimizer)
    row = {"B": b0, "micro_batches": len(micro), "tokens": b0 * seq * len(micro), "resting_GiB": resting_gib(),
           "ms": timed_ms(run, args.iters, warmup=args.warmup)}
    row["peak_bytes"] = peak_bytes(run)
    row["peak_GiB"] = row["peak_bytes"] / GiB
    del run
    cleanup()
    if path == Path.FLOOR:  # per micro-batch: the forward pass's matmul and the training pass's three
        tokens = b0 * seq
        fwd = median_ms(output_matmuls(tokens, rig.hidden, rig.vocab, backward=False, device=DEVICE), rep_ms=200)
        cleanup()
        fwd_bwd = median_ms(output_matmuls(tokens, rig.hidden, rig.vocab, backward=True, device=DEVICE), rep_ms=200)
        cleanup()
        row["decoder_ms"] = row["ms"]
        row["matmul_ms"] = len(micro) * (fwd + fwd_bwd)
        row["ms"] = row["decoder_ms"] + row["matmul_ms"]
    return row


# ------------------------------------------------------------------------------------------------ driver
def selected(kind: str, path: Path, rows: list[str] | None) -> bool:
    return rows is None or kind in rows or f"{kind}:{path.value}" in rows


def run(args) -> Results:
    results = Results.load(args.out / "step.json")
    results.start(command=" ".join(["python scripts/bench_step.py", *sys.argv[1:]]))
    deadline = time.monotonic() + args.time_budget
    paths = [Path(p) for p in args.paths]
    configs = [(s, q, r) for s, q, r in PLAN if s in args.shape and q in args.seq and r in args.recompute]
    configs += [(s, q, r) for s in args.shape for q in args.seq for r in args.recompute
                if (s, q, r) not in configs]  # shapes or lengths outside the plan (the tiny smoke test)
    if args.check:
        results.meta["check_worst_relative_l2"] = check_paths()
    for shape_name, seq, recompute in configs:
        shape = SHAPES[shape_name]
        step_here = f"{shape_name}@{seq}" in args.step_configs
        todo = [(kind, path) for kind in KINDS for path in paths if selected(kind, path, args.rows)
                and (kind != "step" or step_here) and (kind != "forward" or recompute == FORWARD_RECOMPUTE)
                and (args.force or not results.complete(row_key(shape_name, seq, recompute, kind, path),
                                                        search=args.search and kind != "step"))]
        profiles = [spec for spec in args.profile or [] if f"{shape_name}@{seq}@{recompute}" in args.profile_configs]
        if not todo and not profiles:
            continue
        if time.monotonic() > deadline:
            log("time budget reached: rerun the same command to continue")
            break
        log(f"=== {shape_name} @ {seq}, {recompute} recompute: {len(todo)} rows (resting {resting_gib():.2f} GiB) ===")
        rig = gpu_rig(shape, Recompute(recompute), seq_len=seq)
        # --- 1. times and peaks at the timing micro-batch (cheap) ---
        for kind, path in todo:
            key = row_key(shape_name, seq, recompute, kind, path)
            if kind == "step" or (not args.force and "ms" in results.row(key)) or time.monotonic() > deadline:
                continue
            row = time_row(rig, kind, path, seq, args)
            results.update(key, row)
            log(f"{kind:<8} {path.value:<18} {row['ms']:9.2f} ms  peak {row['peak_GiB']:6.2f} GiB "
                f"(resting {row['resting_GiB']:.2f} GiB)")
            write_reports(results, args.out, plot=False)
        # --- 2. profiles ---
        for spec in profiles:
            kind, _, path = spec.partition(":")
            if time.monotonic() > deadline:
                break
            text = profile_row(rig, kind, Path(path), seq)
            with open(args.out / "step_profile.txt", "a") as f:
                f.write(f"## {shape_name} @ {seq}, {recompute} recompute ({results.meta.get('device')})\n{text}\n")
            log(text.splitlines()[1])
        # --- 3. the largest micro-batches (before the optimizer exists: its state is no part of these rows) ---
        if args.search:
            for kind, path in todo:
                key = row_key(shape_name, seq, recompute, kind, path)
                if kind == "step" or "ms" not in results.row(key) or (not args.force and "max_B" in results.row(key)):
                    continue
                if time.monotonic() > deadline:
                    break
                found = search_row(rig, kind, path, seq, results.row(key), args)
                results.update(key, found)
                log(f"{kind:<8} {path.value:<18} max B = {found['max_B']} ({found['max_tokens']} tokens), "
                    f"{len(found['probes'])} probes, {found['search_s']:.0f} s")
                write_reports(results, args.out, plot=False)
        # --- 4. whole GRPO steps with megatron-core's optimizer ---
        step_todo = [path for kind, path in todo if kind == "step"]
        if step_todo and time.monotonic() < deadline:
            from mp_grpo.megatron.gpt import megatron_optimizer

            optimizer = megatron_optimizer(rig.model, lr=1e-6, clip_grad=1.0, bf16=True)
            for path in step_todo:
                if time.monotonic() > deadline:
                    break
                row = step_row(rig, path, seq, optimizer, args)
                results.update(row_key(shape_name, seq, recompute, "step", path), row)
                log(f"step     {path.value:<18} {row['ms']:9.2f} ms  peak {row['peak_GiB']:6.2f} GiB")
                write_reports(results, args.out, plot=False)
            release_optimizer(rig, optimizer)
            del optimizer
        release_rig(rig)
        del rig
    write_reports(results, args.out, plot=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=FilePath, default=FilePath("docs/benchmarks"))
    parser.add_argument("--shape", nargs="+", default=["1.5b", "0.5b"], choices=sorted(SHAPES))
    parser.add_argument("--seq", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--recompute", nargs="+", default=[r.value for r in Recompute], choices=[r.value for r in Recompute])
    parser.add_argument("--rows", nargs="+", metavar="KIND[:PATH]", help=f"kinds {', '.join(KINDS)}, optionally :path")
    parser.add_argument("--paths", nargs="+", default=[p.value for p in DEFAULT_PATHS], choices=[p.value for p in Path])
    parser.add_argument("--step-configs", nargs="*", default=["1.5b@2048"], metavar="SHAPE@SEQ")
    parser.add_argument("--step-micro-batches", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3, help="timed steps per row (median)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=2**19, help="the search's cap on a micro-batch's tokens")
    parser.add_argument("--no-search", dest="search", action="store_false")
    parser.add_argument("--no-check", dest="check", action="store_false")
    parser.add_argument("--force", action="store_true", help="measure rows already in step.json again")
    parser.add_argument("--profile", nargs="+", metavar="KIND:PATH", help="profile these passes (step_profile.txt)")
    parser.add_argument("--profile-configs", nargs="*", default=["1.5b@2048@selective"], metavar="SHAPE@SEQ@RECOMPUTE")
    parser.add_argument("--time-budget", type=float, default=float("inf"), help="seconds; no new row starts after")
    args = parser.parse_args()
    for spec in args.rows or []:
        kind, _, path = spec.partition(":")
        if kind not in KINDS or (path and path not in [p.value for p in Path]):
            parser.error(f"--rows: {spec!r} is not KIND or KIND:PATH (kinds {', '.join(KINDS)})")
    for spec in args.profile or []:
        kind, _, path = spec.partition(":")
        if kind not in ("train", "forward") or path not in [p.value for p in Path]:
            parser.error(f"--profile: {spec!r} is not KIND:PATH with KIND train or forward")
    args.out.mkdir(parents=True, exist_ok=True)
    # Before the first CUDA allocation: segments that grow in place, so that the search measures what the
    # passes hold rather than how the caching allocator's blocks happen to fragment.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
    init_distributed()
    results = run(args)
    print(results.summary(), flush=True)


if __name__ == "__main__":
    main()
