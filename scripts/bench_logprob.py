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
from logprob_report import plot_tp_scaling, targets_summary, write_single_gpu_report, write_tp_report  # noqa: E402

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
