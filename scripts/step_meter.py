"""The measurements of ``bench_step.py``: on CUDA (:class:`GpuMeter`, through ``measure``) or stubbed on the CPU for
``--dry-run`` (:class:`DryMeter`). The driver agrees every figure over the ranks.

- ``rounds``: the passes of one row group timed in interleaved rounds (``measure.interleaved_ms``: floor, A, B, …
  and back, each call timed with CUDA events; under TP the ranks aligned by a barrier before each call);
- ``peak`` / ``fits``: one call's peak allocated memory, or whether it fits (out-of-memory caught);
- ``output_matmuls``: the floor's bare output-layer GEMMs as one call, timed among the rounds;
- ``snapshot``: a ``torch.cuda.memory`` snapshot around one call (``memory_snapshot.record``);
- ``cleanup`` / ``resting_bytes`` / ``usable_bytes`` / ``device_name``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import measure
import memory_snapshot
from measure import GiB
from step_paths import Path, output_matmuls

DRY_SEQ = 12
"""``--dry-run``: tokens per row of the stand-in model (timing micro-batches of 4 rows)."""


def host_ms(fn: Callable[[], object]) -> float:
    """One call timed with the host clock (the dry run's stand-in for CUDA events)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


class GpuMeter:
    """The measurements on CUDA (``measure``), each agreed over the ranks by the caller."""

    dry = False
    device = "cuda"
    matmul_dtype = torch.bfloat16
    timer = staticmethod(measure.cuda_event_ms)

    def rounds(self, fns: dict[str, Callable[[], object]], rounds: int, warmup: int) -> dict[str, list[float]]:
        """This rank's time of every function in each of ``rounds`` interleaved rounds (``measure.interleaved_ms``);
        under TP a barrier before every call, so that every rank starts it together."""
        barrier = dist.barrier if dist.is_initialized() and dist.get_world_size() > 1 else None
        return measure.interleaved_ms(fns, rounds, warmup=warmup, timer=self.timer, before_each=barrier)

    def peak(self, run, *, tokens: int, path: Path, kind: str) -> int:
        return measure.peak_bytes(run)

    def fits(self, run, *, tokens: int, path: Path, kind: str) -> tuple[bool, int | None]:
        return measure.fits_in_memory(run)

    def output_matmuls(self, tokens: int, hidden: int, vocab: int, *, backward: bool) -> Callable[[], None]:
        """The bare output layer's GEMMs (``step_paths.output_matmuls``) on this device, in its dtype."""
        return output_matmuls(tokens, hidden, vocab, backward=backward, device=self.device, dtype=self.matmul_dtype)

    def snapshot(self, run, *, tokens: int, path: Path, kind: str) -> dict:
        return memory_snapshot.record(run)

    def cleanup(self) -> None:
        """Free what the last pass left: megatron-core's global memory buffer (the local attention writes its S × S
        scores there, and the buffer keeps the largest size ever asked for: without this a probe at a large B
        would stay resident through every later row), garbage cycles, the caching allocator's free blocks."""
        import gc

        from megatron.core import parallel_state as ps

        if ps._GLOBAL_MEMORY_BUFFER is not None:
            ps.get_global_memory_buffer().buffer.clear()
        gc.collect()
        torch.cuda.empty_cache()

    def resting_bytes(self) -> int:
        self.cleanup()
        return torch.cuda.memory_allocated()

    def usable_bytes(self) -> int:
        return torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()

    def device_name(self) -> str:
        return torch.cuda.get_device_name()


class DryMeter(GpuMeter):
    """``--dry-run``: every pass still runs (on the CPU), but its time is the host clock's and its memory a fixed
    model — ``DRY_BASE`` + tokens × a per-path cost, against ``DRY_USABLE`` — so that the search has something to
    find; its memory snapshots are written from the same model (``memory_snapshot.synthetic``). Nothing here is a
    measurement."""

    dry = True
    device = "cpu"
    matmul_dtype = torch.float32
    timer = staticmethod(host_ms)
    DRY_BASE = 1 * GiB
    DRY_USABLE = 2 * GiB
    DRY_RUN_ROWS = 8
    """Probes above this many rows are decided by the model alone (the pass is not run)."""
    DRY_PER_TOKEN = {"floor": 1.0, "logits": 1.0, "fused": 1.0, "fused_fp32": 1.02, "logits_fp32": 1.02,
                     "logits_model_layer": 1.2, "common": 1.3, "fp32_head_tf32": 1.4, "fp32_head": 1.4}

    def _per_token(self, path: Path, kind: str) -> float:
        return (GiB / (40 * DRY_SEQ)) * self.DRY_PER_TOKEN[Path(path).value] * (0.25 if kind == "forward" else 1)

    def _model_peak(self, tokens: int, path: Path, kind: str) -> int:
        return int(self.DRY_BASE + tokens * self._per_token(path, kind))

    def peak(self, run, *, tokens: int, path: Path, kind: str) -> int:
        run()
        return self._model_peak(tokens, path, kind)

    def fits(self, run, *, tokens: int, path: Path, kind: str) -> tuple[bool, int | None]:
        peak = self._model_peak(tokens, path, kind)
        if peak > self.DRY_USABLE:
            return False, None
        if tokens <= self.DRY_RUN_ROWS * DRY_SEQ:
            run()
        return True, peak

    def snapshot(self, run, *, tokens: int, path: Path, kind: str) -> dict:
        """The pass runs (at up to ``DRY_RUN_ROWS`` rows, as in ``fits``); its "snapshot" is the memory model's: the
        floor's per-token activations, and what the path costs beyond them a token, under a stand-in site of this script."""
        if tokens <= self.DRY_RUN_ROWS * DRY_SEQ:
            run()
        floor = tokens * self._per_token(Path.FLOOR, kind)
        extra = tokens * self._per_token(path, kind) - floor
        blocks = [("scripts/step_meter.py:0 in dry_decoder_activations", int(floor), True)]
        if extra > 0:
            blocks.append((f"scripts/step_meter.py:0 in dry_{Path(path).value}_extra", int(extra), True))
        return memory_snapshot.synthetic(blocks)

    def cleanup(self) -> None:
        import gc

        gc.collect()

    def resting_bytes(self) -> int:
        return self.DRY_BASE

    def usable_bytes(self) -> int:
        return self.DRY_USABLE

    def device_name(self) -> str:
        return "CPU DRY RUN (stubbed measurements)"
