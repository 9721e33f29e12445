"""Benchmark: output layer + token log-probs (+ the GRPO loss), fused (no logits) vs. the unfused paths, side by side.

Single GPU (default)::

    python scripts/bench_fused.py --out docs/benchmarks

  N = 16384 tokens, H = 4096, bf16, for V = 151936 and V = 18992 (one TP = 8 shard). For each
  implementation: median forward and forward+backward time (triton.testing.do_bench) and extra peak
  memory — the peak of one forward+backward beyond what was allocated before it (inputs, and the
  gradients of the previous step, which it frees and allocates again). Each row's figure against the bare
  matmuls (``fwd_bwd_vs_bare``; Liger's row aside) — and an fp32 row's against its bf16 counterpart
  (``fwd_bwd_vs_bf16``) — is the median of per-round ratios of their forward+backward timed in ``--rounds``
  interleaved rounds in one process (``measure.interleaved_ms`` / ``ratio_to``: bare, row, and back; CUDA events),
  with its distribution-free 95 % interval; separate medians minutes apart cannot resolve the few per cent these
  ratios are about. Implementations:

  - bare matmul ``h @ Wᵀ`` forward, its two backward GEMMs (3 GEMMs; no softmax): the time floor of
    any unfused output layer; its extra peak is the logits;
  - mp_grpo logits path: the output layer's GEMM as ``MegatronGRPO`` makes it (``batch_major_linear``) +
    ``vocab_parallel_logprobs(inplace_backward=True)``;
  - mp_grpo logits path + GRPOLoss (PPO clip, on-policy, 8 padded sequences);
  - mp_grpo ``fused_linear_loss`` + the same GRPOLoss: the loss's gradient made in forward (also into an
    fp32 ``main_grad``, and with the per-token op's 512 MiB chunks for comparison);
  - mp_grpo ``fused_linear_logprobs`` (also into an fp32 ``main_grad`` as under Megatron's
    gradient-accumulation fusion), alone and + GRPOLoss (PPO clip, and GSPO: sequence-level objectives
    take this recompute path);
  - the logits path and both fused ops again with ``logit_dtype=LogitDtype.FP32`` (logits kept in fp32 from
    the same bf16 operands), each with its prediction beside it (``scripts/fused_predictions.py``: the bf16 row
    of the same run plus a bytes model of what fp32 logits add, written before the first measurement);
  - Apple's cut-cross-entropy, ``linear_cross_entropy(..., reduction="none")`` (``scripts/cce_anchor.py``): the
    PyPI release as installed (impl ``cce``) and the repository's tree under ``.ext/ml-cross-entropy`` (impls
    ``cce`` and ``cce_exact``), each skipped with the reason when absent;
  - Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (chunked, torch.compile; computes its loss and
    gradients in forward), skipped and said so when liger-kernel is not installed.

  Precision beside speed and memory: each row that makes log-probs (not the bare matmuls, Liger or the
  main_grad / 512 MiB / loss variants of a row already measured) gives its max and mean abs. error against
  float64 logits of the same bf16 operands on the first ``PRECISION_ROWS`` tokens of its inputs.

  Before timing, both fused ops are checked against the float64 reference of ``tests/reference.py`` at
  a small size (the with-loss op also into an fp32 ``main_grad``). Results: ``fused.json``, ``fused.md``
  (table + one line per target: met or not, by how much) and ``fused.png``, rewritten after
  every row; the Liger rows (seconds each, plus torch.compile) run after all others. With ``--profile``
  also ``fused_profile_<V>.txt`` (kernel times of one forward+backward of the with-loss op).

  A subset of rows: ``--only KEY ...`` / ``--skip KEY ...`` with the keys of ``CASE_KEYS`` (bare, logits,
  logits_fp32, logits_loss, loss, loss_fp32, …, cce, cce_repo, cce_exact, liger) — each for every V, or ``KEY@V``
  for one (``--skip liger@151936`` drops the slowest row).

Tensor parallel (two GPUs, NCCL)::

    torchrun --nproc_per_node 2 scripts/bench_fused.py --tp 2 --out docs/benchmarks

  Each rank holds the full hidden states and its rows of W. A fixed number of iterations timed with
  CUDA events after a barrier (do_bench would pick a different count per rank): the fused op forward
  and forward+backward, the bare matmuls on the same shard, the op's one collective (the all-gather
  of the ``[N + 1, 4]`` statistics) alone, and the all-reduce of the ``[N, H]`` hidden gradient that
  Megatron's mapping adds after any column-parallel output layer (not part of the op). Then side by side
  on the same shards, each with its extra peak, log-prob error vs float64 and prediction: both fused ops at
  bf16 and fp32 logits (``fused_linear_loss`` with GRPOLoss) and the repository's cut-cross-entropy with
  ``VocabParallelOptions`` (``cce``, ``cce_exact``; hidden gradient left partial as mp_grpo leaves it). Results:
  ``fused_tp2.json``, ``fused_tp2.md``.

CPU check of this script (Triton's interpreter, tiny sizes, no timing worth reading; cut-cross-entropy through its
``torch_compile`` impl, its Triton impls needing CUDA)::

    python scripts/bench_fused.py --dry-run --out /tmp/fused
    torchrun --nproc_per_node 2 scripts/bench_fused.py --dry-run --tp 2 --out /tmp/fused

Needs torch, triton and matplotlib; megatron-core and omegaconf are not needed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mp_grpo.ops.fused_linear_logprobs import fused_linear_logprobs  # noqa: E402
from mp_grpo.ops.fused_linear_loss import fused_linear_loss  # noqa: E402
from mp_grpo.ops.output_chunks import plan_chunks  # noqa: E402
from tests.reference import linear_logprobs_reference  # noqa: E402
from tests.tolerances import tolerance  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cce_anchor  # noqa: E402
import fused_cases  # noqa: E402
import measure  # noqa: E402
from fused_cases import BASELINE, CASE_KEYS, cases, cce_module, logprob_fns, make_inputs, selected, tp_impls  # noqa: E402
from fused_predictions import predict  # noqa: E402
from fused_report import BARE, LIGER, print_compact, write_single_gpu_report, write_tp_report  # noqa: E402
from measure import GiB  # noqa: E402


def median_ms(fn) -> float:
    """Longer runs than the default: one matmul case takes tens of milliseconds."""
    return measure.median_ms(fn, warmup_ms=100, rep_ms=600)


def timed_ms(fn, iters: int) -> float:
    return measure.timed_ms(fn, iters)


def extra_peak_bytes(fn) -> int:
    return measure.extra_peak_bytes(fn)


PRECISION_ROWS = 1024
"""Tokens whose log-probs each row compares with float64 (their float64 logits: 1024 x V x 8 bytes)."""


def check_correctness(n: int = 1000, hidden_size: int = 256, v: int = 5000) -> float:
    """The fused op (several chunks each way) vs. the float64 reference; returns the worst error / tolerance."""
    h, w, t, g = make_inputs(n, hidden_size, v, seed=5, weight_std=0.2)  # logits of std ~1.6
    w.main_grad = torch.zeros(w.shape, device=fused_cases.DEVICE, dtype=torch.float32)
    lp, ent = fused_linear_logprobs(h, w, t, with_entropy=True, chunk_tokens=256, chunk_vocab=1024)
    (lp * g + ent * g).sum().backward()
    fused_linear_logprobs(h.detach(), w, t, chunk_tokens=300, accumulate_into_main_grad=True).backward(g)
    ref_h, ref_w = h.detach().cpu().double().requires_grad_(), w.detach().cpu().double().requires_grad_()
    lp_ref, ent_ref = linear_logprobs_reference(ref_h, ref_w, t.cpu(), logits_dtype=torch.bfloat16)
    (lp_ref * g.cpu().double() + ent_ref * g.cpu().double()).sum().backward()
    grad_w_ref = ref_w.grad.clone()
    ref_w.grad = None
    lp_only, _ = linear_logprobs_reference(ref_h.detach(), ref_w, t.cpu(), logits_dtype=torch.bfloat16)
    (lp_only * g.cpu().double()).sum().backward()

    def ratio(actual, expected, dtype, scale=1.0):
        tol = tolerance(dtype)
        err = (actual.detach().cpu().double() - expected) / scale
        return (err.abs() / (tol["atol"] + tol["rtol"] * (expected / scale).abs())).max().item()

    # Values: bf16 tolerance — cuBLAS rounds its fp32 accumulator to bf16 logits, the reference rounds the
    # exact product, and a logit near a rounding boundary lands one bf16 ulp apart. Gradients are sums of
    # bf16-rounded terms: compared on their largest entry.
    worst = max(
        ratio(lp, lp_ref, torch.bfloat16),
        ratio(ent, ent_ref, torch.bfloat16),
        ratio(h.grad, ref_h.grad, torch.bfloat16, ref_h.grad.abs().max().item()),
        ratio(w.grad, grad_w_ref, torch.bfloat16, grad_w_ref.abs().max().item()),
        ratio(w.main_grad, ref_w.grad, torch.bfloat16, ref_w.grad.abs().max().item()),
    )
    # The with-loss op: a token-separable loss, several row chunks, upstream gradient 0.5, GPU kernels and cuBLAS.
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    device = fused_cases.DEVICE
    coef = torch.randn(n, device=device, generator=torch.Generator(device=device).manual_seed(6))

    def loss_fn(lp, ent):
        return (torch.exp(lp) * coef + lp * g).sum() - (ent * g).sum(), None

    loss, _ = fused_linear_loss(h2, w2, t, loss_fn, with_entropy=True, chunk_tokens=300, check_inputs=True)
    loss.backward(torch.tensor(0.5, device=fused_cases.DEVICE))
    ref_h.grad = ref_w.grad = None
    lp_ref2, ent_ref2 = linear_logprobs_reference(ref_h, ref_w, t.cpu(), logits_dtype=torch.bfloat16)
    c64, g64 = coef.cpu().double(), g.cpu().double()
    ref_loss = (torch.exp(lp_ref2) * c64 + lp_ref2 * g64).sum() - (ent_ref2 * g64).sum()
    (ref_loss * 0.5).backward()
    # Under gradient-accumulation fusion: the same, added into an fp32 main_grad by backward's scale kernel.
    w3 = w.detach().clone().requires_grad_()
    w3.main_grad = torch.zeros(w3.shape, device=fused_cases.DEVICE, dtype=torch.float32)
    w3.grad_added_to_main_grad = False
    loss3, _ = fused_linear_loss(h.detach(), w3, t, loss_fn, with_entropy=True, chunk_tokens=300,
                                 accumulate_into_main_grad=True)
    loss3.backward(torch.tensor(0.5, device=fused_cases.DEVICE))
    with_loss = max(
        ratio(loss, ref_loss, torch.float32, ref_loss.abs().item()),
        ratio(h2.grad, ref_h.grad, torch.bfloat16, ref_h.grad.abs().max().item()),
        ratio(w2.grad, ref_w.grad, torch.bfloat16, ref_w.grad.abs().max().item()),
        ratio(w3.main_grad, ref_w.grad, torch.bfloat16, ref_w.grad.abs().max().item()),
    )
    print(f"correctness vs float64 reference (N={n}, H={hidden_size}, V={v}, several chunks each way): "
          f"worst error / tolerance = {worst:.3f} (per-token op), {with_loss:.3f} (fused_linear_loss)", flush=True)
    return max(worst, with_loss)


PROFILE_ITERS = 3
"""Forward+backward calls per profile (back to back, as do_bench runs them)."""


def profile_with_loss(n: int, hidden_size: int, v: int, out: Path) -> None:
    """Where the with-loss op's time goes, against the bare matmuls, into ``fused_profile_<V>.txt``.

    For the bare matmuls and the with-loss op: the host time to issue one forward+backward (CPU only, the
    GPU idle at the start: if it is well below the GPU time the GPU never waits on the host), the kernel
    time of ``PROFILE_ITERS`` back-to-back calls summed over kernels (torch.profiler, CUDA activity) and the
    wall time of the same calls (CUDA events): wall minus kernel time is time the GPU spent idle. Then the
    with-loss op's kernels grouped by name: GEMMs, the epilogue, statistics, loss, backward's scaling."""
    import time

    from torch.profiler import ProfilerActivity, profile

    lines, tables = [f"V = {v}, N = {n}, H = {hidden_size}, bf16; {PROFILE_ITERS} forward+backward calls each", ""], []
    for key in ("bare", "loss", "loss_fp32"):
        name, build = cases(n, hidden_size, v)[key]
        _, fwd_bwd = build()
        fwd_bwd()
        torch.cuda.synchronize()
        issue = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fwd_bwd()
            issue.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start.record()
            for _ in range(PROFILE_ITERS):
                fwd_bwd()
            end.record()
            torch.cuda.synchronize()
        events = prof.key_averages()
        kernel_ms = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3
        wall_ms = start.elapsed_time(end)
        lines.append(
            f"{name}: host issue time {sorted(issue)[2]:.2f} ms per call (median of 5); per call: kernel time "
            f"{kernel_ms / PROFILE_ITERS:.2f} ms, wall {wall_ms / PROFILE_ITERS:.2f} ms, GPU idle "
            f"{(wall_ms - kernel_ms) / PROFILE_ITERS:.2f} ms"
        )
        if key != "bare":
            tables.append(f"{name}, kernels over {PROFILE_ITERS} calls:\n" + events.table(
                sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
        del build, fwd_bwd, prof, events
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n\n" + "\n".join(tables)
    (out / f"fused_profile_{v}.txt").write_text(text)
    print(text, flush=True)


def reference_logprobs(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, group=None) -> torch.Tensor:
    """float64 log-probs of ``t`` from float64 logits of the same bf16 operands (``w`` this rank's shard: the shards'
    float64 logits are all-gathered over ``group``)."""
    z = h.double() @ w.double().t()
    if group is not None and dist.get_world_size(group) > 1:
        parts = [torch.empty_like(z) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, z.contiguous(), group=group)
        z = torch.cat(parts, -1)
    return torch.log_softmax(z, -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)


def logprob_errors(key: str, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, ref: torch.Tensor,
                   group=None) -> dict:
    """Max and mean abs. error of row ``key``'s log-probs on the first PRECISION_ROWS tokens vs ``ref``."""
    rows = ref.shape[0]
    with torch.no_grad():
        lp = logprob_fns()[key](h[:rows].detach(), w.detach(), t[:rows], group)
    err = (lp.double() - ref).abs()
    return {"logprob_max_abs": err.max().item(), "logprob_mean_abs": err.mean().item()}


