"""Predictions for the fp32-logit and cut-cross-entropy rows of scripts/bench_fused.py, from a bytes model — written
before the rows were first measured, stored in each row's JSON and printed beside the measurement.

An fp32 row is predicted as its bf16 counterpart measured in the same run plus what fp32 logits add (an H100,
N tokens, ``E = N · V_local`` logits a rank):

- a GEMM that writes fp32 instead of bf16 writes 2E bytes more in its epilogue; the GEMM is compute-bound at H = 4096
  and hides part of it: ``GEMM_EPILOGUE_EXPOSED`` of those bytes at the copy bandwidth (the independent harness
  measured ``torch.mm(out_dtype=fp32)`` 30.16 vs 29.53 ms at N = 16384, V = 151936: 0.63 ms of the 1.66 ms that
  2E bytes take at 3.0 TB/s);
- a Triton pass (statistics, backward) reads 2E bytes more, at the copy bandwidth (those passes run at it);
- the byte budgets of the chunk buffers hold half the rows / columns in fp32: every extra chunk re-reads and
  re-writes an accumulator — the fused loss's ``[V_local, H]`` weight gradient (per row chunk), the per-token op's
  fp32 ``[rows, H]`` hidden-gradient accumulator (per backward vocabulary chunk) — and the loss op sums the weight
  gradient in fp32 once it has several chunks (``WEIGHT_GRAD_FP32_BYTES``);
- extra peak memory: the chunk buffer's new size (``plan_chunks`` with the ops' budgets) and that fp32 weight-gradient
  buffer, in place of the bf16 ones.

cut-cross-entropy's rows are predicted from the independent harness's measurement at V = 151936 (N = 16384, H = 4096,
H100, TP = 1 / 2 / 4: ``../shared/anchors/h100x4_tp_fused_cce_2026-11-27.jsonl``, quoted in ``CCE_ANCHOR``), scaled
to other vocabularies by V_local (its time is GEMM time; its exact variant's memory is its fp32 ``[V_local, H]``
gradient accumulator).
"""

from __future__ import annotations

import torch

from mp_grpo.ops import fused_linear_loss as loss_module
from mp_grpo.ops.output_chunks import plan_chunks

COPY_BANDWIDTH = 3.0e12
"""Bytes/s an H100's memory-bound passes move (read + write), docs/kernel.md ("Floor")."""
GEMM_EPILOGUE_EXPOSED = 0.38
"""The share of a GEMM's extra epilogue bytes that shows in its time: (30.16 − 29.53) ms / 1.66 ms, the harness's
``torch.mm`` with fp32 vs bf16 output at N = 16384, V = 151936, H = 4096."""
GiB = 2**30

CCE_ANCHOR = {
    # (impl, TP) -> (fwd+bwd ms, extra peak GiB) at N = 16384, H = 4096, V = 151936, H100s
    ("cce", 1): (124.704, 0.002), ("cce_exact", 1): (472.146, 2.444),
    ("cce", 2): (64.257, 0.376), ("cce_exact", 2): (240.148, 1.286),
    ("cce", 4): (33.21, 0.376), ("cce_exact", 4): (122.389, 0.705),
}
ANCHOR_V = 151936

PRECISION_ANCHOR = {
    # predicted log-prob max abs. error vs float64 on the benchmark's unit-scale logits (h ~ N(0, 0.25), W ~ N(0,
    # 4e-4): logits of std ~0.64), by logits setting: the harness's figures at the same inputs for bf16 (mp_grpo's
    # fused op, 7.5e-3) and cut-cross-entropy (1.9e-5 / 2.0e-5 at TP = 1); fp32 logits: the fp32 accumulation's
    # error, which the GPU targets bound by 5e-4 at logit max ~30 and which scales with the logits (max here ~3):
    # ~3e-5.
    "bf16": 7.5e-3, "fp32": 3e-5, "cce": 1.9e-5, "cce_exact": 2.0e-5,
}


def _ms(nbytes: float) -> float:
    return nbytes / COPY_BANDWIDTH * 1e3


