"""scripts/bench_step.py end to end at a tiny size on GPUs (skipped without CUDA; the TP = 2 case without 2 GPUs).

    python -m pytest tests/gpu/test_bench_step.py -v -s

The tiny shape (``step_model.SHAPES["tiny"]``: H 64, 2 layers, V 1024) at 128- and 512-token rows, both recompute
modes (the forward-only rows with selective recompute only), every path (``logits_model_layer`` included), the whole
GRPO step at 128 tokens, the max-micro-batch search capped at 32768 tokens, on the layer spec ``--spec``'s default
picks (Transformer Engine's where it imports; the report's name and ``meta.spec`` say which); then the same command
again, which must find every row measured and add none (resume). The script's own check runs first: the loss paths'
gradients on GPTModel agree within bf16 tolerance. Every timed row carries its rounds and, but for the floor, its
ratio's 95 % interval around the median. At TP = 2 (two GPUs, torchrun): the training and forward-only rows of the
128-token configuration, interleaved on both ranks (each round the slowest rank's), no search.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu.launch import REPO_ROOT, gpu_run

PATHS = ["floor", "common", "logits", "fused", "logits_model_layer"]
ROUNDS = 4


def _bench(out: Path, *extra: str, nproc: int = 0) -> str:
    script = [str(REPO_ROOT / "scripts" / "bench_step.py"), "--shape", "tiny", "--paths", *PATHS, "--rounds", str(ROUNDS),
              "--step-rounds", "2", "--max-tokens", "32768", "--out", str(out), *extra]
    launcher = [sys.executable] if nproc == 0 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={nproc}"]
    return gpu_run([*launcher, *script], what="bench_step.py", tf32_off=False)  # its fp32_head_tf32 path wants TF32


def _spec() -> str:
    from mp_grpo.megatron.gpt import have_transformer_engine

    return "te" if have_transformer_engine() else "local"


def _check_rounds(r: dict) -> None:
    assert r["rounds"] == len(r["times_ms"]) and r["ms"] > 0 and r["peak_GiB"] > 0, r
    if r["path"] != "floor":
        v = r["vs_floor"]
        assert v["n"] == r["rounds"] and v["low"] <= v["median"] <= v["high"], r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_step_tiny_end_to_end(tmp_path: Path) -> None:
    args = ("--seq", "128", "512", "--step-configs", "tiny@128")
    print(_bench(tmp_path, *args))
    spec = _spec()
    name = "step" if spec == "te" else "step_local"
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["meta"]["spec"] == spec and data["meta"]["check_worst_relative_l2"] <= 1.6e-2
    rows = {(r["seq"], r["recompute"], r["kind"], r["path"]): r for r in data["rows"]}
    for seq in (128, 512):
        for recompute in ("selective", "full"):
            for kind in ("train", "forward"):
                for path in PATHS:
                    if kind == "forward" and recompute == "full":  # no-grad passes: measured once
                        assert (seq, recompute, kind, path) not in rows
                        continue
                    r = rows[(seq, recompute, kind, path)]
                    _check_rounds(r)
                    assert r["rounds"] == ROUNDS
                    assert r["max_tokens"] >= r["tokens"], r  # the timed micro-batch fits
                    assert r["probes"][0] == [r["B"], True]
                    assert r["first_failure_B"] is None or r["first_failure_B"] == r["max_B"] + 1, r  # to one row
            for path in PATHS:
                assert ((seq, recompute, "step", path) in rows) == (seq == 128)
    floor = rows[(128, "selective", "train", "floor")]
    assert floor["times_ms"] == pytest.approx([d + m for d, m in zip(floor["decoder_times_ms"], floor["matmul_times_ms"])])
    assert (tmp_path / f"{name}.md").exists() and (tmp_path / f"{name}.png").stat().st_size > 10_000
    # Resume: nothing left to measure.
    again = _bench(tmp_path, *args)
    assert "===" not in again, again[-3000:]
    assert json.loads((tmp_path / f"{name}.json").read_text())["rows"] == data["rows"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_bench_step_tiny_tp2_interleaved(tmp_path: Path) -> None:
    print(_bench(tmp_path, "--seq", "128", "--recompute", "selective", "--step-configs", "--no-search", nproc=2))
    name = "step_tp" if _spec() == "te" else "step_tp_local"
    data = json.loads((tmp_path / f"{name}.json").read_text())
    rows = [r for r in data["rows"] if r["kind"] in ("train", "forward")]
    assert {(r["kind"], r["path"]) for r in rows} == {(k, p) for k in ("train", "forward") for p in PATHS}
    for r in rows:
        _check_rounds(r)
        assert r["tp"] == 2 and len(r["ms_per_rank"]) == 2 and r["ms"] >= min(r["ms_per_rank"]), r
