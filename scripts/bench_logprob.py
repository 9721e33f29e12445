"""Benchmark: token log-probs from bf16 logits, mp_grpo vs. the libraries it replaces, side by side.

Single GPU (default)::

    python scripts/bench_logprob.py --out docs/benchmarks

  For each V in --vocab (default 151936 and 18992, N = 16384): median forward and forward+backward
  time (triton.testing.do_bench), extra peak memory (beyond the inputs and one gradient buffer) and
  the fraction of the memory floor: forward must read the logits once, forward+backward must read
  them twice and write a bf16 gradient once, at the copy bandwidth measured in the same run.
  Baselines: torch log_softmax(fp32)+gather, megatron-core vocab_parallel_cross_entropy and
  fused_vocab_parallel_cross_entropy, Liger-Kernel's LigerVocabParallelCEFunction and
  triton_grpo_loss, Transformer Engine's parallel_cross_entropy (each skipped, and said so, when its
  package is missing). Our rows: the op unchecked (``CheckInputs.OFF``), checked (the default,
  ``DEFERRED``: no host read) and ``SYNC`` (one host read per call); and logits -> loss —
  ``GRPOLoss(vocab_parallel_logprobs(logits))`` with default arguments, ``loss.backward()`` timed as a
  training step calls it (host time included) — for the three configs of ``bench_loss.py`` (DAPO
  token-mean; GSPO + sequence TIS + seq-mean-token-mean; "everything"). For our rows also: the host
  time of one forward+backward call (perf_counter, no synchronization inside the timed calls) and the
  CUDA-graph replay of the same forward+backward (captured with default arguments). Our rows run with
  ``mp_grpo.ops.launcher``'s fast launch on (the default on CUDA) and again with it off (Triton's
  ``kernel[grid]`` path: columns *normal launch*), same inputs, same run. ``--only`` keeps the cases whose
  name contains one of the given strings. The report ends with one met / not-met line per target (memory floor, speed-ups over the baselines, extra memory).

Tensor parallel (any number of ranks, 1 included)::

    torchrun --nproc_per_node 2 scripts/bench_logprob.py --out docs/benchmarks

  The global vocabulary split over the ranks (NCCL). A fixed number of iterations timed with CUDA
  events after a barrier (do_bench would pick a different count on each rank): the statistics
  kernel alone, the all-gather alone, the whole forward and forward+backward; megatron-core's
  vocab_parallel_cross_entropy on the same shards for comparison. Each run writes
  ``logprob_tp<N>.{json,md}`` and redraws ``logprob_tp_scaling.png`` from every ``logprob_tp*.json``
  in ``--out`` (time per rank vs. TP size).

``--sweep`` times launch configurations of the kernels instead (used to pick
``mp_grpo/kernels/launch_config.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mp_grpo.ops.logprob_launch as logprob_launch  # noqa: E402
from mp_grpo.ops import launcher  # noqa: E402
from mp_grpo import CheckInputs, GlobalBatch, GRPOLoss, vocab_parallel_logprobs  # noqa: E402
from mp_grpo.kernels import logprob_launch_config  # noqa: E402
from tests.reference import logprobs_reference  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import GiB, copy_bandwidth, extra_peak_bytes, graph_replay_ms, host_us, median_ms, timed_ms  # noqa: E402

# ----------------------------------------------------------------------------- the cases
def make_inputs(n: int, v: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(n, v, device="cuda", generator=gen) * 3).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=gen)
    g = torch.randn(n, device="cuda", generator=gen)
    return x, t, g


def _fwd_and_fwd_bwd(x, f, *grads):
    """(forward-only closure, forward+backward closure) for f() returning a tensor or a tuple."""

    def fwd():
        with torch.no_grad():
            f()

    def fwd_bwd():
        x.grad = None
        out = f()
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, grads[: len(outs)])

    return fwd, fwd_bwd


def cases(n: int, v: int):
    """name -> builder returning (fwd, fwd_bwd); builders import their library lazily."""

    def ours(with_entropy: bool, check_inputs: CheckInputs):
        def build():
            x, t, g = make_inputs(n, v)
            g2 = torch.randn_like(g)
            return _fwd_and_fwd_bwd(
                x, lambda: vocab_parallel_logprobs(x, t, with_entropy=with_entropy, check_inputs=check_inputs), g, g2
            )

        return build

    def torch_log_softmax():
        x, t, g = make_inputs(n, v)
        return _fwd_and_fwd_bwd(x, lambda: torch.log_softmax(x.float(), -1).gather(-1, t[:, None]).squeeze(-1), g)

    def torch_with_entropy():
        x, t, g = make_inputs(n, v)
        g2 = torch.randn_like(g)

        def f():
            logp = torch.log_softmax(x.float(), -1)
            return logp.gather(-1, t[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

        return _fwd_and_fwd_bwd(x, f, g, g2)

    def megatron_ce():
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        x, t, g = make_inputs(n, v)
        return _fwd_and_fwd_bwd(x, lambda: -vocab_parallel_cross_entropy(x.view(n, 1, v), t.view(n, 1)).view(n), g)

    def megatron_fused_ce():
        from megatron.core import parallel_state
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

        x, t, g = make_inputs(n, v)
        group = parallel_state.get_tensor_model_parallel_group()
        return _fwd_and_fwd_bwd(
            x, lambda: -fused_vocab_parallel_cross_entropy(x.view(n, 1, v), t.view(n, 1), group).view(n), g
        )

    def liger_vocab_parallel_ce():
        from liger_kernel.ops.vocab_parallel_cross_entropy import LigerVocabParallelCEFunction

        x, t, g = make_inputs(n, v)
        return _fwd_and_fwd_bwd(
            x,
            lambda: -LigerVocabParallelCEFunction.apply(
                x.view(n, 1, v), t.view(n, 1), None, -100, 0.0, "pytorch", "global"
            ).view(n),
            g,
        )

    def liger_grpo():
        """Liger's single-pass GRPO kernel (logits -> loss, NOT tensor-parallel): [B, L + 1, V] logits."""
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

        b = 8
        length = n // b
        gen = torch.Generator(device="cuda").manual_seed(1)
        x = (torch.randn(b, length + 1, v, device="cuda", generator=gen) * 3).to(torch.bfloat16).requires_grad_()
        ids = torch.randint(0, v, (b, length), device="cuda", generator=gen)
        old = -torch.rand(b, length, device="cuda", generator=gen) * 5
        adv = torch.randn(b, device="cuda", generator=gen)
        mask = torch.ones(b, length, device="cuda", dtype=torch.int32)
        f = lambda: triton_grpo_loss(  # noqa: E731
            x, old, None, ids, adv, mask, temperature=1.0, beta=0.0, inplace=False, reduce=True
        )[0]
        return _fwd_and_fwd_bwd(x, f, torch.ones((), device="cuda"))

    def transformer_engine_ce():
        # Importing megatron-core first (run_single_gpu does): it probes for TE when imported.
        from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy

        x, t, g = make_inputs(n, v)
        return _fwd_and_fwd_bwd(
            x, lambda: -parallel_cross_entropy(x.view(n, 1, v), t.view(n, 1), 0.0, False, None).view(n), g
        )

    def logits_to_loss(cfg_name: str, one_function: bool):
        """``one_function``: ``GRPOLoss.on_logits`` (one autograd Function); else the two ops in turn."""

        def build():
            from bench_loss import CONFIGS, N_TOKENS
            from bench_loss import make_inputs as loss_inputs

            if n != N_TOKENS:
                raise ImportError(f"bench_loss's inputs are {N_TOKENS} tokens, not {n}")
            cfg = CONFIGS[cfg_name]
            x, t, _ = make_inputs(n, v)
            li = loss_inputs("padded")
            rc = cfg.rollout_correction
            use_rollout = (rc.weight_level is not None or rc.reject_level is not None or cfg.opsm.delta is not None
                           or cfg.mismatch.skip_threshold is not None)
            use_ref = cfg.kl.coef != 0.0
            use_entropy = cfg.entropy.bonus_coef != 0.0 or cfg.entropy.top_quantile < 1.0
            rollout = li.rollout if use_rollout else None
            batch = GlobalBatch.from_rollouts(
                cfg, [li.mask], old_logprobs=[li.old], rollout_logprobs=None if rollout is None else [rollout],
                entropies=[li.entropy] if use_entropy else None)
            loss_fn = GRPOLoss(cfg)  # AUTO: the fused Triton loss on CUDA tensors

            target = t.view_as(li.logprobs)

            def f():
                if one_function:
                    # The [B, T, V] view made inside the call: a view kept across calls keeps its autograd node
                    # (and that node's stream) alive, which breaks CUDA-graph capture of the backward.
                    logits = x.view(*li.logprobs.shape, v)
                    loss, _ = loss_fn.on_logits(logits, target, li.old, li.advantages, li.mask, rollout_logprobs=rollout,
                                                ref_logprobs=li.ref if use_ref else None, batch=batch)
                    return loss
                ent = None
                if use_entropy:
                    lp, ent = vocab_parallel_logprobs(x, t, with_entropy=True)
                    ent = ent.view_as(li.entropy)
                else:
                    lp = vocab_parallel_logprobs(x, t)
                loss, _ = loss_fn(lp.view_as(li.logprobs), li.old, li.advantages, li.mask, rollout_logprobs=rollout,
                                  ref_logprobs=li.ref if use_ref else None, entropy=ent, batch=batch)
                return loss

            return _fwd_and_fwd_bwd(x, f, torch.ones((), device="cuda"))

        return build

    return {
        "mp_grpo vocab_parallel_logprobs unchecked (OFF)": ours(False, CheckInputs.OFF),
        "mp_grpo vocab_parallel_logprobs checked (default DEFERRED)": ours(False, CheckInputs.DEFERRED),
        "mp_grpo vocab_parallel_logprobs check_inputs=SYNC (1 host read)": ours(False, CheckInputs.SYNC),
        "mp_grpo vocab_parallel_logprobs +entropy (default)": ours(True, CheckInputs.DEFERRED),
        "mp_grpo logits->loss DAPO token-mean": logits_to_loss("dapo (ppo_clip, token_mean)", True),
        "mp_grpo logits->loss GSPO + seq TIS": logits_to_loss("gspo + sequence TIS", True),
        "mp_grpo logits->loss everything": logits_to_loss("everything", True),
        "mp_grpo logits->loss DAPO token-mean, two ops": logits_to_loss("dapo (ppo_clip, token_mean)", False),
        "mp_grpo logits->loss GSPO + seq TIS, two ops": logits_to_loss("gspo + sequence TIS", False),
        "mp_grpo logits->loss everything, two ops": logits_to_loss("everything", False),
        "torch log_softmax(fp32)+gather": torch_log_softmax,
        "torch log_softmax(fp32)+gather +entropy": torch_with_entropy,
        "megatron-core vocab_parallel_cross_entropy": megatron_ce,
        "megatron-core fused_vocab_parallel_cross_entropy": megatron_fused_ce,
        "Liger LigerVocabParallelCEFunction": liger_vocab_parallel_ce,
        "Liger triton_grpo_loss (not TP-aware)": liger_grpo,
        "TE parallel_cross_entropy": transformer_engine_ce,
    }


