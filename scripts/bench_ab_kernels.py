"""A/B timing of the log-prob kernels and the logits → loss path between two source trees, same GPU, same run.

    python scripts/bench_ab_kernels.py --a /path/to/old/checkout --b . --out docs/benchmarks --name nonfinite_ab

Each tree is imported in its own child process (``sys.path`` set to that tree, checked); the children run in
the order A, B, A, B, … (``--rounds``), so that drift shows as a difference between rounds of one tree. Every
child draws the same inputs (fixed seeds) and times, for V in ``--vocab`` (bf16 logits, N = ``--tokens``):
``vocab_parallel_logprobs`` forward, forward+backward, forward+backward with the entropy (default checks), and
``GRPOLoss.on_logits`` (DAPO token-mean, off-policy) forward+backward — each eagerly (``do_bench`` median:
host time included) and as the replay of a captured CUDA graph (GPU time only). It also reports the compiled
kernels' registers, spills and PTX instruction counts. Written: ``<name>.json`` and ``<name>.md`` (the
median over rounds of each tree, B / A, and the spread between rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def _child(root: str, tokens: int, vocabs: list[int]) -> dict:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="source tree A (before)")
    parser.add_argument("--b", required=True, help="source tree B (after)")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 18992])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--name", default="ab_kernels")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(_child(args.child, args.tokens, args.vocab)))
        return
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for _ in range(args.rounds):
        for label, root in (("A", args.a), ("B", args.b)):
            cmd = [sys.executable, __file__, "--child", str(Path(root).resolve()), "--tokens", str(args.tokens),
                   "--vocab", *map(str, args.vocab)]
            # the child puts its tree first on sys.path and checks that mp_grpo came from it
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=str(Path(root).resolve()))
            if out.returncode:
                sys.exit(f"child {label} failed:\n{out.stderr[-4000:]}")
            runs[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(label, "done", flush=True)
    names = list(runs["A"][0]["rows"])
    lines = [f"# {args.name}: A = {args.a}, B = {args.b} ({runs['A'][0]['device']}, N = {args.tokens}, bf16)", "",
             "Median ms over rounds (each round: do_bench median); spread = max − min over rounds, per tree.", "",
             "| case | A ms | B ms | B / A | spread A | spread B |", "|---|---|---|---|---|---|"]
    table = {}
    for n in names:
        a = [r["rows"][n] for r in runs["A"]]
        b = [r["rows"][n] for r in runs["B"]]
        ma, mb = statistics.median(a), statistics.median(b)
        table[n] = dict(a=a, b=b, ratio=mb / ma)
        lines.append(f"| {n} | {ma:.4f} | {mb:.4f} | {mb / ma:.3f} | {max(a) - min(a):.4f} | {max(b) - min(b):.4f} |")
    lines += ["", "Compiled kernels (registers, spills, PTX instructions), per specialization:", "",
              "| kernel | A | B |", "|---|---|---|"]
    for k in sorted(set(runs["A"][0]["kernels"]) | set(runs["B"][0]["kernels"])):
        lines.append(f"| {k} | {runs['A'][0]['kernels'].get(k)} | {runs['B'][0]['kernels'].get(k)} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(dict(table=table, runs=runs), indent=1))
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
