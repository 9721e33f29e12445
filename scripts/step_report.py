"""Results and reports of ``bench_step.py``: ``step.json`` (TP = 1, resumable), ``step.md`` (tables, targets,
predictions beside the measurements) and ``step.png``; under tensor parallelism ``step_tp.{json,md,png}`` (rows
of every TP size, keyed by it; TP = 1 rows measured in the same session may sit there too) and
``step_tp_scaling.png`` (each path against the floor, per TP size). Those names hold Transformer Engine's layer
spec; the local spec's reports are ``step_local`` and ``step_tp_local`` (``report_name``). A report holds one
spec (``meta.spec``; a file from before the spec was recorded holds local-spec rows).

A row's time against the floor is the median of its per-round ratios with a 95 % interval (``vs_floor``, from
``bench_step.py``'s interleaved rounds); rows measured before the rounds have the ratio of the two medians only.

The targets, on every configuration: in the training and the forward-only passes the fused path takes ≤ 1.01×
the floor's time and fits ≥ 0.95× its tokens and the logits path takes ≤ 1.02× the floor's time; the whole step
is held to the same time targets; the forward-only pass on the logits path fits ≥ 2× the common path's tokens.
In the TP report also: the logits path fits ≥ 0.95× the floor's tokens; the fp32 fused path takes ≤ 1.02× the
floor's time in both passes and fits the floor's largest micro-batch (≥ 1.0×). On Transformer Engine's spec the
fused path at bf16 and at fp32 logits: ≤ 1.01× the floor's time in the training pass with the 95 % interval's
upper end below 1.02, ≤ 1.01× in the forward-only pass, and ≥ 0.97× the floor's largest micro-batch. A dry run's
report (``bench_step.py --dry-run``) is titled as one and carries no targets.
``python scripts/step_report.py --merge A/step_tp.json B/step_tp.json --out DIR``: the TP rows of several runs (e.g.
two device calls) in one report.
The predictions were written before the runs that measured the rows.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field
from pathlib import Path as FilePath

PLAN = [
    ("1.5b", 2048, "selective"), ("1.5b", 2048, "full"), ("0.5b", 2048, "selective"), ("0.5b", 2048, "full"),
    ("1.5b", 8192, "selective"), ("1.5b", 8192, "full"), ("0.5b", 8192, "selective"), ("0.5b", 8192, "full"),
]
"""The order the configurations run in: the headline (1.5B at 2048 tokens) first."""
PATH_ORDER = ["floor", "common", "logits_model_layer", "logits", "fused", "logits_fp32", "fused_fp32",
              "fp32_head_tf32", "fp32_head"]
PATH_NAMES = {
    "floor": "floor: decoder, no output layer, no loss + bare output matmuls timed apart",
    "common": "common: fp32 logits, megatron-core vocab_parallel_cross_entropy, torch PPO loss (verl's Megatron path)",
    "logits_model_layer": "mp_grpo logits path on GPTModel's own output layer (before the batch-major layer)",
    "logits": "mp_grpo logits path (GRPOLoss.on_logits, batch-major output layer)",
    "fused": "mp_grpo fused output layer + loss",
    "logits_fp32": "mp_grpo logits path, fp32 logit precision (MegatronGRPO(logit_dtype=LogitDtype.FP32))",
    "fused_fp32": "mp_grpo fused path, fp32 logit precision",
    "fp32_head_tf32": "the frameworks' fp32 head: output-layer input and weight cast to fp32, F.linear on TF32 "
                      "tensor cores (NeMo-RL's tf32), then the common path's log-probs and loss",
    "fp32_head": "the same fp32 head with TF32 off (TRL's cast_lm_head_to_fp32, torchtitan)",
}
REPORT_NAMES = {(False, "te"): "step", (True, "te"): "step_tp", (False, "local"): "step_local",
                (True, "local"): "step_tp_local"}
"""The JSON / markdown / plot base name by (the TP report, the layer spec)."""
SPEC_TITLES = {"te": "Transformer Engine's layer spec", "local": "megatron-core's local layer spec"}
LEGACY_SPEC = "local"
"""The spec of a report written before the spec was recorded: every such run used the local spec."""


def report_name(tp: int, spec: str) -> str:
    return REPORT_NAMES[(tp != 1, spec)]
KIND_TITLES = {
    "train": "Training pass: forward + loss + backward of one micro-batch (forward_backward_func, finalize_model_grads)",
    "forward": "Forward-only log-prob pass (old / reference policy), no_grad",
    "step": "Whole GRPO step: forward-only pass + training pass + megatron-core Adam step",
}
KIND_NOTES = {
    "train": "The floor's time is its decoder's plus the bare output-layer matmuls' (in brackets); its peak and max "
             "tokens are the decoder's alone. Peaks include the bf16 weights and Megatron DDP's fp32 gradient buffers "
             "(1.5B: 2.9 + 5.8 GiB; 0.5B: 0.9 + 1.9 GiB).",
    "forward": "A no-grad pass recomputes nothing (megatron-core's checkpointing only wraps the forward), so these rows "
               "were measured once per shape and length, with the selective-recompute model. The floor is the decoder's "
               "forward plus the output matmul; its max tokens are the decoder's alone.",
    "step": "Two micro-batches of 8192 tokens: the forward-only pass over both (old log-probs), then the training pass "
            "over both (on-policy: the old log-probs are the current ones), then megatron-core's Adam "
            "(`Float16OptimizerWithFloat16Params`: fp32 master weights, gradient clipping at 1.0). The floor's step runs "
            "the decoder in both passes; its output matmuls (one forward GEMM and three training GEMMs per "
            "micro-batch) are timed apart and added.",
}
TARGET_FUSED_TIME = 1.01
TARGET_FUSED_TOKENS = 0.95
TARGET_LOGITS_TIME = 1.02
TARGET_FORWARD_TOKENS_VS_COMMON = 2.0
TARGET_LOGITS_TOKENS = 0.95
TARGET_FP32_FUSED_TIME = 1.02
TARGET_FP32_FUSED_TOKENS = 1.0
TARGET_TE_FUSED_TIME = 1.01
"""Transformer Engine's spec: the fused path (bf16 and fp32 logits) against the floor, training and forward-only pass."""
TARGET_TE_FUSED_HIGH = 1.02
"""… with the upper end of the training pass's 95 % interval below this."""
TARGET_TE_FUSED_TOKENS = 0.97
"""… and its largest micro-batch at least this fraction of the floor's."""

