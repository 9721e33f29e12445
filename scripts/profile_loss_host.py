"""Where the host time of one fused GRPOLoss call goes (cProfile), on one CUDA GPU.

    python scripts/profile_loss_host.py [--config dapo|everything] [--calls 200]

The fused loss's GPU work for 16384 tokens is a few microseconds per kernel, so its cost in a step is
the CPU time to issue it. This prints the wall time per call with ``mp_grpo.ops.launcher``'s fast launch
off and on (same inputs, same run), then the functions that take the time with it on, forward + backward.
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

from bench_loss import CONFIGS, loss_call, make_inputs, make_loss  # noqa: E402

from mp_grpo.loss import GlobalBatch  # noqa: E402
from mp_grpo.ops import launcher  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="dapo (ppo_clip, token_mean)", choices=sorted(CONFIGS))
    parser.add_argument("--layout", default="padded", choices=["padded", "packed"])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    cfg = CONFIGS[args.config]
    x = make_inputs(args.layout)
    batch = GlobalBatch.from_rollouts(cfg, [x.mask], old_logprobs=[x.old], rollout_logprobs=[x.rollout],
                                      entropies=[x.entropy], layouts=[x.layout])
    loss_fn = make_loss(cfg, "fused")
    lp = x.logprobs.clone().requires_grad_()
    ent = x.entropy.clone().requires_grad_()

    def call():
        lp.grad = ent.grad = None
        loss, _ = loss_call(loss_fn, x, lp, ent, batch)
        loss.backward()

    for fast in ([False, True] if launcher.FAST_LAUNCH_AVAILABLE else [False]):
        if launcher.FAST_LAUNCH_AVAILABLE:
            launcher.set_fast_launch(fast)
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        torch.cuda.synchronize()
        print(f"{args.config} / {args.layout}, fast launch {'on' if fast else 'off'}: "
              f"{1e6 * (time.perf_counter() - start) / args.calls:.0f} us per call (wall)")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler).strip_dirs()
    stats.sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
