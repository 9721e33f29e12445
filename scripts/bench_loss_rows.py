"""Benchmark: the fused output layer + GRPO loss on the loss rows alone, against the bare matmuls of every token.

    python scripts/bench_loss_rows.py --out docs/benchmarks        # one GPU: loss_rows.{json,md,png}

What MegatronGRPO's fused training step runs on a micro-batch whose loss mask covers a fraction f of its tokens
(``OutputRows.LOSS``, the default): the loss rows' hidden states gathered (one ``index_select``), ``fused_linear_loss``
on them with GRPOLoss (PPO clip, on-policy: every loss token has a gradient) on the micro-batch's full-size log-probs
(the rows' scattered back), backward's scaling pass and the hidden gradient scattered into a zero-filled ``[N, H]``
buffer — every gather and scatter included, as ``mp_grpo.megatron.output_rows`` makes them. The loss rows are made
from the mask before timing (at data preparation in training: ``MicroBatch.loss_rows``).

1. Loss-token fractions 100 / 50 / 10 / 3 % at N = 16384 tokens (8 rows of 2048; in each, 4 turns whose last f
   are trained on, the rest prompts and tool outputs), H = 4096, V = 151936, bf16: ``rows`` (the op above), against
   ``bare`` — ``h @ Wᵀ`` and its two backward GEMMs on every token, the all-token floor of an unfused output
   layer — and, for comparison, ``all_rows`` (``fused_linear_loss`` on every row, the output layer before rows were
   skipped) and ``logits_rows`` (the logits path on the loss rows: the batch-major GEMM, ``vocab_parallel_logprobs``,
   GRPOLoss). do_bench medians of forward + backward, and the extra peak memory of one call beyond its inputs.
   Targets: ``rows`` ≤ 0.55× the bare matmuls at 50 % and ≤ 0.10× at 3 %.
2. Long context, SkyRL #1841's case: 262144 tokens on one GPU, a 62080-id vocabulary shard (248320 over TP = 4),
   H = 4096, 3 % loss tokens: ``rows``, ``all_rows`` and ``bare``, time and peak memory — the absolute peak of the
   call (its inputs, 2 GiB of hidden states and 0.5 GiB of weight, and their gradients included) and beyond its
   inputs. SkyRL's own figures for this case (their PR's table, their GPU: eager cross-entropy 92.2 GB / 357 ms,
   their fused linear cross-entropy 4.0 GB / 784 ms) are quoted beside, not measured here.

3. Finding the loss rows from a mask (``loss_rows``, at data preparation): microseconds per call from a host mask and
   from a GPU one (a host read), at both token counts.

Before timing, ``rows`` and ``logits_rows`` are checked against ``all_rows`` at a small size on the device (the
hidden and the weight gradients: bf16 tolerance on their largest entry; the hidden gradient of every row outside the
mask exactly 0). Results: ``loss_rows.json``, ``loss_rows.md`` (tables, one line per target: met or not, by how much),
``loss_rows.png`` (time against the loss fraction), rewritten after every row.

CPU check of this script (Triton's interpreter, tiny sizes, no timing worth reading; refused under ``docs/``)::

    python scripts/bench_loss_rows.py --dry-run --out /tmp/loss_rows

Needs torch, triton and matplotlib; megatron-core and omegaconf are not needed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fused_cases  # noqa: E402
import measure  # noqa: E402
from fused_cases import make_inputs  # noqa: E402
from fused_report import BARE, WITH_LOSS  # noqa: E402
from measure import GiB  # noqa: E402

from mp_grpo.config.loss import LossConfig  # noqa: E402
from mp_grpo.loss import GlobalBatch, GRPOLoss  # noqa: E402
from mp_grpo.ops.batch_major_linear import batch_major_linear  # noqa: E402
from mp_grpo.ops.fused_linear_loss import fused_linear_loss  # noqa: E402
from mp_grpo.ops.loss_rows import LossRows, loss_rows  # noqa: E402
from mp_grpo.ops.vocab_parallel_logprobs import vocab_parallel_logprobs  # noqa: E402

IGNORE = -100
FRACTIONS = (1.0, 0.5, 0.1, 0.03)
TARGETS = {0.5: 0.55, 0.03: 0.10}
"""Loss fraction -> the largest ``rows`` time allowed, as a multiple of the bare all-token matmuls."""
ROWS_PER_SEQUENCE = 2048
TURNS = 4
"""Turns per sequence: each ends with its trained tokens (an agent's completions between tool outputs)."""
LONG = {"tokens": 262144, "v_local": 62080, "fraction": 0.03}
"""SkyRL #1841: 262144 tokens per rank, Qwen3.6's 248320-id vocabulary over TP = 4."""
SKYRL = {"eager cross-entropy": (92.2, 357.0), "fused linear cross-entropy": (4.0, 784.0)}
"""SkyRL #1841's table at 262144 tokens, per-rank vocabulary 62,080: (GB, ms), their GPU; quoted, not measured."""
KEYS = ("bare", "all_rows", "rows", "logits_rows")
NAMES = {
    "bare": BARE,
    "all_rows": f"{WITH_LOSS}, every row",
    "rows": f"{WITH_LOSS}, loss rows only (gather + scatter included)",
    "logits_rows": "mp_grpo logits path on the loss rows: batch-major GEMM + vocab_parallel_logprobs + GRPOLoss",
}

LABELS = {"rows": "fused + loss, loss rows", "logits_rows": "logits path, loss rows", "all_rows": "fused + loss, every row"}
"""The plot's legend."""


def loss_mask(n: int, fraction: float) -> torch.Tensor:
    """``[B, S]`` (S = ROWS_PER_SEQUENCE, or n): in each of TURNS turns of a row, the last ``fraction`` is trained on."""
    s = min(n, ROWS_PER_SEQUENCE)
    turn = max(s // TURNS, 1)
    pos = torch.arange(s, device=fused_cases.DEVICE) % turn
    row = pos >= turn - round(fraction * turn)
    return row.expand(n // s, s).contiguous()


def grpo_loss(mask: torch.Tensor):
    """GRPOLoss (PPO clip, on-policy) on the ``[B, S]`` micro-batch, as MegatronGRPO binds it."""
    gen = torch.Generator(device=fused_cases.DEVICE).manual_seed(3)
    adv = torch.randn(mask.shape[0], device=fused_cases.DEVICE, generator=gen)
    loss, batch = GRPOLoss(LossConfig()), GlobalBatch.from_masks([mask])

    def loss_fn(lp, ent):
        return loss(lp.view(mask.shape), None, adv, mask, entropy=None if ent is None else ent.view(mask.shape),
                    batch=batch)

    return loss_fn


def build(key: str, n: int, hidden: int, v: int, fraction: float, inputs: tuple | None = None):
    """(forward, forward + backward, (hidden, weight)) of row ``key`` (the bare matmuls: no parameters returned);
    ``inputs``: ``make_inputs``'s, else fresh ones."""
    if key == "bare":  # bench_fused.py's row (its inputs its own)
        return (*fused_cases.cases(n, hidden, v)["bare"][1](), ())
    h, w, t, _ = inputs or make_inputs(n, hidden, v)
    mask = loss_mask(n, fraction)
    target = torch.where(mask.reshape(-1), t, torch.full_like(t, IGNORE)).view(mask.shape)
    hidden_bs = h.detach().view(*mask.shape, hidden).requires_grad_()  # [B, S, H], as GPTModel returns it
    loss_fn = grpo_loss(mask)
    one = torch.ones((), device=fused_cases.DEVICE)
    if key == "all_rows":

        def every_row():
            return fused_linear_loss(hidden_bs, w, target, loss_fn, check_inputs=False)[0]

        return (*fused_cases._closures((hidden_bs, w), every_row, one, forward_without_grad=False), (hidden_bs, w))
    rows = LossRows(loss_rows(mask), mask.shape)  # data preparation (MicroBatch.loss_rows): not timed

    def on_rows():
        fill, _ = rows.fill_outside(mask)
        picked = rows.gather(hidden_bs)
        if key == "rows":
            return fused_linear_loss(picked.unsqueeze(0), w, rows.select(target), rows.loss_fn(loss_fn, fill),
                                     check_inputs=False)[0]
        logits = batch_major_linear(picked.unsqueeze(1), w).transpose(0, 1)  # [1, K, V], as GPTModel returns it
        lp = vocab_parallel_logprobs(logits, rows.select(target), inplace_backward=True, check_inputs=False)
        return loss_fn(rows.scatter(lp, fill), None)[0]

    closures = fused_cases._closures((hidden_bs, w), on_rows, one, forward_without_grad=key == "logits_rows")
    return (*closures, (hidden_bs, w))


def check_rows(n: int = 512, hidden: int = 256, v: int = 3000, fraction: float = 0.3) -> float:
    """``rows`` and ``logits_rows`` against ``all_rows`` at a small size on the device: the worst error of the hidden
    and weight gradients over the bf16 tolerance (on their largest entry); the hidden gradient of every row outside
    the loss mask must be exactly 0."""
    from tests.tolerances import tolerance

    h, w, t, g = make_inputs(n, hidden, v, seed=5, weight_std=0.2)
    grads = {}
    for key in ("all_rows", "rows", "logits_rows"):
        fresh = (h.detach().clone(), w.detach().clone().requires_grad_(), t, g)
        _, fwd_bwd, params = build(key, n, hidden, v, fraction, fresh)
        fwd_bwd()
        grads[key] = [p.grad.float().reshape(-1, p.shape[-1]) for p in params]
    outside = ~loss_mask(n, fraction).reshape(-1)
    rtol = tolerance(torch.bfloat16)["rtol"]
    worst = 0.0
    for key in ("rows", "logits_rows"):
        if grads[key][0].reshape(n, hidden)[outside].any():
            raise SystemExit(f"check failed: {key}: the hidden gradient outside the loss rows is not 0")
        for actual, expected in zip(grads[key], grads["all_rows"]):
            worst = max(worst, ((actual - expected).abs().max() / expected.abs().max()).item() / rtol)
    return worst


HOST_READ_CALLS = 50
"""Calls of ``loss_rows`` per timing of the mask's host read (the median is kept)."""


def rows_host_read_us(n: int, fraction: float) -> dict:
    """Microseconds to find the loss rows of an ``n``-token mask (``loss_rows``: ``nonzero`` sizes its output from the
    data): from a mask on the host (what ``prepare_micro_batch`` does) and from one on the GPU (a host read: the
    synchronization a MicroBatch made on the GPU pays once, at data preparation), the GPU idle before each call."""
    out = {}
    for where in ("cpu", "cuda") if fused_cases.DEVICE == "cuda" else ("cpu",):
        saved, fused_cases.DEVICE = fused_cases.DEVICE, where
        mask = loss_mask(n, fraction)
        fused_cases.DEVICE = saved
        times = []
        for _ in range(HOST_READ_CALLS):
            if where == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss_rows(mask)
            times.append((time.perf_counter() - start) * 1e6)
        out[f"{where}_mask_us"] = sorted(times)[len(times) // 2]
    return out


def measure_row(key: str, n: int, hidden: int, v: int, fraction: float) -> dict:
    row = {"key": key, "case": NAMES[key], "N": n, "H": hidden, "V_local": v, "loss_fraction": fraction}
    fwd = fwd_bwd = None
    try:
        fwd, fwd_bwd, _ = build(key, n, hidden, v, fraction)
        row["extra_peak_GiB"] = extra_peak_bytes(fwd_bwd) / GiB
        row["peak_GiB"] = peak_bytes(fwd_bwd) / GiB
        row["fwd_bwd_ms"] = median_ms(fwd_bwd)
    except Exception as err:  # reported, not hidden (e.g. the bare matmuls out of memory)
        traceback.print_exc()
        row["error"] = repr(err)[:300]
    del fwd, fwd_bwd
    empty_cache()
    return row


def median_ms(fn) -> float:
    return measure.median_ms(fn, warmup_ms=100, rep_ms=600)


def extra_peak_bytes(fn) -> int:
    return measure.extra_peak_bytes(fn)


def peak_bytes(fn) -> int:
    return measure.peak_bytes(fn)


def empty_cache() -> None:
    if fused_cases.DEVICE == "cuda":
        torch.cuda.empty_cache()


def run(args) -> dict:
    worst = check_rows(**({"n": 64, "hidden": 16, "v": 96} if args.dry_run else {}))
    if not worst <= 1.0:
        raise SystemExit(f"check failed: the loss rows' op differs from every row's by {worst:.2f}x the bf16 tolerance")
    result = {"device": "CPU dry run" if args.dry_run else torch.cuda.get_device_name(), "torch": torch.__version__,
              "dry_run": bool(args.dry_run), "check_worst_error_over_tolerance": worst,
              "command": " ".join(["python scripts/bench_loss_rows.py", *sys.argv[1:]]), "fractions": [], "long": []}
    n, hidden, v = args.tokens, args.hidden, args.vocab
    jobs = [("fractions", key, n, v, f) for f in args.fractions for key in KEYS
            if key != "bare" or f == args.fractions[0]]  # the bare matmuls do not depend on the mask
    result["rows_host_read"] = {str(tokens): rows_host_read_us(tokens, 0.5) for tokens in (n, args.long_tokens)}
    if not args.skip_long:
        jobs += [("long", key, args.long_tokens, args.long_vocab, LONG["fraction"]) for key in ("rows", "all_rows", "bare")]
    for part, key, tokens, vocab, fraction in jobs:
        row = measure_row(key, tokens, hidden, vocab, fraction)
        print(json.dumps(row), flush=True)
        result[part].append(row)
        add_ratios(result)
        write_report(result, args.out)
    write_report(result, args.out, plot=True)
    return result


def add_ratios(result: dict) -> None:
    for part in ("fractions", "long"):
        bare = next((r for r in result[part] if r["key"] == "bare" and "fwd_bwd_ms" in r), None)
        for r in result[part]:
            if bare is not None and "fwd_bwd_ms" in r:
                r["vs_bare"] = r["fwd_bwd_ms"] / bare["fwd_bwd_ms"]


# ------------------------------------------------------------------------------------------------ report
def _cell(r: dict, key: str, fmt: str) -> str:
    return format(r[key], fmt) if key in r else "—"


def target_lines(result: dict) -> list[str]:
    lines = []
    for fraction, limit in TARGETS.items():
        r = next((x for x in result["fractions"] if x["key"] == "rows" and x["loss_fraction"] == fraction), None)
        if r is None or "vs_bare" not in r:
            lines.append(f"- {fraction:.0%} loss tokens: not measured this run")
            continue
        margin = limit - r["vs_bare"]
        verdict = "met" if margin >= 0 else "NOT MET"
        lines.append(f"- {fraction:.0%} loss tokens: {r['fwd_bwd_ms']:.2f} ms = {r['vs_bare']:.3f}x the bare all-token "
                     f"matmuls; target ≤ {limit:.2f}x: {verdict} (by {abs(margin):.3f}x)")
    return lines


def write_report(result: dict, out: Path, plot: bool = False) -> None:
    (out / "loss_rows.json").write_text(json.dumps(result, indent=1))
    title = "DRY RUN (CPU, stubbed: no figure here is a measurement)" if result["dry_run"] else result["device"]
    lines = [f"# The output layer on the loss rows alone — {title}", "",
             "Forward + backward of MegatronGRPO's fused training op (`fused_linear_loss` + GRPOLoss) on a micro-batch "
             "whose loss mask covers a fraction of its tokens, the gathers and scatters of the loss rows included, "
             "against the bare matmuls of every token (h @ Wᵀ and its two backward GEMMs: the all-token floor). "
             f"bf16; do_bench medians; peak = the largest allocated memory during one call, inputs included; extra = "
             f"beyond what was allocated before it. Command: `{result['command']}`. "
             f"Check against every row's op at a small size: worst error {result['check_worst_error_over_tolerance']:.3f}"
             " x the bf16 tolerance.", "",
             "| loss tokens | implementation | N | V_local | fwd+bwd ms | x bare | peak GiB | extra GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for part in ("fractions", "long"):
        for r in result[part]:
            if "error" in r:
                lines.append(f"| {r['loss_fraction']:.0%} | {r['case']} | {r['N']} | {r['V_local']} | not measured: "
                             f"{r['error']} | | | |")
                continue
            lines.append(f"| {r['loss_fraction']:.0%} | {r['case']} | {r['N']} | {r['V_local']} | "
                         f"{_cell(r, 'fwd_bwd_ms', '.2f')} | {_cell(r, 'vs_bare', '.3f')} | {_cell(r, 'peak_GiB', '.2f')} "
                         f"| {_cell(r, 'extra_peak_GiB', '.2f')} |")
    reads = "; ".join(f"{n} tokens: " + ", ".join(f"{k.split('_')[0]} mask {v:.0f} µs" for k, v in r.items())
                      for n, r in result.get("rows_host_read", {}).items())
    lines += ["", "Targets (`rows` against the bare all-token matmuls, the same run):", *target_lines(result), "",
              f"Finding the loss rows (`loss_rows`, a median of {HOST_READ_CALLS} calls, half the tokens trained on; "
              "at data preparation, never in the micro-batch loop; from a GPU mask it is a host read): " + reads + ".",
              "",
              f"SkyRL #1841's figures for the long-context case ({LONG['tokens']} tokens, vocabulary shard "
              f"{LONG['v_local']}; their PR's table, their GPU, every token through the loss; quoted, not measured "
              "here): " + "; ".join(f"{name} {gb} GB / {ms:g} ms" for name, (gb, ms) in SKYRL.items()) + "."]
    (out / "loss_rows.md").write_text("\n".join(lines) + "\n")
    if plot:
        plot_fractions(result, out / "loss_rows.png")


def plot_fractions(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key in ("rows", "logits_rows", "all_rows"):
        pts = sorted((r["loss_fraction"], r["vs_bare"]) for r in result["fractions"] if r["key"] == key and "vs_bare" in r)
        if pts:
            ax.plot([100 * f for f, _ in pts], [x for _, x in pts], marker="o", label=LABELS[key])
    for fraction, limit in TARGETS.items():
        ax.plot([100 * fraction], [limit], marker="v", color="red", linestyle="none")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xscale("log")
    ticks = sorted({100 * r["loss_fraction"] for r in result["fractions"]})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("loss tokens (% of the micro-batch)")
    ax.set_ylabel("fwd+bwd time / bare all-token matmuls")
    ax.set_title(("DRY RUN — " if result["dry_run"] else "") + "output layer on the loss rows (targets: red)", fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ main
def dry_run(args) -> None:
    """``--dry-run``: the CPU, tiny sizes, every measurement one untimed call (a check of this script)."""
    global median_ms, extra_peak_bytes, peak_bytes

    def once_ms(fn) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    fused_cases.DEVICE = "cpu"
    median_ms = once_ms
    extra_peak_bytes = peak_bytes = lambda fn: 0  # noqa: E731  (the timed call runs it)
    args.tokens, args.hidden, args.vocab, args.long_tokens, args.long_vocab = 64, 16, 96, 64, 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    parser.add_argument("--long-tokens", type=int, default=LONG["tokens"])
    parser.add_argument("--long-vocab", type=int, default=LONG["v_local"])
    parser.add_argument("--skip-long", action="store_true", help="leave out the long-context rows")
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny sizes: check the script")
    args = parser.parse_args()
    if args.dry_run:
        docs = (Path(__file__).resolve().parents[1] / "docs").resolve()
        if args.out.resolve() == docs or docs in args.out.resolve().parents:
            parser.error(f"--out {args.out}: a dry run's figures never go under docs/")
        dry_run(args)
    elif not torch.cuda.is_available():
        sys.exit("bench_loss_rows.py needs a CUDA GPU (or --dry-run)")
    args.out.mkdir(parents=True, exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