# (shape, seq, kind, path, metric) -> predicted value, both recompute modes unless the key names one.
# Written before the first run from the independent harness's table and the change's arithmetic:
# the batch-major layer removes three [N, V] bf16 copies (3 × 2.32 GiB read + written ≈ 5 ms of ~450 ms at
# 8192 tokens) and one [N, V] buffer at the peak (2.32 GiB); the fused path holds the tied weight's [V, H]
# gradient (0.43 GiB) through backward, which the floor has not.
PREDICTIONS = {
    ("1.5b", 2048, "train", "fused", "time_vs_floor"): 1.005,
    ("1.5b", 2048, "train", "logits", "time_vs_floor"): 1.012,
    ("1.5b", 2048, "train", "logits_model_layer", "time_vs_floor"): 1.023,
    ("1.5b", 2048, "train", "common", "time_vs_floor"): 1.07,
    ("1.5b", 2048, "train", "fused", "tokens_vs_floor"): 0.98,
    ("1.5b", 2048, "forward", "common", "time_vs_floor"): 1.10,
    ("1.5b", 2048, "forward", "logits", "time_vs_floor"): 1.02,
    ("1.5b", 2048, "forward", "fused", "time_vs_floor"): 1.01,
    ("1.5b", 2048, "forward", "logits", "tokens_vs_common"): 2.7,
    ("1.5b", 2048, "forward", "logits_model_layer", "tokens_vs_common"): 1.5,
    ("1.5b", 2048, "step", "common", "time_vs_floor"): 1.06,
    ("1.5b", 2048, "step", "logits", "time_vs_floor"): 1.01,
    ("1.5b", 2048, "step", "fused", "time_vs_floor"): 1.005,
}

# Predictions for the last change, written before the run that measured it: (1) both output paths add the output
# weight's gradient into DDP's main_grad (mp_grpo/megatron/main_grad.py), so the tied weight's 0.43 GiB [V, H]
# gradient is no longer held through the decoder's backward — at B = 10 the floor peaks at 75.81 GiB and the
# first run's fused path would have needed ~76.2, over what fits; (2) the forward-only rows build MegatronGRPO
# once, outside the timed pass (the first run built it, its config loaded, in every pass); what remains over the
# floor is the log-prob kernel's one read of the bf16 logits (2.3 GiB at ~3 TB/s ≈ 0.8 ms).
CHANGE_PREDICTIONS = {
    ("1.5b", 2048, "train", "fused", "tokens_vs_floor"): 1.00,
    ("1.5b", 2048, "train", "logits", "tokens_vs_floor"): 1.00,
    ("1.5b", 2048, "forward", "logits", "time_vs_floor"): 1.006,
    ("1.5b", 2048, "forward", "fused", "time_vs_floor"): 1.01,
    ("0.5b", 2048, "forward", "logits", "time_vs_floor"): 1.008,
    ("0.5b", 2048, "forward", "fused", "time_vs_floor"): 1.01,
    ("1.5b", 2048, "step", "logits", "time_vs_floor"): 1.005,
    ("1.5b", 2048, "step", "fused", "time_vs_floor"): 1.007,
}


# Transformer Engine's layer spec, (shape, seq, kind, path, metric) -> predicted value, selective recompute. Written
# before the first run of this script on TE from an independent harness's measurement on one H200 (GPTModel with TE's
# spec, one micro-batch of 4 × 2048 tokens forward + backward outside Megatron's schedule, 20 interleaved rounds,
# median per-round ratio): fused 1.012, fused at fp32 logits 1.024, the logits path 1.055, megatron-core's CE path
# 1.151; the fused path's largest micro-batch 21 against the floor's 22 rows (0.955). Megatron's schedule and DDP add
# the same work to every path, so the ratios here are expected a little closer to 1; the forward-only pass reads the
# logits once (about 1 % of a ~60 ms pass).
PREDICTIONS_TE = {
    ("1.5b", 2048, "train", "fused", "time_vs_floor"): 1.011,
    ("1.5b", 2048, "train", "fused_fp32", "time_vs_floor"): 1.022,
    ("1.5b", 2048, "train", "logits", "time_vs_floor"): 1.05,
    ("1.5b", 2048, "train", "common", "time_vs_floor"): 1.14,
    ("1.5b", 2048, "train", "fused", "tokens_vs_floor"): 0.955,
    ("1.5b", 2048, "forward", "fused", "time_vs_floor"): 1.01,
    ("1.5b", 2048, "forward", "logits", "time_vs_floor"): 1.01,
    ("1.5b", 2048, "step", "fused", "time_vs_floor"): 1.01,
}

