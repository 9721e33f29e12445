"""Microbenchmark: formulations of the threshold search's two passes, beside one plain read (one GPU).

    python3 scripts/bench_filter_passes.py --out docs/benchmarks      (also run by bench_logprob_filter.py)

For N = 16384 bf16 logits at V = 151936 and 18992 it times, in the same run:

- **read**: ``x.amax(-1)``, one plain read of the logits (the floor of any pass);
- **count** (256 digits, the top-k pass and the exact last pass of top-p):
  ``where``: ``tl.histogram(where(member, digit, 0))`` with the non-members taken out of digit 0 afterwards
  (the library's kernel; in the first H100 run of this script it was the copy named ``old``);
  ``masked``: ``tl.histogram(digit, mask=member)`` (measured 7-10 % slower on the H100, Triton 3.6);
- **mass** (16 digits, fp32 sums of exp((x - M) / T), top-p):
  ``old``: a ``[BLOCK_V]`` load compared as ``digit[:, None] == bins[None, :]`` into a ``[BLOCK_V, 16]``
  accumulator (the compiler converts the two ``[BLOCK_V]`` vectors to the accumulator's layout through
  shared memory every block: 2 ``convert_layout`` in the loop of its TTGIR for sm_90);
  ``tile``: a ``[1, BLOCK_V]`` load compared with a ``[16, 1]`` bin column into a ``[16, BLOCK_V]``
  accumulator in the load's own layout (no conversion in the loop; the library's kernel);

each at a few launch parameters (block x warps). The formulations the library does not use live here only,
for this comparison;  ``kernels/launch_config.py`` the block sizes this run found fastest.
Before timing, each variant's histogram is compared with the library's: counts must be equal; masses are
fp32 sums whose per-(digit, column) order is the same, and whose final reduction over the columns follows
each formulation's layout (reported: max relative difference).

Predicted (H100: ~3.3 TB/s, 132 SMs x 128 fp32 lanes x ~1.75 GHz ~ 3e13 lane-ops/s; 2.5e9 elements at V =
151936): read ~1.6 ms. Mass ``tile``: ~16 x (compare, select, add) + ~20 for key / membership / exp per
element ~ 65 lane-ops -> ~5.5 ms (compute-bound); ``old``: the measured 41-43 ms (shared-memory traffic of the
conversions: ~32 broadcast shared loads per element). Count: tl.histogram's cost depends on its lowering —
warp ballots (~100 warp-instructions per 32 elements for 256 digits -> ~8.5 ms) or one shared-memory atomic
per element (Triton 3.9's PTX) — so ``masked`` was predicted ~equal to ``where`` with ballots and faster with
atomics. Measured (H100, Triton 3.6; docs/benchmarks/logprob_filter.md): read 1.76 ms; mass ``old`` 47.1,
``tile`` 7.64-7.66 ms (6.2x faster; 4.3x a read, 40 % above the prediction); count ``where`` 8.68 ms (the
ballot prediction), ``masked`` 9.34-9.63 ms.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mp_grpo.ops.logprob_launch as logprob_launch  # noqa: E402
from mp_grpo.kernels import logprob_launch_config  # noqa: E402
from mp_grpo.kernels.logprob_filter import LOG2E, _order_key  # noqa: E402
from mp_grpo.ops.logprob_launch import radix_histogram  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import median_ms  # noqa: E402

DEVICE = "cuda"
COUNT_CONFIGS = {"where": [(4096, 4), (4096, 8), (8192, 8)], "masked": [(4096, 4)]}
"""The variants the library does not use at the fastest launch parameters of earlier runs (4096 x 4, 512 x 4)."""
MASS_CONFIGS = {"old": [(512, 4)], "tile": [(256, 4), (512, 4), (1024, 4), (1024, 8)]}


@triton.jit
def masked_count_kernel(x_ptr, prefix_ptr, hist_ptr, V_local, stride_x_row, shift,
                        DIGIT_BITS: tl.constexpr, BLOCK_V: tl.constexpr):
    """A counting pass with ``tl.histogram``'s mask (bf16 keys, with a prefix, tau = -inf)."""
    BINS: tl.constexpr = 1 << DIGIT_BITS
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    bins = tl.arange(0, BINS)
    prefix = tl.load(prefix_ptr + row)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for start in range(0, V_local, BLOCK_V):
        cols = start + offs
        in_row = cols < V_local
        x = tl.load(x_ptr + row * stride_x_row + cols, mask=in_row, other=float("-inf"))
        key = _order_key(x, 16)
        digit = ((key >> shift) & (BINS - 1)).to(tl.int32)
        member = in_row & ((key >> (shift + DIGIT_BITS)).to(tl.int32) == prefix)
        counts += tl.histogram(digit, BINS, mask=member)
    tl.store(hist_ptr + row * BINS + bins, counts)