def check_correctness(n: int = 512, v: int = 18992) -> float:
    """Our kernel vs. the float64 reference at a small size, before timing anything."""
    x, t, g = make_inputs(n, v, seed=5)
    lp, ent = vocab_parallel_logprobs(x, t, with_entropy=True)
    lp_ref, ent_ref = logprobs_reference(x.detach().cpu(), t.cpu())
    return max((lp.cpu().double() - lp_ref).abs().max().item(), (ent.cpu().double() - ent_ref).abs().max().item())


def run_single_gpu(args) -> dict:
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    try:
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(1)
    except ImportError:
        print("megatron-core not installed: its cases are skipped")
    err = check_correctness()
    print(f"correctness at N=512, V=18992: max |diff| from float64 = {err:.2e}")
    assert err < 1e-3, err
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.3f} TB/s")
    rows = []
    for v in args.vocab:
        n = args.tokens
        floor_fwd_ms = n * v * 2 / bw * 1e3
        floor_fb_ms = 3 * n * v * 2 / bw * 1e3
        grad_bytes = n * v * 2
        for name, build in cases(n, v).items():
            if args.only and not any(part in name for part in args.only):
                continue
            torch.cuda.empty_cache()
            row = {"case": name, "N": n, "V": v}
            try:
                fwd, fwd_bwd = build()
                extra = extra_peak_bytes(fwd_bwd)
                row.update(
                    fwd_ms=median_ms(fwd),
                    fwd_bwd_ms=median_ms(fwd_bwd),
                    extra_peak_GiB=extra / GiB,
                    extra_peak_bytes_per_row=extra / n,
                    grad_bytes=grad_bytes,
                )
                row["fwd_floor_frac"] = floor_fwd_ms / row["fwd_ms"]
                row["fwd_bwd_floor_frac"] = floor_fb_ms / row["fwd_bwd_ms"]
                if name.startswith("mp_grpo"):
                    row["fast_launch"] = launcher.fast_launch_enabled()
                    row["host_us"] = host_us(fwd_bwd)
                    if launcher.FAST_LAUNCH_AVAILABLE:  # the same call through Triton's own launch path
                        launcher.set_fast_launch(False)
                        try:
                            row["host_us_normal_launch"] = host_us(fwd_bwd)
                            row["fwd_bwd_ms_normal_launch"] = median_ms(fwd_bwd)
                        finally:
                            launcher.set_fast_launch(True)
                    if "SYNC" not in name:
                        try:
                            row["graph_ms"] = graph_replay_ms(fwd_bwd)
                            row["graph_floor_frac"] = floor_fb_ms / row["graph_ms"]
                        except Exception as err:  # not capturable: reported, not hidden
                            traceback.print_exc()
                            row["graph_error"] = repr(err)[:300]
                    mp_grpo_check_errors()
            except ImportError as err:
                row["skipped"] = f"not installed: {err}"
            except Exception as err:  # a baseline that fails is reported, not hidden
                traceback.print_exc()
                row["error"] = repr(err)[:300]
            print(json.dumps(row), flush=True)
            rows.append(row)
            del build
    import triton

    result = {"device": torch.cuda.get_device_name(), "copy_TBps": bw / 1e12, "tokens": args.tokens, "rows": rows,
              "torch": torch.__version__, "triton": triton.__version__, "fast_launch": launcher.FAST_LAUNCH_REASON}
    result["summary"] = targets_summary(result)
    return result