# (tp, shape, seq, kind, path, metric) -> predicted value, selective recompute, for the TP report. Written before
# the run that measures them, from the TP = 1 rows above, the independent harness's TP = 1 fp32-head anchor
# (1.085× / 1.497× the floor, 16384 tokens against 20480) and this arithmetic:
# - under TP every rank's decoder does a little more than 1/TP of the work (norms, residuals and the TP all-reduces
#   are not split), and every loss path's overhead scales with N × V_local, so the ratios to the floor shrink a
#   little at TP = 2 and more at TP = 4, where the 7B decoder is 4.7× the 1.5B's per token against an output layer
#   of 2.3× (H 3584 vs 1536); the output layer's input mapping (an [N, H] all-reduce of the hidden state's gradient)
#   runs on every path, the floor's too; the mp_grpo paths add the log-prob all-gather (~30 µs);
# - fp32 logit precision: the logits path writes and reads fp32 logits (2× the bytes: +4 B an element forward, and
#   the gradient's conversion for the bf16 GEMMs ~+6 B in backward: ~+17 GB at 8192 × 151936 ≈ +6 ms of 454 →
#   +1.3 %), and holds them at twice the size (5 GB at 8192 tokens, TP = 1: some of the floor's largest
#   micro-batch lost); the fused path writes and reads fp32 chunks only (+4 B an element: +1.7 ms, +0.4 %; the
#   chunk buffers are small: the floor's largest micro-batch kept);
# - the frameworks' fp32 head: TF32 GEMMs replace the bf16 GEMM and Float16Module's upcast of the logits (+~5 ms
#   at TP = 1 as the anchor measured), then the common path's costs; TF32 off: fp32 GEMMs at ~50 of H100's
#   67 TFLOP/s (3 × 2·N·H·V_local: 11.5 TFLOP at TP = 1, 1.5B: +~200 ms); both hold the common path's fp32
#   logits, their gradient and the fp32 weight copy: the common path's largest micro-batch.
PREDICTIONS_TP = {
    (1, "1.5b", 2048, "train", "logits_fp32", "time_vs_floor"): 1.018,
    (1, "1.5b", 2048, "train", "fused_fp32", "time_vs_floor"): 1.014,
    (1, "1.5b", 2048, "train", "fp32_head_tf32", "time_vs_floor"): 1.10,
    (1, "1.5b", 2048, "train", "fp32_head", "time_vs_floor"): 1.50,
    (1, "1.5b", 2048, "train", "logits_fp32", "tokens_vs_floor"): 0.90,
    (1, "1.5b", 2048, "train", "fused_fp32", "tokens_vs_floor"): 1.00,
    (1, "1.5b", 2048, "train", "fp32_head_tf32", "tokens_vs_floor"): 0.80,
    (1, "1.5b", 2048, "forward", "logits_fp32", "time_vs_floor"): 1.014,
    (1, "1.5b", 2048, "forward", "fused_fp32", "time_vs_floor"): 1.015,
    (1, "1.5b", 2048, "forward", "fp32_head_tf32", "time_vs_floor"): 1.19,
    (1, "1.5b", 2048, "forward", "fp32_head", "time_vs_floor"): 1.68,
    (2, "1.5b", 2048, "train", "common", "time_vs_floor"): 1.085,
    (2, "1.5b", 2048, "train", "logits", "time_vs_floor"): 1.006,
    (2, "1.5b", 2048, "train", "fused", "time_vs_floor"): 1.010,
    (2, "1.5b", 2048, "train", "logits_fp32", "time_vs_floor"): 1.017,
    (2, "1.5b", 2048, "train", "fused_fp32", "time_vs_floor"): 1.014,
    (2, "1.5b", 2048, "train", "fp32_head_tf32", "time_vs_floor"): 1.10,
    (2, "1.5b", 2048, "train", "fp32_head", "time_vs_floor"): 1.48,
    (2, "1.5b", 2048, "train", "logits", "tokens_vs_floor"): 1.00,
    (2, "1.5b", 2048, "train", "fused", "tokens_vs_floor"): 1.00,
    (2, "1.5b", 2048, "train", "logits_fp32", "tokens_vs_floor"): 0.95,
    (2, "1.5b", 2048, "train", "fused_fp32", "tokens_vs_floor"): 1.00,
    (2, "1.5b", 2048, "forward", "logits", "time_vs_floor"): 1.004,
    (2, "1.5b", 2048, "forward", "fused", "time_vs_floor"): 1.005,
    (2, "1.5b", 2048, "forward", "logits_fp32", "time_vs_floor"): 1.014,
    (2, "1.5b", 2048, "forward", "fused_fp32", "time_vs_floor"): 1.015,
    (2, "1.5b", 2048, "forward", "fused", "tokens_vs_floor"): 1.00,
    (2, "1.5b", 2048, "forward", "fused_fp32", "tokens_vs_floor"): 1.00,
    (4, "7b", 2048, "train", "common", "time_vs_floor"): 1.03,
    (4, "7b", 2048, "train", "logits", "time_vs_floor"): 1.003,
    (4, "7b", 2048, "train", "fused", "time_vs_floor"): 1.004,
    (4, "7b", 2048, "train", "logits_fp32", "time_vs_floor"): 1.007,
    (4, "7b", 2048, "train", "fused_fp32", "time_vs_floor"): 1.006,
    (4, "7b", 2048, "train", "fp32_head_tf32", "time_vs_floor"): 1.06,
    (4, "7b", 2048, "train", "fp32_head", "time_vs_floor"): 1.45,
    (4, "7b", 2048, "train", "logits", "tokens_vs_floor"): 1.00,
    (4, "7b", 2048, "train", "fused", "tokens_vs_floor"): 1.00,
    (4, "7b", 2048, "train", "logits_fp32", "tokens_vs_floor"): 1.00,
    (4, "7b", 2048, "train", "fused_fp32", "tokens_vs_floor"): 1.00,
    (4, "7b", 2048, "forward", "logits", "time_vs_floor"): 1.002,
    (4, "7b", 2048, "forward", "fused", "time_vs_floor"): 1.003,
    (4, "7b", 2048, "forward", "fused_fp32", "time_vs_floor"): 1.006,
    (4, "7b", 2048, "forward", "fused", "tokens_vs_floor"): 1.00,
}


# Transformer Engine's spec under TP, written before the first such run: at TP = 2 every rank's decoder and its
# output-layer shard both halve, so the loss paths' share of the pass stays about what TP = 1 shows on TE
# (PREDICTIONS_TE); the log-prob op's all-gather adds ~0.03 ms to a ~100 ms pass.
PREDICTIONS_TP_TE = {
    (2, "1.5b", 2048, "train", "fused", "time_vs_floor"): 1.012,
    (2, "1.5b", 2048, "train", "fused_fp32", "time_vs_floor"): 1.022,
    (2, "1.5b", 2048, "train", "logits", "time_vs_floor"): 1.05,
    (2, "1.5b", 2048, "forward", "fused", "time_vs_floor"): 1.01,
    (2, "1.5b", 2048, "train", "fused", "tokens_vs_floor"): 0.97,
}


def row_key(shape: str, seq: int, recompute: str, kind: str, path, tp: int = 1) -> str:
    return f"{shape}|{seq}|{recompute}|{kind}|{getattr(path, 'value', path)}|{int(tp)}"


