"""Where the host time of logits → loss goes, on one CUDA GPU.

    python scripts/profile_logits_host.py [--vocab 18992] [--config dapo|gspo|everything] [--calls 200]

Prints, for ``GRPOLoss.on_logits`` (one autograd Function) and for the two ops in turn: the host time of the
forward call and of ``loss.backward()`` apart (the GPU busy meanwhile, nothing synchronizes inside), and the
wall time per forward+backward; then what a floor of eager Python costs on this CPU — an empty autograd
Function forward+backward, one ``torch.empty``, one Triton launch through ``mp_grpo.ops.launcher`` — and
a cProfile of ``on_logits`` forward+backward sorted by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_loss import CONFIGS, N_TOKENS  # noqa: E402
from bench_loss import make_inputs as loss_inputs  # noqa: E402
from measure import host_us  # noqa: E402

from mp_grpo import vocab_parallel_logprobs  # noqa: E402
from mp_grpo.loss import GlobalBatch, GRPOLoss  # noqa: E402
from mp_grpo.ops.launcher import launch  # noqa: E402

SHORT = {"dapo": "dapo (ppo_clip, token_mean)", "gspo": "gspo + sequence TIS", "everything": "everything"}


def host_split(fwd, calls: int) -> tuple[float, float, float]:
    """(forward host µs, backward host µs, wall µs per forward+backward) over ``calls`` calls."""
    for _ in range(5):
        fwd().backward()
    torch.cuda.synchronize()
    t_fwd = t_bwd = 0.0
    start = time.perf_counter()
    for _ in range(calls):
        a = time.perf_counter()
        loss = fwd()
        b = time.perf_counter()
        loss.backward()
        t_fwd += b - a
        t_bwd += time.perf_counter() - b
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return 1e6 * t_fwd / calls, 1e6 * t_bwd / calls, 1e6 * wall / calls


class _Empty(torch.autograd.Function):
    """Forward and backward that launch nothing: what autograd itself costs per call."""

    @staticmethod
    def forward(ctx, x):
        return x.new_empty(())

    @staticmethod
    def backward(ctx, g):
        return None


def floors(calls: int) -> dict[str, float]:
    """Host µs of the pieces every eager logits → loss call pays at least once."""
    x = torch.zeros(8, device="cuda", requires_grad=True)
    out = {}

    def timed(fn) -> float:
        return host_us(fn, calls)

    def empty_function():
        torch.autograd.backward(_Empty.apply(x), grad_one)

    grad_one = torch.ones((), device="cuda")
    out["autograd Function fwd+bwd, no kernels"] = timed(empty_function)
    out["torch.empty (1 MB)"] = timed(lambda: torch.empty(1 << 18, device="cuda"))
    out["torch.add (one ATen launch)"] = timed(lambda: torch.add(x.detach(), 1.0))
    from mp_grpo.kernels.scale import scale_kernel
    from mp_grpo.ops.scale import SCALE_BLOCK, SCALE_WARPS

    buf = torch.zeros(1024, device="cuda")
    out["one Triton launch (mp_grpo launcher)"] = timed(lambda: launch(
        scale_kernel, (1,), buf, buf, grad_one, 1024, ACCUMULATE=False, BLOCK=SCALE_BLOCK, num_warps=SCALE_WARPS))
    return out


def phases(one_function, calls: int) -> None:
    """Host µs between points of one ``on_logits`` forward+backward (wrappers around its steps; ~1 µs each)."""
    import mp_grpo.ops.logits_grpo_loss as op

    marks: list[tuple[str, float]] = []

    def wrap(owner, name):
        original = getattr(owner, name)

        def wrapped(*a, **k):
            marks.append((f"{name} start", time.perf_counter()))
            out = original(*a, **k)
            marks.append((f"{name} end", time.perf_counter()))
            return out

        setattr(owner, name, wrapped)
        return original

    originals = {n: wrap(op, n) for n in ("shard_statistics", "gather_statistics", "loss_forward", "logprob_backward")}
    backward = op.LogitsGRPOLossFunction.backward

    def timed_backward(ctx, *grads):
        marks.append(("Function.backward start", time.perf_counter()))
        out = backward(ctx, *grads)
        marks.append(("Function.backward end", time.perf_counter()))
        return out

    op.LogitsGRPOLossFunction.backward = staticmethod(timed_backward)
    totals: dict[str, float] = {}
    try:
        for i in range(calls + 5):
            marks.clear()
            marks.append(("call", time.perf_counter()))
            loss = one_function()
            marks.append(("forward returned", time.perf_counter()))
            loss.backward()
            marks.append(("backward returned", time.perf_counter()))
            if i >= 5:
                for (a, ta), (b, tb) in zip(marks, marks[1:]):
                    totals[f"{a} -> {b}"] = totals.get(f"{a} -> {b}", 0.0) + tb - ta
        torch.cuda.synchronize()
    finally:
        for n, f in originals.items():
            setattr(op, n, f)
        op.LogitsGRPOLossFunction.backward = backward
    for step, total in totals.items():
        print(f"phase: {step}: {1e6 * total / calls:.1f} us")


def hops(calls: int, pairs: dict) -> None:
    """Host µs from ``torch.autograd.backward(out, grad)`` to the Function's backward starting, and from its end to
    ``backward`` returning — the autograd engine's hand-off to its CUDA device thread and back — for each
    ``name: (Function class, forward closure returning (output, grad))``."""
    for name, (cls, forward) in pairs.items():
        original = cls.backward
        stamps: list[float] = []

        def timed(ctx, *grads, _original=original, _stamps=stamps):
            _stamps.append(time.perf_counter())
            out = _original(ctx, *grads)
            _stamps.append(time.perf_counter())
            return out

        cls.backward = staticmethod(timed)
        into = out_of = 0.0
        try:
            for i in range(calls + 5):
                stamps.clear()
                output, grad = forward()
                start = time.perf_counter()
                torch.autograd.backward(output, grad)
                end = time.perf_counter()
                if i >= 5:
                    into += stamps[0] - start
                    out_of += end - stamps[1]
            torch.cuda.synchronize()
        finally:
            cls.backward = original
        print(f"engine hop: {name}: into backward {1e6 * into / calls:.1f} us, back out {1e6 * out_of / calls:.1f} us")


def capture(fn) -> None:
    """Capture ``fn`` (forward+backward) in a CUDA graph as bench_logprob does; print the traceback on failure."""
    import traceback

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn().backward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn().backward()
        graph.replay()
        torch.cuda.synchronize()
        print("capture: ok")
    except Exception:  # noqa: BLE001 - the point is to see it
        traceback.print_exc()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=18992)
    parser.add_argument("--config", default="dapo", choices=sorted(SHORT))
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--capture", action="store_true", help="only try a CUDA-graph capture of on_logits")
    args = parser.parse_args()
    cfg = CONFIGS[SHORT[args.config]]
    li = loss_inputs("padded")
    v = args.vocab
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(*li.logprobs.shape, v, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    logits.requires_grad_()
    target = torch.randint(0, v, li.logprobs.shape, device="cuda", generator=gen)
    use_entropy = cfg.needs_entropy
    rc = cfg.rollout_correction
    rollout = li.rollout if cfg.needs_rollout_logprobs or rc.weight_level is not None else None
    ref = li.ref if cfg.kl.coef != 0.0 else None
    batch = GlobalBatch.from_rollouts(cfg, [li.mask], old_logprobs=[li.old],
                                      rollout_logprobs=None if rollout is None else [rollout],
                                      entropies=[li.entropy] if use_entropy else None)
    loss_fn = GRPOLoss(cfg)

    def one_function():
        logits.grad = None
        return loss_fn.on_logits(logits, target, li.old, li.advantages, li.mask, rollout_logprobs=rollout,
                                 ref_logprobs=ref, batch=batch)[0]

    def two_ops():
        logits.grad = None
        out = vocab_parallel_logprobs(logits, target, with_entropy=use_entropy)
        lp, ent = out if use_entropy else (out, None)
        return loss_fn(lp, li.old, li.advantages, li.mask, rollout_logprobs=rollout, ref_logprobs=ref, entropy=ent,
                       batch=batch)[0]

    print(f"{torch.cuda.get_device_name()}, N = {N_TOKENS}, V = {v}, bf16, config {SHORT[args.config]}")
    if args.capture:
        capture(one_function)
        return
    for name, fn in (("on_logits (one Function)", one_function), ("two ops", two_ops)):
        f, b, w = host_split(fn, args.calls)
        print(f"{name}: host forward {f:.0f} us, host backward {b:.0f} us, wall per fwd+bwd {w:.0f} us")
    for name, us in floors(args.calls).items():
        print(f"floor: {name}: {us:.1f} us")
    phases(one_function, args.calls)
    from mp_grpo.ops.logits_grpo_loss import LogitsGRPOLossFunction
    from mp_grpo.ops.vocab_parallel_logprobs import VocabParallelLogProbs

    x = torch.zeros(8, device="cuda", requires_grad=True)
    one = torch.ones((), device="cuda")
    g_lp = torch.randn(target.shape, device="cuda")

    def op_alone():
        logits.grad = None
        return vocab_parallel_logprobs(logits, target), g_lp

    hops(args.calls, {
        "empty Function (8 floats)": (_Empty, lambda: (_Empty.apply(x), one)),
        "vocab_parallel_logprobs": (VocabParallelLogProbs, op_alone),
        "on_logits": (LogitsGRPOLossFunction, lambda: (one_function(), one)),
    })
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.calls):
        one_function().backward()
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).strip_dirs().sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
