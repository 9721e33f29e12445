"""The process groups the Megatron adapter uses, taken from ``megatron.core.parallel_state`` or given.

Megatron's names: ``tp`` (tensor parallel, shards the vocabulary), ``cp`` (context parallel, shards
every sequence), ``dp`` (pure data parallel), ``dp_cp`` (data × context parallel: the group that
Megatron's DDP reduces gradients over and ``finalize_model_grads`` reduces the token count over,
and the group the step's :class:`~mp_grpo.GlobalBatch` is counted over) and ``pp`` (pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass

from mp_grpo.collectives import ProcessGroup, group_size


@dataclass(frozen=True)
class ParallelGroups:
    """Explicit process groups; ``None`` means "no parallelism of this kind" (a group of size 1)."""

    tp: ProcessGroup | None = None
    """Tensor-parallel group: rank r holds vocabulary ids ``[r·V_local, (r+1)·V_local)``."""
    cp: ProcessGroup | None = None
    """Context-parallel group: rank r holds sequence chunks r and 2·CP−1−r."""
    dp_cp: ProcessGroup | None = None
    """Data × context parallel group: gradients, token counts and the GlobalBatch reduce over it."""
    pp: ProcessGroup | None = None
    """Pipeline group (``finalize_model_grads`` broadcasts the token count from its last stage)."""

    @classmethod
    def from_parallel_state(cls) -> ParallelGroups:
        """The groups of an initialized ``megatron.core.parallel_state``."""
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError(
                "megatron.core.parallel_state is not initialized: call "
                "parallel_state.initialize_model_parallel(...) first, or pass groups=ParallelGroups(...) explicitly"
            )
        return cls(
            tp=parallel_state.get_tensor_model_parallel_group(),
            cp=parallel_state.get_context_parallel_group(),
            dp_cp=parallel_state.get_data_parallel_group(with_context_parallel=True),
            pp=parallel_state.get_pipeline_model_parallel_group(),
        )

    @property
    def tp_size(self) -> int:
        return group_size(self.tp)

    @property
    def cp_size(self) -> int:
        return group_size(self.cp)

    @property
    def dp_cp_size(self) -> int:
        return group_size(self.dp_cp)

    @property
    def dp_size(self) -> int:
        """Pure data-parallel size: ``|dp_cp| / |cp|``."""
        if self.dp_cp_size % self.cp_size:
            raise ValueError(
                f"groups: the dp_cp group (size {self.dp_cp_size}) must be a multiple of the cp group (size {self.cp_size})"
            )
        return self.dp_cp_size // self.cp_size


def resolve_groups(groups: ParallelGroups | None) -> ParallelGroups:
    """``groups`` itself, or the groups of ``megatron.core.parallel_state`` when it is ``None``."""
    if groups is None:
        return ParallelGroups.from_parallel_state()
    if not isinstance(groups, ParallelGroups):
        raise TypeError(f"groups must be a ParallelGroups or None, got {type(groups).__name__}")
    return groups