@dataclass
class Results:
    """The rows of ``step.json`` by key, and the runs that measured them."""

    path: FilePath
    meta: dict = field(default_factory=dict)
    rows: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: FilePath) -> Results:
        if not path.exists():
            return cls(path)
        data = json.loads(path.read_text())
        rows = {row_key(r["shape"], r["seq"], r["recompute"], r["kind"], r["path"], r.get("tp", 1)): r
                for r in data["rows"]}
        return cls(path, data.get("meta", {}), rows)

    @property
    def tp_report(self) -> bool:
        """The tensor-parallel report (``step_tp``): rows of several TP sizes, a TP column."""
        return self.path.stem.startswith("step_tp")

    @property
    def spec(self) -> str:
        """The layer spec of every row here (``te`` / ``local``)."""
        return self.meta.get("spec", LEGACY_SPEC)

    @property
    def dry_run(self) -> bool:
        return bool(self.meta.get("dry_run"))

    def start(self, command: str, *, device: str | None = None, dry_run: bool = False, spec: str = "te") -> None:
        """Records a run (its command, versions, device) that adds rows measured with the ``spec`` layer; a report
        that holds another spec's rows refuses it."""
        import torch

        if self.rows and self.spec != spec:
            raise SystemExit(f"{self.path} holds rows of the {self.spec} layer spec: a --spec {spec} run writes its own "
                             f"report (--report {REPORT_NAMES[(self.tp_report, spec)]}, the default for that spec)")
        self.meta["spec"] = spec

        versions = {"torch": torch.__version__, "python": platform.python_version()}
        try:
            import megatron.core
            import triton

            versions.update(megatron_core=megatron.core.__version__, triton=triton.__version__)
        except ImportError:
            pass
        if spec == "te" and not dry_run:
            try:
                import transformer_engine

                versions["transformer_engine"] = transformer_engine.__version__
            except ImportError:
                pass
        if device is not None:
            versions["device"] = device
        elif torch.cuda.is_available():
            versions["device"] = torch.cuda.get_device_name()
        import os

        run = {"command": command, **versions, "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
        if dry_run:
            run["dry_run"] = True
            self.meta["dry_run"] = True
        self.meta.setdefault("runs", []).append(run)
        self.meta.update(versions)

    def row(self, key: str) -> dict:
        return self.rows.get(key, {})

    def update(self, key: str, values: dict) -> None:
        shape, seq, recompute, kind, path, tp = key.split("|")
        fields = {"shape": shape, "seq": int(seq), "recompute": recompute, "kind": kind, "path": path}
        if int(tp) != 1 or self.tp_report:
            fields["tp"] = int(tp)
        row = self.rows.setdefault(key, fields)
        row.update(values)

    def complete(self, key: str, *, search: bool) -> bool:
        row = self.row(key)
        return "ms" in row and (not search or "max_B" in row)

    def save(self) -> None:
        ordered = sorted(self.rows.values(), key=_order)
        self.path.write_text(json.dumps({"meta": self.meta, "rows": ordered}, indent=1))

    def groups(self, tp: int | None = 1):
        """``{(shape, seq, recompute, kind): {path: row}}`` of the rows at TP = ``tp`` in plan order; ``tp=None``:
        every TP size, keyed ``(shape, seq, recompute, kind, tp)``."""
        out: dict = {}
        for r in sorted(self.rows.values(), key=_order):
            where = (r["shape"], r["seq"], r["recompute"], r["kind"])
            if tp is None:
                out.setdefault((*where, r.get("tp", 1)), {})[r["path"]] = r
            elif r.get("tp", 1) == tp:
                out.setdefault(where, {})[r["path"]] = r
        return out

    def tp_sizes(self) -> list[int]:
        return sorted({r.get("tp", 1) for r in self.rows.values()})

    def summary(self) -> str:
        lines = []
        for (shape, seq, rec, kind, tp), rows in self.groups(tp=None).items():
            x_all = ratios(rows)
            for name in PATH_ORDER:
                r = rows.get(name)
                if r and "ms" in r:
                    x = x_all.get(name, {}).get("time_vs_floor")
                    ratio = "  —  " if x is None else f"{x:.3f}x"
                    tokens = r.get("max_tokens", "—")
                    lines.append(f"TP {tp} {shape:>5} {seq:>5} {rec:<9} {kind:<7} {name:<18} {r['ms']:9.1f} ms "
                                 f"{ratio:>7} {r['peak_GiB']:6.2f} GiB  max tokens {tokens}")
        return "\n".join(lines)


def _order(r: dict):
    plan = [(s, q, c) for s, q, c in PLAN]
    where = (r["shape"], r["seq"], r["recompute"])
    return (r.get("tp", 1), plan.index(where) if where in plan else len(plan), r["shape"], r["seq"], r["recompute"],
            list(("train", "forward", "step")).index(r["kind"]), PATH_ORDER.index(r["path"]))


# ------------------------------------------------------------------------------------------------ metrics
def ratios(rows: dict) -> dict:
    """Per path: time / floor — the median per-round ratio and its 95 % interval (``time_vs_floor_low`` / ``_high``)
    where the row has its rounds' ``vs_floor``, else the ratio of the medians —, max tokens / floor, max tokens /
    common (where measured)."""
    floor, common = rows.get("floor", {}), rows.get("common", {})
    out = {}
    for name, r in rows.items():
        x = {}
        if "vs_floor" in r:
            x.update(time_vs_floor=r["vs_floor"]["median"], time_vs_floor_low=r["vs_floor"]["low"],
                     time_vs_floor_high=r["vs_floor"]["high"])
        elif name == "floor" and "ms" in r:
            x["time_vs_floor"] = 1.0
        elif "ms" in r and "ms" in floor:
            x["time_vs_floor"] = r["ms"] / floor["ms"]
        if r.get("max_tokens") and floor.get("max_tokens"):
            x["tokens_vs_floor"] = r["max_tokens"] / floor["max_tokens"]
        if r.get("max_tokens") and common.get("max_tokens"):
            x["tokens_vs_common"] = r["max_tokens"] / common["max_tokens"]
        out[name] = x
    return out


def targets(results: Results) -> list[str]:
    """One line per target and configuration: met or not, by how much (none for a dry run)."""
    if results.dry_run:
        return ["- a dry run: stubbed measurements, no target is checked"]
    lines = []
    for tp in results.tp_sizes():
        for (shape, seq, rec, kind), rows in results.groups(tp).items():
            r = ratios(rows)
            where = f"{shape} @ {seq}, {rec}" + (f", TP = {tp}" if results.tp_report else "")
            checks = [("fused", "time_vs_floor", TARGET_FUSED_TIME, True), ("logits", "time_vs_floor", TARGET_LOGITS_TIME, True)]
            if kind in ("train", "forward"):
                checks.insert(1, ("fused", "tokens_vs_floor", TARGET_FUSED_TOKENS, False))
            if kind == "forward":
                checks.append(("logits", "tokens_vs_common", TARGET_FORWARD_TOKENS_VS_COMMON, False))
            if results.tp_report:  # the TP issue's targets and the fp32 precision's; only the paths that ran
                if kind in ("train", "forward"):
                    checks.insert(3, ("logits", "tokens_vs_floor", TARGET_LOGITS_TOKENS, False))
                    checks += [("fused_fp32", "time_vs_floor", TARGET_FP32_FUSED_TIME, True)]
                if kind == "train":
                    checks += [("fused_fp32", "tokens_vs_floor", TARGET_FP32_FUSED_TOKENS, False)]
            if results.spec == "te":  # Transformer Engine's spec: the fused path at bf16 and fp32 logits
                checks = [c for c in checks if c[0] not in ("fused", "fused_fp32")] + te_fused_checks(kind)
            if results.tp_report or results.spec == "te":  # only the paths that ran
                checks = [c for c in checks if c[0] in rows and (c[1] != "tokens_vs_common" or "common" in r
                                                                 and "max_tokens" in rows["common"])]
            for path, metric, limit, at_most in checks:
                value = r.get(path, {}).get(metric)
                if value is None:
                    lines.append(f"- {where}, {kind}, {path} {metric}: not measured")
                    continue
                met = value <= limit if at_most else value >= limit
                why = ""
                if not met and metric == "tokens_vs_common" and r.get("common", {}).get("tokens_vs_floor", 0) >= 1:
                    why = (" — the common path already fits the floor's own largest micro-batch: the decoder (the local "
                           "spec's S × S attention scores), not the loss, bounds every path")
                lines.append(f"- {where}, {kind}, {path} {metric.replace('_', ' ')} = {value:.4f} "
                             f"(target {'≤' if at_most else '≥'} {limit}): {'met' if met else 'NOT MET'}{why}")
    return lines


def te_fused_checks(kind: str) -> list[tuple[str, str, float, bool]]:
    """The targets of the fused path at bf16 and fp32 logits on Transformer Engine's spec, for one kind of row."""
    checks = []
    for path in ("fused", "fused_fp32"):
        checks.append((path, "time_vs_floor", TARGET_TE_FUSED_TIME, True))
        if kind == "train":
            checks.append((path, "time_vs_floor_high", TARGET_TE_FUSED_HIGH, True))
        if kind in ("train", "forward"):
            checks.append((path, "tokens_vs_floor", TARGET_TE_FUSED_TOKENS, False))
    return checks


def time_misses(results: Results) -> list[str]:
    """For every training pass whose fused or logits path misses its time target: each missing path's excess over
    the floor in ms against the output layer's whole GPU work in that pass (the floor's bare output matmuls on this
    rank's shard, which the loss paths replace), and the forward-only pass of the same configuration beside it —
    the figures that say whether the output layer and the loss can account for the miss. Empty for a dry run."""
    if results.dry_run:
        return []
    limits = {"fused": TARGET_FUSED_TIME, "logits": TARGET_LOGITS_TIME}
    groups = results.groups(tp=None)
    lines = []
    for (shape, seq, rec, kind, tp), rows in groups.items():
        floor = rows.get("floor", {})
        if kind != "train" or "ms" not in floor or "matmul_ms" not in floor:
            continue
        x = ratios(rows)
        missed = [p for p, limit in limits.items() if x.get(p, {}).get("time_vs_floor", 0.0) > limit]
        if not missed:
            continue
        excess = ", ".join(f"{p} +{rows[p]['ms'] - floor['ms']:.1f} ms" for p in missed)
        multiples = " and ".join(f"{(rows[p]['ms'] - floor['ms']) / floor['matmul_ms']:.1f}×" for p in missed)
        forward = ratios(groups.get((shape, seq, rec, "forward", tp), {}))
        beside = ", ".join(f"{p} {forward[p]['time_vs_floor']:.3f}×" for p in missed if "time_vs_floor" in forward.get(p, {}))
        where = f"TP = {tp}, {shape} @ {seq}, {rec}"
        lines.append(
            f"- {where}: over the floor's {floor['ms']:.1f} ms, {excess} — {multiples} the output layer's whole GPU "
            f"work in the pass (its three bare GEMMs on this rank's shard: {floor['matmul_ms']:.1f} ms)"
            + (f"; the forward-only pass of the same configuration: {beside} the floor" if beside else "") + ".")
    return lines


# ------------------------------------------------------------------------------------------------ reports
def write_reports(results: Results, out: FilePath, *, plot: bool, tp1_json: FilePath | None = None) -> None:
    results.save()
    name = results.path.stem
    (out / f"{name}.md").write_text(markdown_tp(results) if results.tp_report else markdown(results))
    if plot and results.rows:
        plot_results(results, out / f"{name}.png")
        if results.tp_report:
            tp1 = Results.load(tp1_json) if tp1_json is not None else None
            plot_tp_scaling(results, out / f"{name}_scaling.png", tp1=tp1)


def _fmt_tokens(r: dict) -> str:
    if "max_tokens" not in r:
        return "—"
    capped = r.get("first_failure_B") is None
    return f"{'≥ ' if capped else ''}{r['max_tokens']}"


def _timing_text(results: Results) -> str:
    """How the times of the report's rows were taken: interleaved rounds, or (older rows) medians of a few steps."""
    rounds = sorted({r["rounds"] for r in results.rows.values() if "rounds" in r})
    old = any("ms" in r and "rounds" not in r for r in results.rows.values())
    text = []
    if rounds:
        text.append(
            "Times: every path of one kind timed in interleaved rounds in one process (" + " / ".join(map(str, rounds))
            + " rounds: floor, its bare output matmuls, then each path, and back in reverse order the next round; "
            "each call timed with CUDA events"
            + ("; under TP a barrier before each call and each round's slowest rank" if results.tp_report else "")
            + "). `ms` is the median over the rounds; `× floor` is the median of the per-round ratios path / (decoder + "
            "matmuls) with its distribution-free 95 % interval in brackets (order statistics of the median; every "
            "round's times are in the JSON)")
    if old:
        text.append("Rows without an interval were timed before the rounds: the median of a few steps of that path "
                    "alone (CUDA events), `× floor` the ratio of two such medians")
    return ". ".join(text) + "."


def _spec_text(results: Results) -> str:
    if results.spec == "te":
        return ("megatron-core GPTModel with **Transformer Engine's layer spec** "
                "(`get_gpt_layer_with_transformer_engine_spec`: TE's fused attention, RMSNorm fused into the next "
                "linear layer)")
    return "megatron-core GPTModel with the **local layer spec** (no Transformer Engine)"


def _time_cell(x: dict) -> str:
    if "time_vs_floor" not in x:
        return "—"
    if "time_vs_floor_low" in x:
        return f"{x['time_vs_floor']:.3f} [{x['time_vs_floor_low']:.3f}, {x['time_vs_floor_high']:.3f}]"
    return f"{x['time_vs_floor']:.3f}"


def _extra_sections(results: Results) -> list[str]:
    """What the fused paths hold at their peak that the floor does not (``--memory-snapshot``), and how long each part
    of the runs took."""
    lines = []
    snapshots = results.meta.get("memory_snapshot", {})
    if snapshots:
        lines += ["## Memory at the peak: the fused paths against the floor", "",
                  "`bench_step.py --memory-snapshot DIR`: one training pass of each path with `torch.cuda.memory`'s "
                  "history on; the allocation trace replayed to each pass's peak and the blocks live there summed by "
                  "the Python line that allocated them (`scripts/memory_snapshot.py`).", ""]
        for where, text in snapshots.items():
            lines += [f"### {where}", "", *text, ""]
    phases = results.meta.get("phase_s", {})
    if phases:
        lines += ["## Where a run's time went (seconds)", "",
                  "; ".join(f"{where}: " + ", ".join(f"{k} {v:.0f}" for k, v in parts.items())
                            for where, parts in phases.items()), ""]
    return lines


def markdown(results: Results) -> str:
    meta = results.meta
    commands = "; ".join(f"`{run['command']}`" for run in meta.get("runs", []))
    local = results.spec == "local"
    lines = [
        f"# A GRPO step of a Qwen2.5-shaped model on one GPU, {SPEC_TITLES[results.spec]} — {meta.get('device', '?')}",
        "",
    ]
    if results.dry_run:
        lines += ["**DRY RUN — not a measurement.** `bench_step.py --dry-run` ran the driver on the CPU with the CPU "
                  "stand-in model (no attention, whatever the spec), gloo and Triton's interpreter; times are "
                  "host-clock times of the stand-in, memory figures, snapshots and the search's limit a fixed model. "
                  "It checks the script's plumbing only.", ""]
    lines += [
        _spec_text(results) + ", bf16 (`Float16Module`), Megatron "
        "DDP with fp32 gradient buffers, TP = 1, in the Qwen2.5-1.5B (H 1536, 28 layers, 12 heads, 2 query groups, "
        "FFN 8960) and -0.5B (H 896, 24 layers, 14 heads, 2 query groups, FFN 4864) shapes: SwiGLU, RMSNorm, RoPE, QKV "
        "bias, V = 151936, tied embeddings. Padded rows of S tokens (the first S/8 a prompt, the rest trained on), "
        "random tokens. Every pass runs through megatron-core's `forward_backward_func`, on one micro-batch of 8192 "
        "tokens (4 × 2048 or 1 × 8192). " + _timing_text(results) + " Peak: allocated memory during one "
        "pass, weights and gradient buffers included; max tokens: the largest micro-batch (B × S) that runs, found by "
        "probing to one row (out-of-memory caught; between probes and rows the caching allocator is emptied"
        + (" and so is megatron-core's global memory buffer, which holds the local attention's S × S scores at the "
           "largest size ever asked for" if local else "") + "; `PYTORCH_CUDA_ALLOC_CONF="
        f"{meta.get('runs', [{}])[-1].get('PYTORCH_CUDA_ALLOC_CONF')}`). The loss is the same objective on every "
        "path (PPO clip 0.2, dual clip 3, token mean, on-policy in the timed rows; no entropy, no KL). "
        f"torch {meta.get('torch')}, triton {meta.get('triton')}, megatron-core {meta.get('megatron_core')}"
        + (f", transformer-engine {meta['transformer_engine']}" if meta.get("transformer_engine") else "") + ".",
        "",
    ]
    if local:
        lines += [
            "**Caveat.** The local layer spec's attention is unfused (it materializes the S × S scores, softmax in fp32) "
            "and slower than Transformer Engine's fused attention: the decoder here costs more time and more memory "
            "per token than under TE, so every loss path is a *smaller* share of the step than it would be there; the "
            "ratios to the floor understate the gaps a TE user sees (`step.md`: the same rows on TE's spec). The "
            "`common` path calls the model as verl does, with `Float16Module`'s default fp32 output.", ""]
    lines += [
        "Paths: " + "; ".join(f"`{k}` = {v}" for k, v in PATH_NAMES.items() if k in _paths_present(results)) + ".",
        "",
        f"Commands: {commands}",
        "",
    ]
    for kind in ("train", "forward", "step"):
        groups = {k: v for k, v in results.groups().items() if k[3] == kind}
        if not groups:
            continue
        lines += [f"## {KIND_TITLES[kind]}", ""]
        if kind in KIND_NOTES:
            lines += [KIND_NOTES[kind], ""]
        if kind == "step":
            lines += ["| model | S | recompute | path | step ms | × floor | peak GiB |", "|---|---|---|---|---|---|---|"]
        else:
            lines += ["| model | S | recompute | path | ms | × floor | peak GiB | max B | max tokens | × floor | × common |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
        for (shape, seq, rec, _), rows in groups.items():
            r_all = ratios(rows)
            for name in PATH_ORDER:
                r = rows.get(name)
                if not r or "ms" not in r:
                    continue
                x = r_all.get(name, {})
                time_ratio = _time_cell(x)
                ms = f"{r['ms']:.1f}" + (f" ({r['decoder_ms']:.1f} + {r['matmul_ms']:.1f})" if "matmul_ms" in r else "")
                if kind == "step":
                    lines.append(f"| {shape} | {seq} | {rec} | {name} | {ms} | {time_ratio} | {r['peak_GiB']:.2f} |")
                    continue
                tok_f = f"{x['tokens_vs_floor']:.2f}" if "tokens_vs_floor" in x else "—"
                tok_c = f"{x['tokens_vs_common']:.2f}" if "tokens_vs_common" in x else "—"
                lines.append(f"| {shape} | {seq} | {rec} | {name} | {ms} | {time_ratio} | {r['peak_GiB']:.2f} | "
                             f"{r.get('max_B', '—')} | {_fmt_tokens(r)} | {tok_f} | {tok_c} |")
        lines.append("")
    lines += ["## Targets", "", *targets(results), ""]
    lines += _extra_sections(results)
    if local:
        lines += _predictions("Predictions (written before the first run) and measurements", PREDICTIONS, results)
        lines += _predictions("Predictions for the last change (the output weight's gradient into `main_grad`; the "
                              "forward-only rows' MegatronGRPO built once), written before the run that measured it",
                              CHANGE_PREDICTIONS, results)
    else:
        lines += _predictions("Predictions (written before the first run on Transformer Engine's spec, from an "
                              "independent harness's interleaved rounds) and measurements", PREDICTIONS_TE, results)
    return "\n".join(lines)


def _predictions(title: str, predictions: dict, results: Results) -> list[str]:
    lines = [f"## {title}", "", "| model | S | row | path | metric | predicted | measured (selective / full) |",
             "|---|---|---|---|---|---|---|"]
    groups = results.groups()
    for (shape, seq, kind, path, metric), predicted in predictions.items():
        measured = []
        for rec in ("selective", "full"):
            value = ratios(groups.get((shape, seq, rec, kind), {})).get(path, {}).get(metric)
            measured.append("—" if value is None else f"{value:.3f}")
        lines.append(f"| {shape} | {seq} | {kind} | {path} | {metric.replace('_', ' ')} | {predicted} | {' / '.join(measured)} |")
    return lines + [""]


COLORS = {"floor": "tab:gray", "common": "tab:red", "logits_model_layer": "tab:purple", "logits": "tab:blue",
          "fused": "tab:green", "logits_fp32": "tab:cyan", "fused_fp32": "tab:olive", "fp32_head_tf32": "tab:orange",
          "fp32_head": "tab:brown"}


def _paths_present(results: Results) -> list[str]:
    present = {r["path"] for r in results.rows.values()}
    return [p for p in PATH_ORDER if p in present]


def plot_results(results: Results, path: FilePath) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("train", "time_vs_floor", "training pass: time / floor"),
              ("train", "max_tokens", "training pass: max tokens per micro-batch"),
              ("forward", "max_tokens", "forward-only pass: max tokens per micro-batch")]
    tp_report = results.tp_report
    groups = results.groups(tp=None if tp_report else 1)
    n = max(len([k for k in groups if k[3] == kind]) for kind in ("train", "forward"))
    present = _paths_present(results)
    width = 0.8 / max(len(present), 5)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 1.6 * n + 3), 11))
    for ax, (kind, metric, title) in zip(axes, panels):
        labels = []
        configs = [k for k in groups if k[3] == kind]
        for i, key in enumerate(configs):
            shape, seq, rec = key[:3]
            rows = groups[key]
            labels.append((f"TP = {key[4]}, " if tp_report else "") + f"{shape} S={seq}"
                          + (f"\n{rec} recompute" if kind == "train" else ""))
            x_ratios = ratios(rows)
            for j, name in enumerate(present):
                r = rows.get(name, {})
                value = x_ratios.get(name, {}).get(metric) if metric == "time_vs_floor" else r.get(metric)
                if value is None:
                    continue
                ax.bar(i + (j - (len(present) - 1) / 2) * width, value, width, color=COLORS[name],
                       label=name if name not in ax.get_legend_handles_labels()[1] else None)
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        if metric == "time_vs_floor":
            ax.axhline(TARGET_FUSED_TIME, color="tab:green", linestyle="--", linewidth=0.8)
            ax.axhline(TARGET_LOGITS_TIME, color="tab:blue", linestyle="--", linewidth=0.8)
            ax.set_ylim(0.95, None)
        ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    what = ("tensor parallel, " if tp_report else "") + SPEC_TITLES[results.spec]
    fig.suptitle(_dry_prefix(results) + f"GRPO step, Qwen2.5 shapes, {what}, bf16 — {results.meta.get('device', '')}",
                 fontsize=10)
    fig.tight_layout(h_pad=2.5)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _dry_prefix(results: Results) -> str:
    return "DRY RUN (CPU, stubbed measurements) — " if results.dry_run else ""