def run_single_gpu(args) -> dict:
    """Every selected row; the slow Liger rows after all others. The report is rewritten after every row (a run
    stopped at its time limit keeps what it measured)."""
    worst = check_correctness(**({"n": 24, "hidden_size": 16, "v": 120} if args.dry_run else {}))
    assert worst <= 1.0, f"the fused op disagrees with the float64 reference: worst error / tolerance = {worst:.3f}"
    n, hidden_size = args.tokens, args.hidden
    for key in (args.only or []) + (args.skip or []):
        if key.split("@")[0] not in CASE_KEYS:
            raise SystemExit(f"--only / --skip: unknown row {key!r}; rows: {', '.join(CASE_KEYS)} (optionally KEY@V)")
    jobs = [(v, key) for slow in (False, True) for v in args.vocab for key in CASE_KEYS
            if (key == "liger") == slow and selected(key, v, args.only, args.skip)]
    result = {
        "device": device_name(), "torch": torch.__version__, "tokens": n, "hidden": hidden_size,
        "correctness_worst_error_over_tolerance": worst, "precision_rows": min(PRECISION_ROWS, n),
        "command": " ".join(["python scripts/bench_fused.py", *sys.argv[1:]]),
        "rows": [],
    }
    for v in args.vocab:
        print(f"V = {v}: chunk plan {plan_chunks(n, hidden_size, v, torch.bfloat16)}", flush=True)
    references = {}
    for i, (v, key) in enumerate(jobs):
        if args.profile and key == "liger" and not (i and jobs[i - 1][1] == "liger"):
            profile_all(args)  # before the slow rows: a run stopped at its time limit keeps the profiles
        empty_cache()
        name, build = cases(n, hidden_size, v)[key]
        row = {"case": name, "key": key, "N": n, "H": hidden_size, "V": v}
        fwd = fwd_bwd = None
        try:
            fwd, fwd_bwd = build()
            row["extra_peak_GiB"] = extra_peak_bytes(fwd_bwd) / GiB
            row["fwd_ms"] = median_ms(fwd)
            row["fwd_bwd_ms"] = median_ms(fwd_bwd)
            if key not in NOT_INTERLEAVED:
                row.update(interleaved_ratios(key, fwd_bwd, n, hidden_size, v, args.rounds))
            if key.startswith("cce"):
                row["cce_version"] = cce_module(key).__version__
            if key in logprob_fns():
                if v not in references:
                    h, w, t, _ = make_inputs(n, hidden_size, v)
                    rows = min(PRECISION_ROWS, n)
                    references[v] = reference_logprobs(h[:rows].detach(), w.detach(), t[:rows])
                    del h, w, t
                h, w, t, _ = make_inputs(n, hidden_size, v)
                row.update(logprob_errors(key, h, w, t, references[v]))
                del h, w, t
        except (ImportError, cce_anchor.Unavailable) as err:
            row["skipped"] = f"not installed: {err}" if isinstance(err, ImportError) else str(err)
        except Exception as err:  # a baseline that fails is reported, not hidden
            traceback.print_exc()
            row["error"] = repr(err)[:300]
        baseline = next((r for r in result["rows"] if r["V"] == v and r["key"] == BASELINE.get(key)), None)
        row["predicted"] = predict(key, n, hidden_size, v, baseline)
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
        result["rows"].sort(key=lambda r: (args.vocab.index(r["V"]), CASE_KEYS.index(r["key"])))
        add_ratios(result)
        last_fast = i + 1 == len(jobs) or jobs[i + 1][1] == "liger"
        write_single_gpu_report(result, args.out, plot=last_fast or i + 1 == len(jobs))
        del build, fwd, fwd_bwd
    if args.profile and not any(key == "liger" for _, key in jobs):
        profile_all(args)
    return result


