"""No host read of a tensor in MegatronGRPO's training pass, at TP = 1 and TP = 2, on the code path a GPU takes.

A GPU run cannot be made here; instead each torchrun rank (gloo, the CPU stand-in for GPTModel under Megatron DDP,
megatron-core's own ``forward_step`` / ``backward_step`` and ``finalize_model_grads``) runs the training pass the
way a GPU does — GRPOLoss's Triton backend (what ``LossBackend.AUTO`` picks for CUDA tensors; Triton's interpreter
here) and the deferred input checks (``CheckInputs.DEFERRED`` reads its counters only at ``check_errors``; on the
CPU it would read them at once) — with the step's GlobalBatch built before it, as a training loop does. Under a
``TorchDispatchMode`` that sees every aten op, and with ``Tensor.tolist`` / ``numpy`` / ``cpu`` / ``item`` / ``__bool__``
/ ``__int__`` / ``__float__`` / ``__repr__`` / ``to("cpu")`` wrapped (they read a CPU tensor without an aten op), the
pass must make none of the reads that synchronize the host with a GPU: ``_local_scalar_dense`` (``item()``, ``int()``,
``float()``, ``bool()``, a tensor in an ``if``), ``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave``
without sizes, a copy to the host. Both output paths (logits, fused), the second pass of each (after a warm-up).

This covers mp_grpo's side, whatever the TP size: the log-prob op's all-gather (TP > 1) adds a collective, not a
host read. What the CPU cannot show — a CUDA-only branch (``ops/output_chunks.py``'s mixed-dtype GEMM) and
megatron-core's GPU schedule — ``tests/gpu/test_megatron_no_sync.py`` checks on one GPU under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed import torchrun, worker_main

HOST_READ_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
                 "unique_consecutive", "equal", "is_nonzero", "allclose", "repeat_interleave", "bincount", "histc"}
"""aten ops whose result the host reads (or whose output size depends on the data): each synchronizes with a GPU."""
HOST_READ_METHODS = ("tolist", "numpy", "cpu", "item", "__bool__", "__int__", "__float__", "__repr__", "__format__")
"""Tensor methods that read values on the host; on a CPU tensor some of them dispatch no aten op."""
MICRO_BATCHES, ROWS = 2, 2


class HostReads(TorchDispatchMode):
    """Records each host read (op or method, and the mp_grpo / test frames that made it)."""

    active: list[HostReads] = []

    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter = collections.Counter()

    def note(self, name: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-2] if "/mp_grpo/" in f.filename or "/tests/" in f.filename]
        self.reads[(name, " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-4:][::-1]))] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in HOST_READ_OPS:
            self.note(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        HostReads.active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        HostReads.active.pop()
        return super().__exit__(*exc)


def _watch_tensor_methods() -> None:
    """Wrap the host-reading Tensor methods so that the active :class:`HostReads` records them."""
    for name in HOST_READ_METHODS:
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, _original=original, _name=name, **kwargs):
            if HostReads.active:
                HostReads.active[-1].note(f"Tensor.{_name}")
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, wrapper)
    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        device = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
        if HostReads.active and device is not None and torch.device(device).type == "cpu":
            HostReads.active[-1].note("Tensor.to(cpu)")
        return original_to(self, *args, **kwargs)

    torch.Tensor.to = to


def case_training_pass(tp: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

    from mp_grpo.config.job import OutputPath
    from mp_grpo.loss.grpo_loss import GRPOLoss, LossBackend
    from mp_grpo.megatron import MegatronGRPO, ParallelGroups, prepare_micro_batch
    from mp_grpo.ops.checks import deferred_checks
    from mp_grpo.train.cpu_ddp import CpuDistributedDataParallel
    from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config
    from mp_grpo.train.cpu_schedule import forward_backward_cpu
    from tests.megatron import helpers as H

    assert dist.get_world_size() == tp
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        groups = ParallelGroups.from_parallel_state()
        config = cpu_model_config(hidden_size=H.HIDDEN, tensor_model_parallel_size=tp, calculate_per_token_loss=False)
        config.finalize_model_grads_func = finalize_model_grads
        model = CpuGPTStandIn(config, vocab_size=H.VOCAB, max_sequence_length=H.MAX_LEN, tp_group=groups.tp)
        model.load_full_weights(H.full_weights())
        ddp = CpuDistributedDataParallel(config, DistributedDataParallelConfig(), model, dp_cp_group=groups.dp_cp)
        rollouts = H.make_rollouts(MICRO_BATCHES * ROWS, seed=5)
        micro = [prepare_micro_batch(rollouts.select(slice(i * ROWS, (i + 1) * ROWS))) for i in range(MICRO_BATCHES)]
        _watch_tensor_methods()
        found = {}
        for path in (OutputPath.LOGITS, OutputPath.FUSED):
            grpo = MegatronGRPO(H.loss_config("ppo_token_tis"), temperature=H.TEMPERATURE, calculate_per_token_loss=False,
                                num_microbatches=MICRO_BATCHES, groups=groups, output_path=path)
            grpo.loss = GRPOLoss(grpo.config, backend=LossBackend.TRITON)  # what AUTO picks for CUDA tensors
            batch = grpo.global_batch(micro, step=0)  # data preparation, before the pass
            with deferred_checks():
                for _ in range(2):  # a warm-up pass, then the watched one
                    watch = HostReads()
                    with watch:
                        forward_backward_cpu(forward_step_func=grpo.forward_step_func(batch, step=0),
                                             data_iterator=iter(micro), model=ddp, num_microbatches=MICRO_BATCHES,
                                             groups=groups)
            grads = [getattr(p, "main_grad", p.grad) for p in model.parameters()]
            assert any(g is not None and g.abs().sum() > 0 for g in grads), "the pass made no gradient"
            found[path.value] = dict(watch.reads)
        reads = {path: r for path, r in found.items() if r}
        assert not reads, f"host reads in the training pass at TP = {tp}: " + "; ".join(
            f"{path}: " + ", ".join(f"{name} ×{n} at {where}" for (name, where), n in r.items()) for path, r in reads.items())
        if dist.get_rank() == 0:
            print(f"TP = {tp}: no host read in the training pass (logits and fused paths)", flush=True)
    finally:
        ps.destroy_model_parallel()


def case_the_watch_sees_host_reads() -> None:
    """The watch itself: each kind of read it must catch, on CPU tensors."""
    _watch_tensor_methods()
    x = torch.arange(4.0)
    reads = {"int": lambda: int(x[1]), "float": lambda: float(x.sum()), "bool": lambda: bool((x > 1).any()),
             "if": lambda: 1 if x[2] > 0 else 0, "item": lambda: x[0].item(), "tolist": lambda: x.tolist(),
             "nonzero": lambda: x.nonzero(), "cpu": lambda: x.cpu(), "to": lambda: x.to("cpu"),
             "print": lambda: str(x), "numpy": lambda: x.numpy()}
    for name, read in reads.items():
        watch = HostReads()
        with watch:
            read()
        assert watch.reads, f"{name}: not seen"
    watch = HostReads()
    with watch:
        (x * 2 + 1).sum()
    assert not watch.reads


@pytest.mark.parametrize("tp", [1, 2])
def test_no_host_read_in_the_training_pass(tp: int) -> None:
    torchrun(__file__, "case_training_pass", tp, tp=tp)


def test_the_watch_sees_host_reads() -> None:
    torchrun(__file__, "case_the_watch_sees_host_reads", 1)


if __name__ == "__main__":
    worker_main({"case_training_pass": case_training_pass, "case_the_watch_sees_host_reads": case_the_watch_sees_host_reads})