def plot_tp_scaling(results: Results, path: FilePath, *, tp1: Results | None = None) -> None:
    """Per TP size (its model shape named): each path's time and largest micro-batch against the floor's, training
    and forward-only passes (selective recompute, S = 2048 where measured). TP = 1 rows from ``tp1`` where the
    TP report has none."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs: dict[int, dict] = {}
    for source in ([tp1] if tp1 is not None else []) + [results]:
        for (shape, seq, rec, kind, tp), rows in source.groups(tp=None).items():
            if rec == "selective" and (tp not in configs or configs[tp].get("source") is not results or source is results):
                entry = configs.setdefault(tp, {"source": source, "shape": shape, "seq": seq, "rows": {}})
                if entry["source"] is not source:
                    entry.update(source=source, shape=shape, seq=seq, rows={})
                if (shape, seq) == (entry["shape"], entry["seq"]):
                    entry["rows"][kind] = rows
    if not configs:
        return
    sizes = sorted(configs)
    panels = [("train", "time_vs_floor", "training pass: time / floor"),
              ("forward", "time_vs_floor", "forward-only log-prob pass: time / floor"),
              ("train", "tokens_vs_floor", "training pass: largest micro-batch / floor's"),
              ("forward", "tokens_vs_floor", "forward-only pass: largest micro-batch / floor's")]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    for ax, (kind, metric, title) in zip(axes.flat, panels):
        for name in PATH_ORDER:
            if name == "floor":
                continue
            xs, ys = [], []
            for i, tp in enumerate(sizes):
                value = ratios(configs[tp]["rows"].get(kind, {})).get(name, {}).get(metric)
                if value is not None:
                    xs.append(i)
                    ys.append(value)
            if ys:
                ax.plot(xs, ys, marker="o", color=COLORS[name], label=name)
        ax.axhline(1.0, color="tab:gray", linewidth=0.8)
        if metric == "time_vs_floor":
            ax.axhline(TARGET_FUSED_TIME, color="tab:green", linestyle="--", linewidth=0.8)
            ax.axhline(TARGET_LOGITS_TIME, color="tab:blue", linestyle="--", linewidth=0.8)
            ax.set_yscale("log")
        else:
            ax.axhline(TARGET_FUSED_TOKENS, color="tab:green", linestyle="--", linewidth=0.8)
        ax.set_xticks(range(len(sizes)))
        ax.set_xticklabels([f"TP = {tp}\n{configs[tp]['shape']} S={configs[tp]['seq']}" for tp in sizes], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(_dry_prefix(results) + "GRPO step under tensor parallelism: each path against the no-loss floor "
                 f"(selective recompute) — {results.meta.get('device', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_tp(results: Results) -> str:
    """The TP report (``step_tp.md``): every TP size's rows, targets, predictions."""
    meta = results.meta
    commands = "; ".join(f"`{run['command']}`" for run in meta.get("runs", []))
    title = f"# A GRPO step under tensor parallelism, {SPEC_TITLES[results.spec]}"
    lines = [f"{title} — {meta.get('device', '?')}", ""]
    if results.dry_run:
        lines += ["**DRY RUN — not a measurement.** `bench_step.py --dry-run` ran the driver on the CPU with the CPU "
                  "stand-in model (no attention, whatever the spec), gloo and Triton's interpreter; times are "
                  "host-clock times of the stand-in, memory figures, snapshots and the search's limit a fixed model. "
                  "It checks the script's plumbing only.", ""]
    shapes = sorted({r["shape"] for r in results.rows.values()})
    lines += [
        _spec_text(results) + ", bf16 (`Float16Module`), Megatron "
        "DDP with fp32 gradient buffers, split over TP ranks (TP = world size, no sequence parallelism: the local "
        "spec's norms refuse it, and both specs run alike; every rank fed the same micro-batches), shapes "
        + ", ".join(shapes) + " "
        "(1.5b: H 1536, 28 layers, 12 heads, 2 query groups, FFN 8960, V = 151936, tied embeddings; 7b: H 3584, 28 "
        "layers, 28 heads, 4 query groups, FFN 18944, V = 152064, untied). Padded rows of S tokens (the first S/8 a "
        "prompt), random tokens, through megatron-core's `forward_backward_func`, one micro-batch of 8192 tokens. "
        + _timing_text(results) + " The floor's output matmuls are this "
        "rank's vocabulary shard's (V / TP columns); peak: the largest over ranks of the allocated memory during one "
        "step; max tokens: the largest micro-batch that runs on every rank (probes agreed over the ranks; the mp_grpo "
        "and other paths start from the floor's largest B, so `≥` is not used there: the next probe is the floor's "
        "first failure). Same objective on every path (PPO clip 0.2, dual clip 3, token mean, on-policy). "
        f"torch {meta.get('torch')}, triton {meta.get('triton')}, megatron-core {meta.get('megatron_core')}, "
        f"`PYTORCH_CUDA_ALLOC_CONF={meta.get('runs', [{}])[-1].get('PYTORCH_CUDA_ALLOC_CONF')}`.",
        "",
        "Paths: " + "; ".join(f"`{k}` = {v}" for k, v in PATH_NAMES.items() if k in _paths_present(results)) + ".",
        "",
    ]
    if meta.get("skipped_paths"):
        lines += ["Skipped: " + "; ".join(f"`{k}`: {v}" for k, v in meta["skipped_paths"].items()) + ".", ""]
    lines += [f"Commands: {commands}", ""]
    for kind in ("train", "forward", "step"):
        groups = {k: v for k, v in results.groups(tp=None).items() if k[3] == kind}
        if not groups:
            continue
        lines += [f"## {KIND_TITLES[kind]}", "",
                  "| TP | model | S | recompute | path | ms (per rank) | × floor | peak GiB | max B | max tokens | × floor | "
                  "× common |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for (shape, seq, rec, _, tp), rows in groups.items():
            r_all = ratios(rows)
            for name in PATH_ORDER:
                r = rows.get(name)
                if not r or "ms" not in r:
                    continue
                x = r_all.get(name, {})
                time_ratio = _time_cell(x)
                ms = f"{r['ms']:.1f}" + (f" ({r['decoder_ms']:.1f} + {r['matmul_ms']:.1f})" if "matmul_ms" in r else "")
                if len(r.get("ms_per_rank", [])) > 1:
                    ms += " [" + " / ".join(f"{v:.1f}" for v in r["ms_per_rank"]) + "]"
                tok_f = f"{x['tokens_vs_floor']:.2f}" if "tokens_vs_floor" in x else "—"
                tok_c = f"{x['tokens_vs_common']:.2f}" if "tokens_vs_common" in x else "—"
                lines.append(f"| {tp} | {shape} | {seq} | {rec} | {name} | {ms} | {time_ratio} | {r['peak_GiB']:.2f} | "
                             f"{r.get('max_B', '—')} | {_fmt_tokens(r)} | {tok_f} | {tok_c} |")
        lines.append("")
    lines += ["## Targets", "", *targets(results), ""]
    misses = time_misses(results)
    if misses:
        lines += ["## The time misses against the output layer's own work", "",
                  "Each training pass that misses a time target: the excess over the floor, in multiples of the "
                  "output layer's GPU work (all that the loss paths change), and the forward-only pass beside it. An excess larger than that work would mean the loss paths' own kernels "
                  "(GEMMs included) take over twice the bare GEMMs' time; "
                  "`bench_step.py --profile train:floor train:logits train:fused` (under the same torchrun) writes "
                  f"each pass's kernel time against its wall time (`{results.path.stem}_profile.txt`).", "",
                  *misses, ""]
    lines += _extra_sections(results)
    lines += ["## Predictions (written before the run) and measurements (selective recompute)", "",
              "| TP | model | S | row | path | metric | predicted | measured |", "|---|---|---|---|---|---|---|---|"]
    groups = results.groups(tp=None)
    for (tp, shape, seq, kind, path, metric), predicted in (PREDICTIONS_TP if results.spec == "local"
                                                            else PREDICTIONS_TP_TE).items():
        value = ratios(groups.get((shape, seq, "selective", kind, tp), {})).get(path, {}).get(metric)
        lines.append(f"| {tp} | {shape} | {seq} | {kind} | {path} | {metric.replace('_', ' ')} | {predicted} | "
                     f"{'—' if value is None else f'{value:.3f}'} |")
    return "\n".join(lines + [""])


def merge(sources: list[FilePath], out: FilePath) -> Results:
    """The rows of several ``step_tp.json`` files (runs of different calls, one layer spec) in one ``out/step_tp.json``
    (``step_tp_local.json`` for the local spec), its markdown and plots; a row measured in two files is taken from
    the later file. Dry-run files and files of different specs are refused."""
    parts = [Results.load(source) for source in sources]
    specs = {part.spec for part in parts}
    if len(specs) != 1:
        raise SystemExit(f"--merge: the files hold rows of several layer specs ({', '.join(sorted(specs))}): one report "
                         "holds one spec")
    merged = Results(out / f"{REPORT_NAMES[(True, specs.pop())]}.json")
    for source, part in zip(sources, parts):
        if not part.rows:
            raise SystemExit(f"--merge: {source} holds no rows")
        if part.dry_run:
            raise SystemExit(f"--merge: {source} is a dry run's (stubbed figures): never merged into a report")
        for run in part.meta.get("runs", []):
            merged.meta.setdefault("runs", []).append(run)
        merged.meta.update({k: v for k, v in part.meta.items() if k != "runs"})
        merged.rows.update(part.rows)
    out.mkdir(parents=True, exist_ok=True)
    write_reports(merged, out, plot=True)
    return merged


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Regenerate the step reports, or merge TP reports of several runs.")
    parser.add_argument("--merge", nargs="+", type=FilePath, metavar="STEP_TP_JSON", required=True)
    parser.add_argument("--out", type=FilePath, required=True)
    args = parser.parse_args()
    print(merge(args.merge, args.out).summary())