NOT_INTERLEAVED = ("bare", "liger")
"""Rows without an interleaved ratio: the base itself, and Liger's (seconds a call, a ratio of ~10)."""


def interleaved_ratios(key: str, fwd_bwd, n: int, hidden_size: int, v: int, rounds: int) -> dict:
    """``key``'s forward+backward against the bare matmuls' (and an fp32 row's against its bf16 row's), timed in
    ``rounds`` interleaved rounds: the median per-round ratios with their 95 % intervals, the rounds' times."""
    all_cases = cases(n, hidden_size, v)
    calls = {"bare": all_cases["bare"][1]()[1], key: fwd_bwd}
    if key in BASELINE:
        calls[BASELINE[key]] = all_cases[BASELINE[key]][1]()[1]
    times = measure.interleaved_ms(calls, rounds, warmup=1, timer=round_timer)
    out = {"rounds": rounds, "rounds_fwd_bwd_ms": times,
           "fwd_bwd_vs_bare_interval": measure.ratio_to(times[key], times["bare"]).as_dict()}
    if key in BASELINE:
        out["fwd_bwd_vs_bf16_interval"] = measure.ratio_to(times[key], times[BASELINE[key]]).as_dict()
    del calls
    empty_cache()
    return out


round_timer = measure.cuda_event_ms
"""How one call of the interleaved rounds is timed (the dry run: the host clock)."""


