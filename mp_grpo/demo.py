"""Demo: token log-probs and entropy from a vocabulary split over 2 tensor-parallel ranks.

    python -m mp_grpo.demo [--tp 2] [--tokens 8] [--vocab 96]

Starts ``--tp`` processes (gloo on CPU, NCCL on GPUs), gives each its contiguous vocabulary shard of
one synthetic batch of logits, runs :func:`mp_grpo.vocab_parallel_logprobs` with entropy and
prints the result beside a float64 ``torch.log_softmax`` of the full, unsharded logits. On a machine
without a GPU the kernels run under Triton's interpreter.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    # Under Triton's interpreter both sides of every tl.where are evaluated, masked lanes included
    # (log(0), 0 * inf); those values are never stored, so their warnings are noise here.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    from mp_grpo import vocab_parallel_logprobs

    use_cuda = torch.cuda.device_count() >= args.tp
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if use_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.tp
    )
    try:
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(args.tokens, args.vocab, generator=gen) * 2
        target = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
        v_local = args.vocab // args.tp
        shard = logits[:, rank * v_local : (rank + 1) * v_local].to(device).requires_grad_()

        logprobs, entropy = vocab_parallel_logprobs(
            shard, target.to(device), tp_group=dist.group.WORLD, temperature=args.temperature, with_entropy=True
        )
        logprobs.sum().backward()

        if rank == 0:
            ref_logp = torch.log_softmax(logits.double() / args.temperature, dim=-1)
            ref = ref_logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            ref_entropy = -(ref_logp.exp() * ref_logp).sum(-1)
            print(f"tp={args.tp} tokens={args.tokens} vocab={args.vocab} ({v_local} per rank) "
                  f"temperature={args.temperature} device={device.type}")
            print(f"{'token':>5} {'target':>6} {'logprob':>12} {'reference':>12} {'entropy':>10} {'reference':>10}")
            for i in range(args.tokens):
                print(f"{i:>5} {int(target[i]):>6} {logprobs[i].item():>12.6f} {ref[i].item():>12.6f} "
                      f"{entropy[i].item():>10.6f} {ref_entropy[i].item():>10.6f}")
            err = max((logprobs.cpu().double() - ref).abs().max().item(),
                      (entropy.cpu().double() - ref_entropy).abs().max().item())
            print(f"max |difference| from the float64 reference: {err:.2e}")
            grad_ref = torch.softmax(logits.double() / args.temperature, -1)
            grad_ref = (torch.nn.functional.one_hot(target, args.vocab) - grad_ref) / args.temperature
            grad_err = (shard.grad.cpu().double() - grad_ref[:, :v_local]).abs().max().item()
            print(f"max |gradient difference| on rank 0's shard: {grad_err:.2e}")
            if err > 1e-4 or grad_err > 1e-4:
                raise SystemExit("demo: result differs from the reference")
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (processes)")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=96, help="global vocabulary size, divisible by --tp")
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    if args.vocab % args.tp:
        parser.error(f"--vocab ({args.vocab}) must be divisible by --tp ({args.tp})")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    port = 29500 + os.getpid() % 1000
    mp.spawn(_worker, args=(args, port), nprocs=args.tp, join=True)


if __name__ == "__main__":
    main()