def mp_grpo_check_errors() -> None:
    import mp_grpo

    mp_grpo.check_errors()  # the benchmark's inputs are valid: nothing may be pending


LOSS_ROWS = ("mp_grpo logits->loss DAPO token-mean", "mp_grpo logits->loss GSPO + seq TIS",
             "mp_grpo logits->loss everything")
FLOOR_TARGET = 0.90
HOST_TARGET_US = 100.0
CHECK_COST_TARGET = 0.03


def targets_summary(result: dict) -> list[str]:
    """One met / not-met line per target, from this run's rows."""

    def floor_fb(r: dict) -> float:
        return r["fwd_bwd_floor_frac"] * r["fwd_bwd_ms"]  # the floor in ms
    rows = {(r["case"], r["V"]): r for r in result["rows"]}
    vocabs = sorted({r["V"] for r in result["rows"]}, reverse=True)
    lines = []
    for v in vocabs:
        for case in LOSS_ROWS:
            r = rows.get((case, v), {})
            if "fwd_bwd_ms" not in r:
                lines.append(f"{case}, V={v}: not measured ({r.get('error') or r.get('skipped')})")
                continue
            frac, host = r["fwd_bwd_floor_frac"], r["host_us"]
            floor_verdict = "MET" if frac >= FLOOR_TARGET else f"NOT MET by {100 * (FLOOR_TARGET - frac):.0f} points"
            host_verdict = "MET" if host <= HOST_TARGET_US else f"NOT MET ({host / HOST_TARGET_US:.1f}x)"
            graph = (f"CUDA graph replay {r['graph_ms']:.3f} ms = {100 * r['graph_floor_frac']:.0f} % of the floor"
                     if "graph_ms" in r else f"graph: {r.get('graph_error')}")
            normal = (f" (normal launch: {r['host_us_normal_launch']:.0f} us, "
                      f"{100 * floor_fb(r) / r['fwd_bwd_ms_normal_launch']:.0f} % of the floor)"
                      if "host_us_normal_launch" in r else "")
            lines.append(
                f"{case}, V={v}: {100 * frac:.0f} % of the memory floor (target >= {100 * FLOOR_TARGET:.0f} %): "
                f"{floor_verdict}; host {host:.0f} us per fwd+bwd call (target <= {HOST_TARGET_US:.0f} us): "
                f"{host_verdict}{normal}; {graph}"
            )
        off = rows.get(("mp_grpo vocab_parallel_logprobs unchecked (OFF)", v), {})
        on = rows.get(("mp_grpo vocab_parallel_logprobs checked (default DEFERRED)", v), {})
        if "fwd_bwd_ms" in off and "fwd_bwd_ms" in on:
            cost = on["fwd_bwd_ms"] / off["fwd_bwd_ms"] - 1.0
            lines.append(f"checking costs nothing, V={v}: default checked {on['fwd_bwd_ms']:.3f} ms vs unchecked "
                         f"{off['fwd_bwd_ms']:.3f} ms ({100 * cost:+.1f} %, target within {100 * CHECK_COST_TARGET:.0f} %): "
                         f"{'MET' if cost <= CHECK_COST_TARGET else 'NOT MET'}")
        graphed = [r for (c, vv), r in rows.items() if vv == v and c.startswith("mp_grpo") and "SYNC" not in c]
        bad = [r["case"] for r in graphed if "graph_ms" not in r]
        lines.append(f"CUDA-graph capturable with default arguments, V={v}: "
                     + ("MET (every mp_grpo row captured and replayed)" if graphed and not bad else f"NOT MET: {bad}"))
    return lines