def profile_all(args) -> None:
    torch.cuda.empty_cache()
    for v in args.vocab:
        profile_with_loss(args.tokens, args.hidden, v, args.out)


def add_ratios(result: dict) -> None:
    """Per row: fwd+bwd time relative to the bare matmuls — the interleaved rounds' median ratio where the row has
    them, else the ratio of the two medians (Liger's) —, an fp32 row's relative to its bf16 row (interleaved), and
    Liger's time relative to it."""
    for v in {r["V"] for r in result["rows"]}:
        rows = {r["case"]: r for r in result["rows"] if r["V"] == v and "fwd_bwd_ms" in r}
        for r in rows.values():
            if "fwd_bwd_vs_bare_interval" in r:
                r["fwd_bwd_vs_bare"] = r["fwd_bwd_vs_bare_interval"]["median"]
            elif BARE in rows:
                r["fwd_bwd_vs_bare"] = r["fwd_bwd_ms"] / rows[BARE]["fwd_bwd_ms"]
            if "fwd_bwd_vs_bf16_interval" in r:
                r["fwd_bwd_vs_bf16"] = r["fwd_bwd_vs_bf16_interval"]["median"]
            if LIGER in rows:
                r["liger_fwd_bwd_over_this"] = rows[LIGER]["fwd_bwd_ms"] / r["fwd_bwd_ms"]


