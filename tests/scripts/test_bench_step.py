"""The building blocks of scripts/bench_step.py at tiny sizes on CPU.

- The max-micro-batch search (``measure.largest_fitting``) against a fake memory limit, for every true maximum
  and guess; ``measure.fits_in_memory`` with fake out-of-memory errors (the failed call's tensors are released,
  other errors raised); the memory model's first guess.
- The common path's loss (``step_paths.common_ppo_loss``, verl's vanilla PPO loss written from its description)
  against the float64 reference of verl's loss in ``tests/reference.py``, value and gradient.
- The row builders on the CPU stand-ins (2 gloo ranks, TP = 2, megatron-core's ``parallel_state``, tied
  embeddings, fp32 ``main_grad``): the common, logits, logits-on-the-model's-layer and fused training passes, their
  fp32 logit precision and the frameworks' fp32 head (TF32 on and off) give the same gradients (one objective);
  the floor's pass reaches every decoder parameter and not through the output layer; the forward-only passes give
  the float64 log-probs; a whole GRPO step feeds its forward-only log-probs to the training pass and steps the
  optimizer.
- The report: results saved and loaded (resume), ratios, target lines, markdown and plot; the TP report
  (``step_tp``: rows keyed by TP size, the extra targets, the TP-scaling plot) and a dry run's report.
"""

from __future__ import annotations

import json
import sys
import weakref
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.distributed import REPO_ROOT, torchrun, worker_main
from tests.reference import logprobs_reference, verl_actor_loss_reference
from tests.tolerances import assert_close

sys.path.insert(0, str(REPO_ROOT / "scripts"))

import measure  # noqa: E402
import step_report  # noqa: E402
from step_paths import Path as StepPath  # noqa: E402
from step_paths import common_ppo_loss, unavailable  # noqa: E402


# ------------------------------------------------------------------------------------------- the search
@settings(max_examples=300, deadline=None)
@given(true_max=st.integers(0, 70), guess=st.integers(-5, 80), limit=st.integers(1, 64),
       known_fit=st.integers(0, 3))
def test_largest_fitting_finds_the_true_maximum(true_max: int, guess: int, limit: int, known_fit: int) -> None:
    known_fit = min(known_fit, true_max, limit)
    probes = []

    def fits(b: int) -> bool:
        assert known_fit < b <= limit, f"probe {b} outside ({known_fit}, {limit}]"
        assert b not in probes, f"probe {b} repeated"
        probes.append(b)
        return b <= true_max

    found = measure.largest_fitting(fits, guess, limit=limit, known_fit=known_fit)
    assert found.largest == min(true_max, limit)
    assert found.first_failure == (true_max + 1 if true_max < limit else None)
    assert [b for b, _ in found.probes] == probes


def test_largest_fitting_takes_two_probes_from_a_guess_off_by_one() -> None:
    for guess, true_max in ((40, 40), (41, 40)):
        found = measure.largest_fitting(lambda b: b <= true_max, guess, limit=1000, known_fit=4)
        assert found.largest == true_max and len(found.probes) == 2, found.probes


def test_largest_fitting_respects_a_known_failure() -> None:
    found = measure.largest_fitting(lambda b: b <= 5, 30, limit=100, known_fit=2, known_failure=8)
    assert found.largest == 5 and found.first_failure == 6
    assert all(2 < b < 8 for b, _ in found.probes)
    with pytest.raises(ValueError, match="known_fit"):
        measure.largest_fitting(lambda b: True, 3, limit=10, known_fit=5, known_failure=5)


def test_fits_in_memory_with_fake_out_of_memory(monkeypatch) -> None:
    monkeypatch.setattr(measure, "peak_bytes", lambda fn: (fn(), 123)[1])
    held = []

    def runs_out():
        big = torch.empty(1000)
        held.append(weakref.ref(big))
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert measure.fits_in_memory(runs_out) == (False, None)
    assert held[0]() is None, "the failed call's tensors were not released"

    def cublas():
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)")

    assert measure.fits_in_memory(cublas) == (False, None)
    assert measure.fits_in_memory(lambda: None) == (True, 123)

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        measure.fits_in_memory(broken)