# ----------------------------------------------------------------------------- tensor parallel
def run_tensor_parallel(args) -> dict:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    try:
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(world)
        group = parallel_state.get_tensor_model_parallel_group()
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    except ImportError:
        vocab_parallel_cross_entropy = None
    rows = []
    for v in args.vocab:
        n, v_local = args.tokens, v // world
        gen = torch.Generator(device="cuda").manual_seed(0)
        full = (torch.randn(n, v, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        x = full[:, rank * v_local : (rank + 1) * v_local].contiguous().requires_grad_()
        t = torch.randint(0, v_local * world, (n,), device="cuda", generator=gen)
        g = torch.randn(n, device="cuda", generator=gen)
        del full
        stats = logprob_launch.new_stats_buffer(n, x.device)
        gathered = torch.empty(world, n + 1, 4, device="cuda")

        def stats_kernel():
            logprob_launch.shard_statistics(
                x.detach(), t, stats, vocab_start=rank * v_local, inv_temperature=1.0, with_entropy=False
            )

        def all_gather():
            dist.all_gather_into_tensor(gathered.view(-1, 4), stats, group=group)

        def fwd():
            with torch.no_grad():
                vocab_parallel_logprobs(x, t, tp_group=group, check_inputs=False)

        def fwd_bwd():
            x.grad = None
            vocab_parallel_logprobs(x, t, tp_group=group, check_inputs=False).backward(g)

        row = {
            "tp": world, "N": n, "V": v, "V_local": v_local,
            "stats_kernel_ms": timed_ms(stats_kernel, args.iters, group),
            "all_gather_ms": timed_ms(all_gather, args.iters, group),
            "fwd_ms": timed_ms(fwd, args.iters, group),
            "fwd_bwd_ms": timed_ms(fwd_bwd, args.iters, group),
        }
        row["all_gather_frac_of_fwd"] = row["all_gather_ms"] / row["fwd_ms"]
        if vocab_parallel_cross_entropy is not None:
            x.grad = None

            def mc_fwd():
                with torch.no_grad():
                    vocab_parallel_cross_entropy(x.view(n, 1, v_local), t.view(n, 1))

            def mc_fwd_bwd():
                x.grad = None
                (-vocab_parallel_cross_entropy(x.view(n, 1, v_local), t.view(n, 1))).view(n).backward(g)

            row["megatron_ce_fwd_ms"] = timed_ms(mc_fwd, args.iters, group)
            row["megatron_ce_fwd_bwd_ms"] = timed_ms(mc_fwd_bwd, args.iters, group)
        all_rows = [None] * world
        dist.all_gather_object(all_rows, row)
        if rank == 0:
            for r in all_rows:
                print(json.dumps(r), flush=True)
            rows.append({"per_rank": all_rows})
        del x, stats, gathered
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "tp": world, "tokens": args.tokens, "iters": args.iters, "rows": rows}


# ----------------------------------------------------------------------------- launch-config sweep
def run_sweep(args) -> dict:
    """Time each kernel alone under several (BLOCK_V, num_warps), and the whole forward with each."""
    rows = []
    bw = copy_bandwidth()
    configs = [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]
    for v in args.vocab:
        n = args.tokens
        x, t, g = make_inputs(n, v)
        stats = logprob_launch.new_stats_buffer(n, x.device)
        base = logprob_launch_config(v)
        lp = vocab_parallel_logprobs(x, t)
        for block, warps in configs:
            for part in ("stats", "stats+entropy", "forward", "backward"):
                field = ("backward_block_v", "backward_warps") if part == "backward" else ("stats_block_v", "stats_warps")
                cfg = replace(base, **{field[0]: block, field[1]: warps})
                logprob_launch.logprob_launch_config = lambda _v, cfg=cfg: cfg
                try:
                    if part.startswith("stats"):
                        fn = lambda ent=part.endswith("entropy"): logprob_launch.shard_statistics(  # noqa: E731
                            x.detach(), t, stats, vocab_start=0, inv_temperature=1.0, with_entropy=ent
                        )
                        bytes_moved = n * v * 2
                    elif part == "forward":
                        fn = lambda: vocab_parallel_logprobs(x.detach(), t)  # noqa: E731
                        bytes_moved = n * v * 2
                    else:
                        def fn():
                            x.grad = None
                            torch.autograd.backward(lp, g, retain_graph=True)

                        bytes_moved = 2 * n * v * 2
                    ms = median_ms(fn)
                    row = {"V": v, "part": part, "block_v": block, "warps": warps, "ms": ms,
                           "floor_frac": bytes_moved / bw * 1e3 / ms}
                except Exception as err:
                    row = {"V": v, "part": part, "block_v": block, "warps": warps, "error": repr(err)[:200]}
                finally:
                    logprob_launch.logprob_launch_config = logprob_launch_config
                print(json.dumps(row), flush=True)
                rows.append(row)
        del x, stats, lp
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "copy_TBps": bw / 1e12, "rows": rows}