def predict(key: str, n: int, hidden_size: int, v_local: int, baseline: dict | None, tp: int = 1) -> dict:
    """``{"fwd_bwd_ms", "extra_peak_GiB", "logprob_max_abs", "basis"}`` for row ``key`` (missing what the model does
    not cover); ``baseline``: the bf16 counterpart's measured row of the same run (None: no time prediction for
    fp32 rows)."""
    e = n * v_local
    if key in ("cce", "cce_repo", "cce_exact"):
        impl = "cce_exact" if key == "cce_exact" else "cce"
        ms, gib = CCE_ANCHOR[(impl, tp)]
        scale = v_local * tp / ANCHOR_V
        mem = gib * scale if impl == "cce_exact" else gib
        return {"fwd_bwd_ms": ms * scale, "extra_peak_GiB": mem, "logprob_max_abs": PRECISION_ANCHOR[impl],
                "basis": f"harness measurement at V = {ANCHOR_V}, TP = {tp}, x V / {ANCHOR_V}"}
    if key not in ("per_token_fp32", "loss_fp32", "logits_fp32"):
        return {"logprob_max_abs": PRECISION_ANCHOR["bf16"]} if key in ("per_token", "loss", "logits") else {}
    gemm = GEMM_EPILOGUE_EXPOSED * _ms(2 * e)  # one GEMM writing fp32 instead of bf16
    read = _ms(2 * e)  # one Triton pass reading fp32 instead of bf16
    out = {"logprob_max_abs": PRECISION_ANCHOR["fp32"]}
    if key == "per_token_fp32":
        # forward: GEMM + statistics; backward: recompute GEMM + backward kernel (its bf16 write unchanged)
        bf = plan_chunks(n, hidden_size, v_local, torch.bfloat16)
        fp = plan_chunks(n, hidden_size, v_local, torch.float32)
        col_chunks = -(-v_local // fp.backward_cols) - -(-v_local // bf.backward_cols)
        acc = col_chunks * _ms(2 * min(n, fp.backward_rows) * hidden_size * 4)  # fp32 [rows, H] read + write
        delta, mem = 2 * (gemm + read) + acc, 0.0  # chunk budgets in bytes: the same buffers
        basis = (f"bf16 op + 2 GEMMs writing fp32 ({2 * gemm:.2f} ms) + 2 Triton reads of fp32 ({2 * read:.2f} ms) "
                 f"+ {col_chunks} more backward vocabulary chunks re-reading the hidden-gradient accumulator "
                 f"({acc:.2f} ms)")
    elif key == "loss_fp32":
        budget = getattr(loss_module, "LOSS_LOGITS_CHUNK_BYTES_FP32", loss_module.LOSS_LOGITS_CHUNK_BYTES)
        bf = plan_chunks(n, hidden_size, v_local, torch.bfloat16, logits_chunk_bytes=loss_module.LOSS_LOGITS_CHUNK_BYTES)
        fp = plan_chunks(n, hidden_size, v_local, torch.float32, logits_chunk_bytes=budget)
        chunks_bf, chunks_fp = -(-n // bf.forward_rows), -(-n // fp.forward_rows)

        def wgrad_elt(chunks):
            fits = v_local * hidden_size * 4 <= loss_module.WEIGHT_GRAD_FP32_BYTES
            return 4 if chunks > 1 and fits else 2

        w_bytes = v_local * hidden_size
        # weight gradient: one write, then a read + write per further chunk; backward's scaling reads it once
        def wgrad_ms(chunks):
            elt = wgrad_elt(chunks)
            return _ms(w_bytes * elt * (1 + 2 * (chunks - 1)) + w_bytes * elt)

        wg = wgrad_ms(chunks_fp) - wgrad_ms(chunks_bf)
        delta = gemm + 2 * read + wg  # GEMM + statistics read + backward kernel's read (its bf16 write unchanged)
        chunk_bf = bf.forward_rows * v_local * 2
        chunk_fp = fp.forward_rows * v_local * 4
        mem = (chunk_fp - chunk_bf + w_bytes * (wgrad_elt(chunks_fp) - wgrad_elt(chunks_bf))) / GiB
        basis = (f"bf16 op + GEMM writing fp32 ({gemm:.2f} ms) + 2 Triton reads of fp32 ({2 * read:.2f} ms) + "
                 f"{chunks_fp} row chunks instead of {chunks_bf} (weight gradient {wg:+.2f} ms); chunk "
                 f"{chunk_fp / GiB:.2f} vs {chunk_bf / GiB:.2f} GiB")
    else:  # logits_fp32: batch_major_linear at fp32 + vocab_parallel_logprobs(inplace_backward)
        # statistics read +2E; backward kernel read +2E, write +2E (fp32 gradient in place); its cast to bf16 for
        # the GEMMs: read 4E, write 2E
        delta = gemm + _ms(2 * e + 4 * e + 6 * e)
        mem = (4 * e + 2 * e - 2 * e) / GiB  # fp32 logits + the bf16 copy of their gradient, for bf16 logits
        basis = f"bf16 row + GEMM writing fp32 ({gemm:.2f} ms) + 12E bytes of memory-bound passes ({_ms(12 * e):.2f} ms)"
    if baseline is not None and "fwd_bwd_ms" in baseline:
        out["fwd_bwd_ms"] = baseline["fwd_bwd_ms"] + delta
        out["extra_peak_GiB"] = baseline["extra_peak_GiB"] + mem
    out.update(delta_ms=delta, delta_GiB=mem, basis=basis)
    return out