def test_memory_model_guess() -> None:
    import bench_step

    gib = 2**30
    # base 10 GiB, 2 GiB per row: peaks 18 GiB at B = 4, 26 at B = 8; 80 GiB usable -> B = 35.
    assert bench_step.memory_model_guess(4, 18 * gib, 8, 26 * gib, usable=80 * gib, base=10 * gib) == 35
    # One point: the line from the base through (4, 18 GiB) -> 35 as well.
    assert bench_step.memory_model_guess(4, 18 * gib, 4, None, usable=80 * gib, base=10 * gib) == 35


# ------------------------------------------------------------------------------------------- the common loss
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_common_ppo_loss_equals_verl_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + torch.seed() % 1000)
    shape = (4, 9)
    old = -torch.rand(shape, generator=gen) * 5
    lp = (old + torch.randn(shape, generator=gen) * 0.4).requires_grad_()  # ratios on both sides of the clip
    adv = torch.randn(shape[0], generator=gen).unsqueeze(1).expand(shape)
    mask = torch.rand(shape, generator=gen) < 0.7
    loss = common_ppo_loss(lp, old, adv, mask, denominator=float(mask.sum()))
    upstream = torch.randn((), generator=gen)
    (loss * upstream).backward()
    lp64 = lp.detach().double().requires_grad_()
    ref = verl_actor_loss_reference(lp64, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    (ref * upstream.double()).backward()
    assert_close(loss, ref, torch.float32, msg="loss")
    assert_close(lp.grad, lp64.grad, torch.float32, msg="gradient")


# ------------------------------------------------------------------------------------------- the rows on CPU
def _cpu_rig(groups, seq: int):
    from step_model import cpu_rig

    rig = cpu_rig(groups, hidden=16, vocab=64, seq_len=seq)
    return rig, rig.model.module


def _full_grads(model) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    group = model.word_embeddings.tp_group
    out = {}
    for name, p in model.named_parameters():
        g = p.main_grad.clone()
        if getattr(p, "tensor_model_parallel", False) and group.size() > 1:
            parts = [torch.empty_like(g) for _ in range(group.size())]
            dist.all_gather(parts, g.contiguous(), group=group)
            g = torch.cat(parts)
        out[name] = g
    return out


def case_rows(tp: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from step_model import synthetic_micro_batches
    from step_paths import forward_pass, grpo_step, training_pass

    from mp_grpo.megatron import ParallelGroups

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        groups = ParallelGroups.from_parallel_state()
        seq = 12
        rig, model = _cpu_rig(groups, seq)
        micro = synthetic_micro_batches(2, 2, seq, rig.vocab, seed=5, device="cpu")
        # --- training passes: one objective, one gradient ---
        grads = {}
        available = [p for p in StepPath if unavailable(p) is None]  # the fp32 rows need mp_grpo.LogitDtype
        for path in available:
            rig.zero_grad()
            training_pass(rig, path, micro)()
            grads[path] = _full_grads(model)
        ref = grads[StepPath.COMMON]
        for path in (p for p in available if p not in (StepPath.COMMON, StepPath.FLOOR)):
            for name, g in ref.items():
                assert_close(grads[path][name], g, torch.float32, msg=f"{path.value} grad of {name}")
        floor = grads[StepPath.FLOOR]
        for name, g in floor.items():
            assert torch.count_nonzero(g) > 0, f"floor: no gradient reached {name}"
        # The floor has no output layer: the tied weight gets only the embedding's (sparse) gradient.
        emb = floor["word_embeddings.weight"]
        assert torch.count_nonzero(emb.abs().sum(1)) < emb.shape[0], "floor: the output layer's gradient reached the weight"
        # --- forward-only passes: the float64 log-probs of the full logits ---
        full_logits = []
        with torch.no_grad():
            for mb in micro:
                local = model(mb.input_ids, mb.position_ids, None)
                parts = [torch.empty_like(local) for _ in range(tp)]
                dist.all_gather(parts, local.contiguous(), group=groups.tp)
                full_logits.append(torch.cat(parts, dim=-1))
        assert forward_pass(rig, StepPath.FLOOR, micro)() is None
        for path in (p for p in available if p != StepPath.FLOOR):
            out = forward_pass(rig, path, micro)()
            for i, (lp, logits, mb) in enumerate(zip(out, full_logits, micro)):
                expected, _ = logprobs_reference(logits, mb.targets)
                expected = torch.where(mb.loss_mask, expected, torch.zeros_like(expected))
                assert not lp.requires_grad
                assert_close(torch.where(mb.loss_mask, lp, torch.zeros_like(lp)), expected, torch.float32,
                             msg=f"{path.value} forward-only log-probs of micro-batch {i}")
        # --- a whole GRPO step: forward-only log-probs -> training pass on them -> optimizer step ---
        class Optimizer:
            """Records the gradient it steps on; SGD on the fp32 main_grad, as Megatron's optimizer reads it."""

            def __init__(self) -> None:
                self.steps, self.zeroed = [], 0

            def zero_grad(self) -> None:
                self.zeroed += 1

            @torch.no_grad()
            def step(self) -> None:
                self.steps.append(_full_grads(model))
                for p in model.parameters():
                    p.sub_(0.1 * p.main_grad)

        for path in (StepPath.COMMON, StepPath.LOGITS, StepPath.FUSED, StepPath.FLOOR):
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            optimizer = Optimizer()
            grpo_step(rig, path, micro, optimizer)()
            assert len(optimizer.steps) == 1 and optimizer.zeroed == 1
            # Old log-probs from the forward-only pass of the same weights: on-policy, the training pass's gradient.
            for name, g in grads[path].items():
                assert_close(optimizer.steps[0][name], g, torch.float32, msg=f"GRPO step {path.value} grad of {name}")
            assert any(not torch.equal(before[n], p) for n, p in model.named_parameters()), "the optimizer did not step"
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(before[n])
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("tp", [1, 2])
def test_row_builders_on_cpu_stand_ins(tp: int) -> None:
    torchrun(__file__, "case_rows", nproc=tp, tp=tp)


# ------------------------------------------------------------------------------------------- the report
def test_results_resume_and_report(tmp_path: Path) -> None:
    path = tmp_path / "step.json"
    results = step_report.Results.load(path)
    results.start(command="python scripts/bench_step.py --shape tiny", spec="local")
    rows = {"floor": (100.0, 1000), "common": (110.0, 600), "logits": (101.5, 900), "fused": (100.5, 980)}
    for kind in ("train", "forward"):
        for name, (ms, tokens) in rows.items():
            key = step_report.row_key("1.5b", 2048, "selective", kind, name)
            results.update(key, {"B": 4, "tokens": 8192, "ms": ms, "peak_bytes": 2**30, "peak_GiB": 1.0})
            assert not results.complete(key, search=True) and results.complete(key, search=False)
            results.update(key, {"max_B": tokens // 2048, "max_tokens": tokens, "first_failure_B": tokens // 2048 + 1})
    step_report.write_reports(results, tmp_path, plot=True)
    again = step_report.Results.load(path)
    assert again.rows == results.rows and again.complete(step_report.row_key("1.5b", 2048, "selective", "train", "fused"),
                                                         search=True)
    text = (tmp_path / "step.md").read_text()
    assert "| 1.5b | 2048 | selective | fused | 100.5 | 1.005 |" in text
    targets = step_report.targets(again)
    assert any("train, fused time vs floor = 1.0050 (target ≤ 1.01): met" in t for t in targets)
    assert any("forward, fused time vs floor = 1.0050 (target ≤ 1.01): met" in t for t in targets)
    assert any("logits time vs floor = 1.0150 (target ≤ 1.02): met" in t for t in targets)
    assert any("fused tokens vs floor = 0.9800 (target ≥ 0.95): met" in t for t in targets)
    assert any(t.endswith("logits tokens vs common = 1.5000 (target ≥ 2.0): NOT MET") for t in targets)
    # a forward row whose common path fits as much as the floor: the miss says the decoder bounds it
    for name, tokens in (("floor", 600), ("common", 600), ("logits", 600)):
        key = step_report.row_key("1.5b", 8192, "selective", "forward", name)
        again.update(key, {"B": 1, "tokens": 8192, "ms": 100.0, "peak_bytes": 2**30, "peak_GiB": 1.0, "max_B": 1,
                           "max_tokens": tokens, "first_failure_B": 2})
    bounded = [t for t in step_report.targets(again) if "8192" in t and "tokens vs common" in t]
    assert len(bounded) == 1 and "NOT MET — the common path already fits the floor's own" in bounded[0]
    assert (tmp_path / "step.png").stat().st_size > 10_000


def test_tp_report(tmp_path: Path) -> None:
    """step_tp: rows of TP = 1, 2 and 4 side by side (keyed by TP size), the TP targets (the logits path's tokens, the
    fp32 fused path's time and tokens), the predictions table, the TP-scaling plot; a dry run's report says so."""
    assert step_report.report_name(1, "local") == "step_local" and step_report.report_name(4, "local") == "step_tp_local"
    results = step_report.Results.load(tmp_path / "step_tp.json")
    results.start(command="torchrun --nproc_per_node 2 scripts/bench_step.py", device="NVIDIA H100 80GB HBM3",
                  spec="local")
    rows = {"floor": (100.0, 1000), "logits": (100.4, 1000), "fused": (100.8, 1000), "fused_fp32": (101.5, 1000),
            "logits_fp32": (101.9, 900), "fp32_head": (150.0, 800)}
    for tp, shape in ((1, "1.5b"), (2, "1.5b"), (4, "7b")):
        for kind in ("train", "forward"):
            for name, (ms, tokens) in rows.items():
                key = step_report.row_key(shape, 2048, "selective", kind, name, tp)
                results.update(key, {"B": 4, "tokens": 8192, "ms": ms * tp, "peak_bytes": 2**30, "peak_GiB": 1.0,
                                     "max_B": tokens // 2048, "max_tokens": tokens, "first_failure_B": tokens // 2048 + 1,
                                     **({"ms_per_rank": [ms * tp] * tp} if tp > 1 else {})})
    step_report.write_reports(results, tmp_path, plot=True)
    again = step_report.Results.load(tmp_path / "step_tp.json")
    assert again.rows == results.rows and again.tp_sizes() == [1, 2, 4]
    assert all(r["tp"] in (1, 2, 4) for r in again.rows.values())  # the TP report keys every row, TP = 1 included
    text = (tmp_path / "step_tp.md").read_text()
    assert "| 4 | 7b | 2048 | selective | fused_fp32 | 406.0 [406.0 / 406.0 / 406.0 / 406.0] | 1.015 |" in text
    targets = step_report.targets(again)
    assert any("7b @ 2048, selective, TP = 4, train, fused_fp32 time vs floor = 1.0150 (target ≤ 1.02): met" in t
               for t in targets)
    assert any("TP = 2, train, logits tokens vs floor = 1.0000 (target ≥ 0.95): met" in t for t in targets)
    assert any("TP = 1, forward, fused_fp32 time vs floor = 1.0150 (target ≤ 1.02): met" in t for t in targets)
    assert "| 4 | 7b | 2048 | train | fused | time vs floor | 1.004 | 1.008 |" in text  # prediction beside measurement
    assert (tmp_path / "step_tp_scaling.png").stat().st_size > 10_000 and (tmp_path / "step_tp.png").exists()
    # the TP = 1 report is untouched by TP rows: its keys and rows carry no TP
    plain = step_report.Results.load(tmp_path / "step.json")
    plain.update(step_report.row_key("1.5b", 2048, "selective", "train", "floor"), {"ms": 1.0})
    assert "tp" not in next(iter(plain.rows.values()))
    # a dry run: titled as one, no targets checked
    dry = step_report.Results.load(tmp_path / "dry" / "step_tp.json")
    (tmp_path / "dry").mkdir()
    dry.start(command="bench_step.py --dry-run", device="CPU", dry_run=True, spec="local")
    dry.rows = again.rows
    step_report.write_reports(dry, tmp_path / "dry", plot=False)
    text = (tmp_path / "dry" / "step_tp.md").read_text()
    assert "DRY RUN — not a measurement" in text and step_report.targets(dry) == [
        "- a dry run: stubbed measurements, no target is checked"]


def test_time_misses_against_the_output_layer(tmp_path: Path) -> None:
    """A training pass over its time target: its excess over the floor in ms and in multiples of the floor's bare
    output matmuls, the forward-only pass beside it; a pass within its targets has no line."""
    results = step_report.Results.load(tmp_path / "step_tp.json")
    results.start(command="torchrun --nproc_per_node 2 scripts/bench_step.py", device="NVIDIA H100 80GB HBM3",
                  spec="local")
    for tp, train in ((2, {"floor": 100.0, "logits": 105.0, "fused": 101.0}), (4, {"floor": 100.0, "logits": 100.5})):
        for kind, times in (("train", train), ("forward", {"floor": 40.0, "logits": 39.0})):
            for name, ms in times.items():
                extra = {"decoder_ms": ms - 2.5, "matmul_ms": 2.5} if name == "floor" else {}
                results.update(step_report.row_key("1.5b", 2048, "selective", kind, name, tp),
                               {"ms": ms, "peak_GiB": 1.0, "peak_bytes": 2**30, "B": 4, "tokens": 8192, **extra})
    lines = step_report.time_misses(results)
    assert lines == ["- TP = 2, 1.5b @ 2048, selective: over the floor's 100.0 ms, logits +5.0 ms — 2.0× the output "
                     "layer's whole GPU work in the pass (its three bare GEMMs on this rank's shard: 2.5 ms); the "
                     "forward-only pass of the same configuration: logits 0.975× the floor."]
    step_report.write_reports(results, tmp_path, plot=False)
    assert lines[0] in (tmp_path / "step_tp.md").read_text()


def test_tp_report_merge(tmp_path: Path) -> None:
    """Two device calls' step_tp.json files in one report: every row kept (the later file wins a row measured in
    both), both runs' commands; a dry run's file refused."""
    parts = []
    for i, (tp, ms) in enumerate(((2, 100.0), (4, 200.0))):
        results = step_report.Results.load(tmp_path / f"run{i}" / "step_tp.json")
        (tmp_path / f"run{i}").mkdir()
        results.start(command=f"run {i}", device="H100", spec="local")
        for name in ("floor", "fused"):
            results.update(step_report.row_key("1.5b", 2048, "selective", "train", name, tp),
                           {"ms": ms + (name == "fused"), "peak_GiB": 1.0, "peak_bytes": 2**30, "B": 4, "tokens": 8192})
        results.save()
        parts.append(results.path)
    merged = step_report.merge(parts, tmp_path / "merged")
    assert merged.tp_sizes() == [2, 4] and [r["command"] for r in merged.meta["runs"]] == ["run 0", "run 1"]
    assert merged.path.name == "step_tp_local.json"  # the local spec's rows: the local report's name
    assert "| 4 | 1.5b | 2048 | selective | fused | 201.0 | 1.005 |" in (tmp_path / "merged" / "step_tp_local.md").read_text()
    dry = step_report.Results.load(tmp_path / "dry.json")
    dry.start(command="dry", device="CPU", dry_run=True, spec="local")
    dry.update(step_report.row_key("1.5b", 2048, "selective", "train", "floor", 2), {"ms": 1.0, "peak_GiB": 1.0})
    dry.save()
    with pytest.raises(SystemExit, match="dry run"):
        step_report.merge([dry.path], tmp_path / "merged2")


def _te_rows(results, kind: str, rows: dict) -> None:
    for name, (ms, vs, tokens) in rows.items():
        values = {"B": 4, "tokens": 8192, "ms": ms, "peak_bytes": 2**30, "peak_GiB": 1.0, "rounds": 20,
                  "max_B": tokens // 2048, "max_tokens": tokens, "first_failure_B": tokens // 2048 + 1}
        if vs is not None:
            values["vs_floor"] = dict(zip(("median", "low", "high"), vs), coverage=0.9586, n=20)
        results.update(step_report.row_key("1.5b", 2048, "selective", kind, name), values)


def test_te_targets_read_the_interval(tmp_path: Path) -> None:
    """Transformer Engine's spec: the fused path at bf16 and fp32 logits ≤ 1.01× the floor (the median per-round ratio,
    not the ratio of the medians) with the interval's upper end ≤ 1.02 in the training pass, ≤ 1.01× in the
    forward-only pass, ≥ 0.97× the floor's largest micro-batch; the markdown shows each interval."""
    results = step_report.Results.load(tmp_path / "step.json")
    results.start(command="python scripts/bench_step.py --spec te", device="NVIDIA H200", spec="te")
    _te_rows(results, "train", {"floor": (100.0, None, 45056), "fused": (103.0, (1.008, 1.001, 1.025), 43008),
                                "fused_fp32": (101.0, (1.009, 1.004, 1.015), 45056)})
    _te_rows(results, "forward", {"floor": (40.0, None, 400000), "fused": (40.2, (1.005, 1.001, 1.009), 400000)})
    lines = step_report.targets(results)
    assert any(t.endswith("train, fused time vs floor = 1.0080 (target ≤ 1.01): met") for t in lines), lines
    assert any(t.endswith("train, fused time vs floor high = 1.0250 (target ≤ 1.02): NOT MET") for t in lines)
    assert any(t.endswith("train, fused tokens vs floor = 0.9545 (target ≥ 0.97): NOT MET") for t in lines)
    assert any(t.endswith("train, fused_fp32 time vs floor high = 1.0150 (target ≤ 1.02): met") for t in lines)
    assert any(t.endswith("forward, fused time vs floor = 1.0050 (target ≤ 1.01): met") for t in lines)
    assert not any("fused_fp32" in t and "forward" in t for t in lines)  # not run in that pass: no line
    step_report.write_reports(results, tmp_path, plot=False)
    text = (tmp_path / "step.md").read_text()
    assert "Transformer Engine's layer spec" in text and "Caveat" not in text
    assert "| 1.5b | 2048 | selective | fused | 103.0 | 1.008 [1.001, 1.025] |" in text  # the median ratio, not 103/100


def test_a_report_holds_one_spec(tmp_path: Path) -> None:
    """A report written before the spec was recorded holds local-spec rows; a run of the other spec is refused and
    pointed to its own report."""
    legacy = tmp_path / "step_local.json"
    legacy.write_text(json.dumps({"meta": {"runs": []}, "rows": [
        {"shape": "1.5b", "seq": 2048, "recompute": "selective", "kind": "train", "path": "floor", "ms": 1.0}]}))
    old = step_report.Results.load(legacy)
    assert old.spec == "local"
    with pytest.raises(SystemExit, match="local layer spec.*--report step\\b"):
        old.start(command="x", spec="te")
    old.start(command="x", spec="local")  # the same spec resumes
    te = step_report.Results.load(tmp_path / "step_tp.json")
    te.start(command="y", spec="te")
    te.update(step_report.row_key("1.5b", 2048, "selective", "train", "floor", 2), {"ms": 1.0})
    with pytest.raises(SystemExit, match="--report step_tp_local"):
        te.start(command="z", spec="local")
    assert [step_report.report_name(tp, spec) for tp in (1, 2) for spec in ("te", "local")] == [
        "step", "step_local", "step_tp", "step_tp_local"]


def test_layer_specs() -> None:
    """The local spec always builds; TE's is refused with the reason where transformer_engine does not import."""
    from step_model import LayerSpec, default_spec, layer_spec

    from mp_grpo.megatron.gpt import have_transformer_engine

    assert layer_spec(LayerSpec.LOCAL) is not None
    if have_transformer_engine():
        assert default_spec() == LayerSpec.TE and layer_spec(LayerSpec.TE) is not None
    else:
        assert default_spec() == LayerSpec.LOCAL
        with pytest.raises(RuntimeError, match="--spec te: transformer_engine does not import"):
            layer_spec(LayerSpec.TE)


def test_dry_run_end_to_end(tmp_path: Path) -> None:
    """``bench_step.py --dry-run`` through every new part on the CPU: the interleaved rounds (every row's per-round
    times and its ratio's interval; the floor's time = its decoder's + its matmuls' per round), the search ending at
    a step of one row, the memory snapshots and their report, the whole step, the phases' seconds, the spec in the
    report. Stubbed figures: only the plumbing is checked."""
    import subprocess

    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "bench_step.py"), "--dry-run", "--spec", "te", "--out", str(out),
           "--shape", "1.5b", "--seq", "2048", "--recompute", "selective", "--paths", "floor", "fused_fp32",
           "--rounds", "3", "--step-rounds", "2", "--warmup", "0", "--no-check", "--memory-snapshot", str(tmp_path / "snap")]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads((out / "step.json").read_text())
    assert data["meta"]["spec"] == "te" and data["meta"]["dry_run"]
    rows = {(r["kind"], r["path"]): r for r in data["rows"]}
    assert set(rows) == {(k, p) for k in ("train", "forward", "step") for p in ("floor", "fused_fp32")}
    for (kind, path), r in rows.items():
        rounds = 2 if kind == "step" else 3
        assert r["rounds"] == rounds and len(r["times_ms"]) == rounds and r["ms"] == measure.median(r["times_ms"])
        if path == "floor":
            assert r["times_ms"] == pytest.approx([d + m for d, m in zip(r["decoder_times_ms"], r["matmul_times_ms"])])
            continue
        floor = rows[(kind, "floor")]["times_ms"]
        ratios = sorted(t / f for t, f in zip(r["times_ms"], floor))
        assert r["vs_floor"]["n"] == rounds and r["vs_floor"]["median"] == pytest.approx(measure.median(ratios))
        assert (r["vs_floor"]["low"], r["vs_floor"]["high"]) == pytest.approx((ratios[0], ratios[-1]))
        if kind != "step":  # the search ends at a step of one row
            assert r["first_failure_B"] == r["max_B"] + 1, r["probes"]
    snap = tmp_path / "snap" / "1.5b@2048@selective"
    assert {f.name for f in snap.iterdir()} == {"train_floor.pickle", "train_fused_fp32.pickle", "memory_snapshot.md"}
    lines = data["meta"]["memory_snapshot"]["1.5b@2048@selective"]
    assert any(line.startswith("- `fused_fp32` peaks") for line in lines)
    assert any("dry_fused_fp32_extra" in line and line.strip().startswith("- +") for line in lines)
    assert set(data["meta"]["phase_s"]["1.5b@2048@selective"]) >= {"train", "forward", "search_train", "memory_snapshot",
                                                                    "step"}
    text = (out / "step.md").read_text()
    assert text.startswith("# A GRPO step of a Qwen2.5-shaped model on one GPU, Transformer Engine's layer spec")
    assert "DRY RUN — not a measurement" in text and "## Memory at the peak" in text


if __name__ == "__main__":
    worker_main({"case_rows": case_rows})