@triton.jit
def old_mass_kernel(x_ptr, prefix_ptr, row_max_ptr, hist_ptr, V_local, stride_x_row, shift, inv_temperature,
                    DIGIT_BITS: tl.constexpr, BLOCK_V: tl.constexpr):
    """The previous mass pass (bf16 keys, with a prefix, tau = -inf): a [BLOCK_V, BINS] weighted one-hot."""
    BINS: tl.constexpr = 1 << DIGIT_BITS
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    bins = tl.arange(0, BINS)
    prefix = tl.load(prefix_ptr + row)
    row_max = tl.load(row_max_ptr + row)
    scale = inv_temperature * LOG2E
    masses = tl.zeros([BLOCK_V, BINS], dtype=tl.float32)
    for start in range(0, V_local, BLOCK_V):
        cols = start + offs
        in_row = cols < V_local
        x = tl.load(x_ptr + row * stride_x_row + cols, mask=in_row, other=float("-inf"))
        key = _order_key(x, 16)
        digit = ((key >> shift) & (BINS - 1)).to(tl.int32)
        member = in_row & ((key >> (shift + DIGIT_BITS)).to(tl.int32) == prefix)
        e = tl.where(member, tl.exp2((x.to(tl.float32) - row_max) * scale), 0.0)
        masses += tl.where(digit[:, None] == bins[None, :], e[:, None], 0.0)
    tl.store(hist_ptr + row * BINS + bins, tl.sum(masses, axis=0))


def _with_config(kind: str, block: int, warps: int, fn):
    """Run ``fn`` with the library's launch parameters of one pass kind replaced (this benchmark only)."""
    fixed = logprob_launch_config
    def call():
        cfg = replace(fixed(1 << 30), **{f"filter_{kind}_block_v": block, f"filter_{kind}_warps": warps})
        logprob_launch.logprob_launch_config = lambda _v: cfg
        try:
            return fn()
        finally:
            logprob_launch.logprob_launch_config = fixed
    return call