# ----------------------------------------------------------------------------- tensor parallel
def run_tensor_parallel(args) -> dict:
    if args.dry_run:
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != args.tp:
        raise SystemExit(f"--tp {args.tp} under torchrun with {world} ranks: start it with --nproc_per_node {args.tp}")
    group = dist.group.WORLD
    rows = []
    for v in args.vocab:
        n, hidden_size, v_local = args.tokens, args.hidden, v // world
        h, w_full, t, g = make_inputs(n, hidden_size, v_local * world)
        w = w_full.detach()[rank * v_local : (rank + 1) * v_local].clone().requires_grad_()
        del w_full
        grad_logits = torch.randn(n, v_local, device=fused_cases.DEVICE, dtype=torch.bfloat16)
        stats = torch.zeros(n + 1, 4, device=fused_cases.DEVICE)
        gathered = torch.empty(world * (n + 1), 4, device=fused_cases.DEVICE)

        def fused_fwd():
            with torch.no_grad():
                fused_linear_logprobs(h, w, t, tp_group=group, check_inputs=False)

        def fused_fwd_bwd():
            h.grad = w.grad = None
            fused_linear_logprobs(h, w, t, tp_group=group, check_inputs=False).backward(g)

        def bare_fwd():
            with torch.no_grad():
                h @ w.t()

        def bare_fwd_bwd():
            h.grad = w.grad = None
            (h @ w.t()).backward(grad_logits)

        def stats_all_gather():
            dist.all_gather_into_tensor(gathered, stats, group=group)

        def grad_hidden_all_reduce():
            dist.all_reduce(h.grad, group=group)

        row = {
            "tp": world, "N": n, "H": hidden_size, "V": v, "V_local": v_local,
            "fused_fwd_ms": timed_ms(fused_fwd, args.iters),
            "fused_fwd_bwd_ms": timed_ms(fused_fwd_bwd, args.iters),
            "bare_fwd_ms": timed_ms(bare_fwd, args.iters),
            "bare_fwd_bwd_ms": timed_ms(bare_fwd_bwd, args.iters),
            "stats_all_gather_ms": timed_ms(stats_all_gather, args.iters),
            "grad_hidden_all_reduce_ms": timed_ms(grad_hidden_all_reduce, args.iters),
        }
        del grad_logits
        empty_cache()
        row["fused_extra_peak_GiB"] = extra_peak_bytes(fused_fwd_bwd) / GiB
        row["fused_fwd_bwd_vs_bare"] = row["fused_fwd_bwd_ms"] / row["bare_fwd_bwd_ms"]
        row["all_gather_frac_of_fused_fwd"] = row["stats_all_gather_ms"] / row["fused_fwd_ms"]
        row["impls"] = tp_side_by_side(args, h, w, t, g, group, n, v)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, row)
        if rank == 0:
            for r in per_rank:
                print(json.dumps(r), flush=True)
            rows.append({"per_rank": per_rank})
        del h, w, t, g, stats, gathered
        empty_cache()
    return {"device": device_name(), "torch": torch.__version__, "tp": world, "tokens": args.tokens,
            "hidden": args.hidden, "iters": args.iters, "precision_rows": min(PRECISION_ROWS, args.tokens),
            "rows": rows}


