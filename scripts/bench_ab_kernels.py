"""A/B timing of the log-prob kernels and the logits → loss path between source trees, same GPU, same run.

    python scripts/bench_ab_kernels.py --tree before=/path/to/old/checkout --tree after=. --out docs/benchmarks \
        --name nonfinite_ab

Each tree is imported in its own child process (``sys.path`` set to that tree, checked); the children run in
turn, tree after tree, ``--rounds`` times, so that drift shows as a difference between rounds of one tree. Every
child draws the same inputs (fixed seeds) and times, for V in ``--vocab`` (bf16 logits, N = ``--tokens``):
``vocab_parallel_logprobs`` forward, forward+backward, forward+backward with the entropy (default checks), and
``GRPOLoss.on_logits`` (DAPO token-mean, off-policy) forward+backward — each eagerly (``do_bench`` median:
host time included) and as the replay of a captured CUDA graph (GPU time only); and once, at ``--hidden``
(default 4096) and the largest V, the fused output layer (bf16 hidden states and weight): ``fused_linear_logprobs``
forward+backward with the entropy and ``fused_linear_loss`` with the DAPO loss, eagerly. It also reports the compiled
kernels' registers, spills and PTX instruction counts. Written: ``<name>.json`` and ``<name>.md`` (the
median over rounds of each tree, its ratio to the first tree's, and the spread between rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def _child(root: str, tokens: int, vocabs: list[int], hidden: int) -> dict:
    sys.path.insert(0, root)
    import torch
    import triton

    import mp_grpo
    from mp_grpo.ops import launcher

    assert Path(mp_grpo.__file__).resolve().is_relative_to(Path(root).resolve()), mp_grpo.__file__
    dev = "cuda"
    rows: dict[str, float] = {}

    def bench(fn) -> float:
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    def graphed(step) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        t = bench(graph.replay)
        del graph
        return t

    for V in vocabs:
        gen = torch.Generator(device=dev).manual_seed(0)
        x = (torch.randn(tokens, V, device=dev, generator=gen) * 3).to(torch.bfloat16)
        t = torch.randint(0, V, (tokens,), device=dev, generator=gen)
        g1 = torch.randn(tokens, device=dev, generator=gen)
        g2 = torch.randn(tokens, device=dev, generator=gen)
        B = 8
        L = tokens // B
        mask = torch.arange(L, device=dev)[None] < torch.randint(L // 8, L + 1, (B, 1), device=dev, generator=gen)
        old = -torch.rand(B, L, device=dev, generator=gen) * 5
        adv = torch.randn(B, device=dev, generator=gen)
        cfg = mp_grpo.load_config("trl_dapo", ["rollout_correction.weight_level=null",
                                               "rollout_correction.reject_level=null",
                                               "rollout_correction.reject_max=null"])
        loss_fn = mp_grpo.GRPOLoss(cfg)
        batch = mp_grpo.GlobalBatch.from_masks([mask])

        def lp_fwd():
            mp_grpo.vocab_parallel_logprobs(x, t)

        def lp_fwdbwd():
            xl = x.detach().requires_grad_()
            torch.autograd.grad(mp_grpo.vocab_parallel_logprobs(xl, t), xl, g1)

        def lp_ent_fwdbwd():
            xl = x.detach().requires_grad_()
            lp, ent = mp_grpo.vocab_parallel_logprobs(xl, t, with_entropy=True)
            torch.autograd.grad([lp, ent], xl, [g1, g2])

        def on_logits_fwdbwd():
            xl = x.detach().requires_grad_()
            torch.autograd.grad(loss_fn.on_logits(xl.view(B, L, V), t.view(B, L), old, adv, mask, batch=batch)[0], xl)

        for name, fn in (("logprobs fwd", lp_fwd), ("logprobs fwd+bwd", lp_fwdbwd),
                         ("logprobs+entropy fwd+bwd", lp_ent_fwdbwd), ("on_logits dapo fwd+bwd", on_logits_fwdbwd)):
            fn()
            torch.cuda.synchronize()
            rows[f"{name} V={V} eager"] = bench(fn)
            rows[f"{name} V={V} graph"] = graphed(fn)
        if V == max(vocabs) and hidden:
            _fused_rows(rows, bench, mp_grpo, torch, loss_fn, batch, t, old, adv, mask, B, L, V, hidden, gen)
        mp_grpo.check_errors()
        del x
        torch.cuda.empty_cache()
    kernels = {}
    for (kernel, _), entry in launcher._compiled.items():
        if not entry:
            continue
        compiled = entry[0]
        name = getattr(kernel, "__name__", str(kernel))
        ptx = compiled.asm.get("ptx", "")
        instructions = sum(1 for line in ptx.splitlines()
                           if line.strip() and not line.strip().startswith(("//", ".", "{", "}", "$")))
        kernels.setdefault(name, set()).add((compiled.n_regs, compiled.n_spills, instructions))
    return dict(rows=rows, kernels={k: sorted(v) for k, v in kernels.items()},
                device=torch.cuda.get_device_name())


def _fused_rows(rows, bench, mp_grpo, torch, loss_fn, batch, t, old, adv, mask, B, L, V, hidden, gen) -> None:
    """The fused output layer at [N, hidden] x [V, hidden] (bf16), eagerly: fused_linear_logprobs forward+backward with
    the entropy, and fused_linear_loss with ``loss_fn`` (the same DAPO loss as on_logits)."""
    dev = t.device
    h = (torch.randn(t.shape[0], hidden, device=dev, generator=gen) * hidden**-0.25).to(torch.bfloat16)
    w = (torch.randn(V, hidden, device=dev, generator=gen) * hidden**-0.25).to(torch.bfloat16)
    g = torch.randn(t.shape[0], device=dev, generator=gen)

    def fused_logprobs_fwdbwd():
        hl, wl = h.detach().requires_grad_(), w.detach().requires_grad_()
        lp, ent = mp_grpo.fused_linear_logprobs(hl, wl, t, with_entropy=True)
        torch.autograd.grad([lp, ent], [hl, wl], [g, g])

    def fused_loss_fwdbwd():
        hl, wl = h.detach().requires_grad_(), w.detach().requires_grad_()
        loss, _ = mp_grpo.fused_linear_loss(
            hl, wl, t, lambda lp, ent: loss_fn(lp.view(B, L), old, adv, mask, batch=batch), with_entropy=False)
        torch.autograd.grad(loss, [hl, wl])

    for name, fn in (("fused_linear_logprobs+entropy fwd+bwd", fused_logprobs_fwdbwd),
                     ("fused_linear_loss dapo fwd+bwd", fused_loss_fwdbwd)):
        fn()
        torch.cuda.synchronize()
        rows[f"{name} V={V} H={hidden} eager"] = bench(fn)
    del h, w


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH of a source tree (the first is the base)")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 18992])
    parser.add_argument("--hidden", type=int, default=4096, help="the fused output layer's rows (0: not timed)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--name", default="ab_kernels")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(_child(args.child, args.tokens, args.vocab, args.hidden)))
        return
    if not args.tree:
        parser.error("give at least one --tree NAME=PATH")
    trees = dict(t.split("=", 1) for t in args.tree)
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for label, root in trees.items():
            cmd = [sys.executable, __file__, "--child", str(Path(root).resolve()), "--tokens", str(args.tokens),
                   "--hidden", str(args.hidden), "--vocab", *map(str, args.vocab)]
            # the child puts its tree first on sys.path and checks that mp_grpo came from it
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=str(Path(root).resolve()))
            if out.returncode:
                sys.exit(f"child {label} failed:\n{out.stderr[-4000:]}")
            runs[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(label, "done", flush=True)
    names = list(trees)
    base = names[0]
    cases = list(runs[base][0]["rows"])
    lines = [f"# {args.name} ({runs[base][0]['device']}, N = {args.tokens}, bf16 logits)", "",
             "Trees: " + ", ".join(f"{n} = `{p}`" for n, p in trees.items()), "",
             f"Median ms over {args.rounds} rounds (each round: the do_bench median); ratio to {base}; spread = "
             "max − min over the rounds of one tree.", "",
             "| case | " + " | ".join(f"{n} ms" for n in names) + " | " + " | ".join(f"{n} / {base}" for n in names[1:])
             + " | " + " | ".join(f"spread {n}" for n in names) + " |",
             "|---" * (1 + 2 * len(names) + len(names) - 1) + "|"]
    table = {}
    for case in cases:
        values = {n: [r["rows"][case] for r in runs[n]] for n in names}
        med = {n: statistics.median(v) for n, v in values.items()}
        table[case] = dict(values=values, ratio={n: med[n] / med[base] for n in names[1:]})
        lines.append(f"| {case} | " + " | ".join(f"{med[n]:.4f}" for n in names) + " | "
                     + " | ".join(f"{med[n] / med[base]:.3f}" for n in names[1:]) + " | "
                     + " | ".join(f"{max(v) - min(v):.4f}" for v in values.values()) + " |")
    lines += ["", "Compiled kernels (registers, spills, PTX instructions), per specialization:", "",
              "| kernel | " + " | ".join(names) + " |", "|---" * (1 + len(names)) + "|"]
    for k in sorted(set().union(*(runs[n][0]["kernels"] for n in names))):
        lines.append(f"| {k} | " + " | ".join(str(runs[n][0]["kernels"].get(k)) for n in names) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(dict(table=table, runs=runs), indent=1))
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