def measure(x: torch.Tensor, rep_ms: int = 150) -> dict:
    """Times (ms) of every variant of both passes on ``x`` [N, V] bf16, the plain read, and the checks.

    The search's realistic case is timed: a later pass, whose prefix selects the digit that holds most
    columns (most columns are members of the first pass only), so both membership branches run."""
    n, v = x.shape
    tau = torch.full((n,), float("-inf"), device=x.device)
    row_max = x.float().amax(-1)
    # Prefix = each row's most common top byte (the first pass's digit of the bulk of the row), from a sample.
    key = x[:, :4096].view(torch.int16).int()
    key = torch.where(key == -32768, 0, key)
    key_hi = (torch.where(key >= 0, key, key ^ 0x7FFF) + 32768) >> 8
    prefix_count = key_hi.mode(-1).values.to(torch.int32).contiguous()
    prefix_mass = (key_hi >> 4).mode(-1).values.to(torch.int32).contiguous()  # 4 key bits chosen: shift 8

    def lib_count():
        return radix_histogram(x, tau, prefix_count, shift=0, digit_bits=8, mass=False, first=False)

    def lib_mass():
        return radix_histogram(x, tau, prefix_mass, shift=8, digit_bits=4, mass=True, row_max=row_max, first=False)

    def masked_count(block, warps):
        hist = torch.empty(n, 256, dtype=torch.int32, device=x.device)
        block = min(block, triton.next_power_of_2(v))

        def call():
            masked_count_kernel[(n,)](x, prefix_count, hist, v, x.stride(0), 0, DIGIT_BITS=8, BLOCK_V=block, num_warps=warps)
            return hist
        return call

    def old_mass(block, warps):
        hist = torch.empty(n, 16, dtype=torch.float32, device=x.device)
        block = min(block, triton.next_power_of_2(v))

        def call():
            old_mass_kernel[(n,)](x, prefix_mass, row_max, hist, v, x.stride(0), 8, 1.0, DIGIT_BITS=4, BLOCK_V=block,
                                  num_warps=warps)
            return hist
        return call

    out = {"read_ms": median_ms(lambda: x.amax(-1), rep_ms=rep_ms), "count": {}, "mass": {}, "checks": {}}
    ref_count = lib_count().clone()
    ref_mass = lib_mass().clone()
    variants = {
        ("count", "where"): lambda b, w: _with_config("count", b, w, lib_count),
        ("count", "masked"): masked_count,
        ("mass", "old"): old_mass,
        ("mass", "tile"): lambda b, w: _with_config("mass", b, w, lib_mass),
    }
    for (kind, name), make in variants.items():
        for block, warps in (COUNT_CONFIGS if kind == "count" else MASS_CONFIGS)[name]:
            label = f"{name} {block}x{warps}"
            try:
                fn = make(block, warps)
                got = fn()
                ref = ref_count if kind == "count" else ref_mass
                if kind == "count":
                    out["checks"][f"{kind} {label}"] = "equal" if torch.equal(got, ref) else "DIFFERENT"
                else:
                    rel = ((got - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()
                    out["checks"][f"{kind} {label}"] = "bitwise equal" if torch.equal(got, ref) else f"max rel diff {rel:.1e}"
                out[kind][label] = median_ms(fn, rep_ms=rep_ms)
            except Exception as err:  # reported, not hidden (e.g. out of registers / shared memory)
                out[kind][label] = repr(err)[:160]
    for kind in ("count", "mass"):
        timed = {k: t for k, t in out[kind].items() if isinstance(t, float)}
        for name in {k.split()[0] for k in timed}:
            best = min((k for k in timed if k.split()[0] == name), key=timed.get)
            out[f"best_{kind}_{name}"] = [best, timed[best]]
    return out


def best_library_configs(passes: dict) -> dict:
    """The fastest measured launch parameters of the library's formulations, per V: {V: {kind: (block, warps)}}."""
    result = {}
    for v, p in passes.items():
        result[v] = {}
        for kind, name in (("count", "where"), ("mass", "tile")):
            label = p[f"best_{kind}_{name}"][0]
            block, warps = label.split()[1].split("x")
            result[v][kind] = (int(block), int(warps))
    return result


def table(passes: dict) -> list[str]:
    """Markdown rows: V, pass, variant, ms, x one read, check."""
    lines = ["| V | pass | variant (block x warps) | ms | × one read | histogram vs library's |", "|---|---|---|---|---|---|"]
    for v, p in passes.items():
        lines.append(f"| {v} | read | `amax` | {p['read_ms']:.3f} | 1.00 | — |")
        for kind in ("count", "mass"):
            for label, t in p[kind].items():
                ms = f"{t:.3f} | {t / p['read_ms']:.2f}" if isinstance(t, float) else f"error: {t} |"
                lines.append(f"| {v} | {kind} | {label} | {ms} | {p['checks'].get(f'{kind} {label}', '—')} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 18992])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_filter_passes.py needs a CUDA GPU")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_logprob_filter import peaky_logits

    passes = {}
    for v in args.vocab:
        passes[str(v)] = measure(peaky_logits(args.tokens, v))
        print(json.dumps({"V": v, **passes[str(v)]}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "filter_passes.json").write_text(json.dumps(passes, indent=1))
    print("\n".join(table(passes)))


if __name__ == "__main__":
    main()