def tp_side_by_side(args, h, w, t, g, group, n: int, v: int) -> list[dict]:
    """``TP_IMPLS`` on this rank's shard: fwd / fwd+bwd (fixed iteration counts: every rank runs the same calls),
    extra peak, log-prob error vs float64 on the first PRECISION_ROWS tokens, and the prediction. A row that fails
    on one rank fails on all (the same call everywhere), so no rank waits on a collective the others skip."""
    rows_ref = min(PRECISION_ROWS, n)
    ref = reference_logprobs(h[:rows_ref].detach(), w.detach(), t[:rows_ref], group)
    out = []
    world = dist.get_world_size(group)
    for key, (name, build) in tp_impls(h, w, t, g, group, n).items():
        empty_cache()
        r = {"key": key, "case": name}
        fwd = fwd_bwd = None
        try:
            fwd, fwd_bwd = build()
            r["fwd_ms"] = timed_ms(fwd, args.iters)
            r["fwd_bwd_ms"] = timed_ms(fwd_bwd, args.iters)
            r["extra_peak_GiB"] = extra_peak_bytes(fwd_bwd) / GiB
            if key.startswith("cce"):
                r["cce_version"] = cce_module(key).__version__
            if key in logprob_fns():
                r.update(logprob_errors(key, h, w, t, ref, group))
        except cce_anchor.Unavailable as err:
            r["skipped"] = str(err)
        except Exception as err:
            traceback.print_exc()
            r["error"] = repr(err)[:300]
        h.grad = w.grad = None
        del fwd, fwd_bwd
        baseline = next((x for x in out if x["key"] == BASELINE.get(key)), None)
        r["predicted"] = predict(key, n, h.shape[1], w.shape[0], baseline, tp=world)
        out.append(r)
    bare = next((x for x in out if x["key"] == "bare" and "fwd_bwd_ms" in x), None)
    for r in out:
        if bare is not None and "fwd_bwd_ms" in r:
            r["fwd_bwd_vs_bare"] = r["fwd_bwd_ms"] / bare["fwd_bwd_ms"]
    return out