# ----------------------------------------------------------------------------- reports
def write_single_gpu_report(result: dict, out: Path) -> None:
    (out / "logprob.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Token log-probs from bf16 logits — {result['device']}",
        "",
        f"N = {result['tokens']} tokens; copy bandwidth measured in the same run: {result['copy_TBps']:.2f} TB/s. "
        "Floor: forward reads the logits once; forward+backward reads them twice and writes the bf16 gradient "
        "once. Extra peak: memory beyond the inputs and one gradient buffer. mp_grpo rows run with "
        "the check mode the row names (the default is `CheckInputs.DEFERRED`: no host read). logits->loss rows: "
        "`GRPOLoss(cfg).on_logits(logits, target, ...)` (one autograd Function) with default arguments and "
        "`loss.backward()`; *two ops*: `GRPOLoss(cfg)(vocab_parallel_logprobs(logits, target), ...)`; the loss "
        "fused (Triton), a GlobalBatch built beforehand; same floor as the op. *host us*: CPU time to issue one "
        "forward+backward call. *graph*: the same forward+backward captured in a CUDA graph, median replay. "
        "*normal launch*: the same mp_grpo row with `mp_grpo.ops.launcher`'s fast launch off (Triton's "
        f"`kernel[grid]`), same run. torch {result.get('torch')}, triton {result.get('triton')}; fast launch: "
        f"{result.get('fast_launch')}. Command: `python scripts/bench_logprob.py --out docs/benchmarks"
        + (f" --only {' '.join(repr(x) for x in result['only'])}" if result.get("only") else "") + "`.",
        "",
        *(f"- {line}" for line in result.get("summary", [])),
        "",
        "| implementation | V | fwd ms | fwd+bwd ms | extra peak | % of floor fwd / fwd+bwd | host us | graph ms (% floor) "
        "| normal launch: fwd+bwd ms (% floor) / host us |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "fwd_ms" in r:
            extra = f"{r['extra_peak_GiB']:.2f} GiB" if r["extra_peak_GiB"] >= 0.01 else f"{r['extra_peak_bytes_per_row']:.0f} B/row"
            host = f"{r['host_us']:.0f}" if "host_us" in r else ""
            graph = (f"{r['graph_ms']:.3f} ({100 * r['graph_floor_frac']:.0f})" if "graph_ms" in r
                     else (f"failed: {r['graph_error'][:60]}" if "graph_error" in r else ""))
            normal = (f"{r['fwd_bwd_ms_normal_launch']:.3f} "
                      f"({100 * r['fwd_bwd_floor_frac'] * r['fwd_bwd_ms'] / r['fwd_bwd_ms_normal_launch']:.0f}) / "
                      f"{r['host_us_normal_launch']:.0f}" if "host_us_normal_launch" in r else "")
            lines.append(
                f"| {r['case']} | {r['V']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {extra} | "
                f"{100 * r['fwd_floor_frac']:.0f} / {100 * r['fwd_bwd_floor_frac']:.0f} | {host} | {graph} | {normal} |"
            )
        else:
            why = (r.get("skipped") or r.get("error"))[:100]
            lines.append(f"| {r['case']} | {r['V']} | — | — | — | {why} | | | |")
    (out / "logprob.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot_single_gpu(result, out / "logprob.png")


def plot_single_gpu(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vocabs = sorted({r["V"] for r in result["rows"]}, reverse=True)
    fig, axes = plt.subplots(1, len(vocabs), figsize=(7 * len(vocabs), 4.5))
    axes = [axes] if len(vocabs) == 1 else axes
    for ax, v in zip(axes, vocabs):
        rows = [r for r in result["rows"] if r["V"] == v and "fwd_ms" in r]
        names = [r["case"].replace("vocab_parallel", "vp").replace("mp_grpo ", "mp_grpo\n") for r in rows]
        ax.barh(names, [r["fwd_bwd_ms"] for r in rows], color=["tab:green" if "mp_grpo" in r["case"] else "tab:gray" for r in rows])
        floor = 3 * result["tokens"] * v * 2 / (result["copy_TBps"] * 1e12) * 1e3
        ax.axvline(floor, color="tab:red", linestyle="--", label=f"memory floor {floor:.2f} ms")
        ax.set_xlabel("forward + backward, median ms")
        ax.set_title(f"N = {result['tokens']}, V = {v}, bf16 ({result['device']})")
        ax.invert_yaxis()
        ax.legend(loc="lower right")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_tp_report(result: dict, out: Path) -> None:
    tp = result["tp"]
    (out / f"logprob_tp{tp}.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Tensor-parallel log-probs, TP = {tp} — {result['device']}",
        "",
        f"N = {result['tokens']}, bf16, the global vocabulary split over {tp} ranks (NCCL). Median of {result['iters']} "
        "iterations timed with CUDA events after a barrier, per rank. Command: "
        f"`torchrun --nproc_per_node {tp} scripts/bench_logprob.py --out docs/benchmarks`.",
        "",
        "| V | V_local | rank | stats kernel ms | all-gather ms | fwd ms | all-gather / fwd | fwd+bwd ms | megatron-core CE fwd / fwd+bwd ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in result["rows"]:
        for rank, r in enumerate(entry["per_rank"]):
            mc = f"{r['megatron_ce_fwd_ms']:.3f} / {r['megatron_ce_fwd_bwd_ms']:.3f}" if "megatron_ce_fwd_ms" in r else "—"
            lines.append(
                f"| {r['V']} | {r['V_local']} | {rank} | {r['stats_kernel_ms']:.3f} | {r['all_gather_ms']:.3f} | "
                f"{r['fwd_ms']:.3f} | {100 * r['all_gather_frac_of_fwd']:.1f} % | {r['fwd_bwd_ms']:.3f} | {mc} |"
            )
    (out / f"logprob_tp{tp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot_tp_scaling(out: Path) -> None:
    """Per-rank time vs. TP size, from every logprob_tp*.json in ``out`` (rank 0's numbers; ranks agree)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = sorted((json.loads(p.read_text()) for p in out.glob("logprob_tp*.json")), key=lambda r: r["tp"])
    if not results:
        return
    vocabs = sorted({e["per_rank"][0]["V"] for r in results for e in r["rows"]}, reverse=True)
    fig, axes = plt.subplots(1, len(vocabs), figsize=(6 * len(vocabs), 4.2))
    axes = [axes] if len(vocabs) == 1 else axes
    for ax, v in zip(axes, vocabs):
        rows = [(r["tp"], e["per_rank"][0]) for r in results for e in r["rows"] if e["per_rank"][0]["V"] == v]
        tps = [tp for tp, _ in rows]
        for key, label in [("fwd_bwd_ms", "forward + backward"), ("fwd_ms", "forward"),
                           ("stats_kernel_ms", "statistics kernel"), ("all_gather_ms", "all-gather [N+1, 4]")]:
            ax.plot(tps, [r[key] for _, r in rows], marker="o", label=label)
        if all("megatron_ce_fwd_bwd_ms" in r for _, r in rows):
            ax.plot(tps, [r["megatron_ce_fwd_bwd_ms"] for _, r in rows], marker="x", linestyle="--",
                    label="megatron-core CE forward + backward")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(tps, [str(t) for t in tps])
        ax.set_xlabel("tensor-parallel size")
        ax.set_ylabel("ms per rank (median)")
        ax.set_title(f"N = {results[0]['tokens']}, V = {v} split over TP ranks ({results[0]['device']})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "logprob_tp_scaling.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 18992])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--only", nargs="+", default=None, help="keep only the cases whose name contains one of these")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        result = run_sweep(args)
        (args.out / "logprob_sweep.json").write_text(json.dumps(result, indent=1))
    elif "LOCAL_RANK" in os.environ:  # started by torchrun: the tensor-parallel benchmark
        result = run_tensor_parallel(args)
        if dist.get_rank() == 0:
            write_tp_report(result, args.out)
            plot_tp_scaling(args.out)
    else:
        result = run_single_gpu(args)
        result["only"] = args.only
        write_single_gpu_report(result, args.out)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