def device_name() -> str:
    return "CPU dry run" if fused_cases.DEVICE == "cpu" else torch.cuda.get_device_name()


def empty_cache() -> None:
    if fused_cases.DEVICE == "cuda":
        torch.cuda.empty_cache()


def dry_run(args) -> None:
    """``--dry-run``: the CPU, tiny sizes, every measurement one untimed call (a check of this script)."""
    global median_ms, timed_ms, extra_peak_bytes, round_timer
    import time

    def once_ms(fn, *_args) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    fused_cases.DEVICE, fused_cases.CCE_IMPL_OVERRIDE = "cpu", "torch_compile"
    median_ms, timed_ms, round_timer = once_ms, once_ms, once_ms
    extra_peak_bytes = lambda fn: (fn(), 0)[1]  # noqa: E731
    cce_anchor.run_without_compile()
    args.tokens, args.hidden, args.vocab, args.iters, args.profile, args.rounds = 32, 32, [256, 128], 1, False, 2
    fused_cases.SUPPORT_IDS, fused_cases.TOP_K_IDS = 8, 4  # the interpreter loops over every id


# ----------------------------------------------------------------------------- reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 18992])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=20,
                        help="interleaved rounds of each row's forward+backward against the bare matmuls'")
    parser.add_argument("--profile", action="store_true", help="also profile the with-loss op's kernels per V")
    parser.add_argument("--only", nargs="+", metavar="ROW", help=f"run only these rows: KEY (every V) or KEY@V; keys: "
                        f"{', '.join(CASE_KEYS)} (ratios need the bare row)")
    parser.add_argument("--skip", nargs="+", metavar="ROW", help="leave these rows out (KEY or KEY@V), e.g. liger@151936")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny sizes: check the script")
    args = parser.parse_args()
    if args.dry_run:
        dry_run(args)
    elif not torch.cuda.is_available():
        sys.exit("bench_fused.py needs a CUDA GPU (or --dry-run)")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.tp > 1:
        result = run_tensor_parallel(args)
        if dist.get_rank() == 0:
            write_tp_report(result, args.out)
        dist.destroy_process_group()
    else:
        result = run_single_gpu(args)
        write_single_gpu_report(result, args.out)
        print_compact(result)


if __name__ == "__main__":
    main()
