"""The few collectives mp_grpo makes, in one place.

In the style of megatron-core's ``tensor_parallel/mappings.py``: every helper takes its process
group as an explicit argument (``None`` means "no parallelism"), returns early for a group of size
1, and says what it reduces. None of them is differentiable: the autograd Functions that call them
derive their backward analytically so that backward needs no collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup

# torch >= 2.13 names the one-tensor all-gather all_gather_single (all_gather_into_tensor warns there).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_size(group: ProcessGroup | None) -> int:
    """World size of ``group``; 1 for ``None`` or when torch.distributed is not initialized."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank inside ``group``; 0 for ``None`` or without torch.distributed."""
    if group_size(group) == 1:
        return 0
    return dist.get_rank(group)


def all_gather_stacked(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Gather ``x`` from every rank of ``group`` into a new ``[world, *x.shape]`` tensor.

    One all-gather of a single tensor; rank r's tensor lands at index r.
    """
    world = group_size(group)
    if world == 1:
        return x.unsqueeze(0)
    x = x.contiguous()
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return out.view(world, *x.shape)


def all_gather_varlen(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Every rank's 1-D ``x`` of its own length, concatenated in rank order.

    Two all-gathers: the sizes (a host read of them follows: the gathered length is variable), then the values
    padded to the largest size. Returns ``x`` itself for a group of size 1, or when every rank's ``x`` is empty.
    """
    if group_size(group) == 1:
        return x
    sizes = all_gather_stacked(torch.tensor([x.numel()], dtype=torch.int64, device=x.device), group)
    sizes_list = [int(s) for s in sizes.view(-1).tolist()]
    if max(sizes_list) == 0:
        return x
    padded = torch.zeros(max(sizes_list), dtype=x.dtype, device=x.device)
    padded[: x.numel()] = x
    gathered = all_gather_stacked(padded, group)
    return torch.cat([gathered[r, :n] for r, n in enumerate(sizes_list)])


def all_reduce_sum(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum ``x`` over ``group``; returns a new tensor and leaves ``x`` unchanged."""
    if group_size(group) == 1:
        return x.clone()
    out = x.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def all_reduce_max(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Element-wise maximum of ``x`` over ``group``; returns a new tensor."""
    if group_size(group) == 1:
        return x.clone()
    out = x.clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def all_gather_object_sizes(value: int, group: ProcessGroup | None) -> list[int]:
    """Gather one Python int from every rank of ``group`` (a CPU-side handshake, not a hot path)."""
    world = group_size(group)
    if world == 1:
        return [value]
    out: list[int | None] = [None] * world
    dist.all_gather_object(out, value, group=group)
    return [int(v) for v in out]  # type: ignore[arg-type]


def is_last_rank(group: ProcessGroup | None) -> bool:
    """Whether this process is the last rank of ``group`` (the last pipeline stage of a PP group); True for size 1."""
    return group_rank(group) == group_size(group) - 1


def broadcast_from_last(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``x`` of the last rank of ``group`` on every rank (a new tensor; ``x`` itself for a group of size 1;
    ``x`` gives shape and dtype elsewhere).

    One broadcast; used over the pipeline group, whose last stage holds what only the loss sees.
    """
    if group_size(group) == 1:
        return x
    out = x.clone().contiguous()
    dist.broadcast(out, src=dist.get_global_rank(group, group_size(group) - 1), group=group)
    return out


def broadcast_object_from_last(value: object, group: ProcessGroup | None) -> object:
    """A picklable ``value`` of the last rank of ``group`` on every rank (a host-side exchange, once per step)."""
    if group_size(group) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, group_size(group) - 1), group=group)
    return box[0]


def all_reduce_argmax(value: torch.Tensor, index: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Per element, the ``index`` of the largest ``value`` over ``group`` (ties: the smallest index).

    One all-reduce (MAX) of one int64 tensor: ``value`` (float32) is mapped to an order-preserving int32
    key in the high 32 bits and ``index`` (0 ≤ index < 2³²) is stored complemented in the low 32 bits,
    so the maximum of the packed words is the (value, index) pair with the largest value and, among
    equal values, the smallest index. The float32 values' order is exact (NaN is not allowed).
    """
    if value.dtype != torch.float32 or index.dtype != torch.int64 or value.shape != index.shape:
        raise ValueError(f"value must be float32 and index int64 of the same shape, got {value.dtype} "
                         f"{tuple(value.shape)} and {index.dtype} {tuple(index.shape)}")
    if group_size(group) == 1:
        return index.clone()
    bits = value.contiguous().view(torch.int32).to(torch.int64)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: flip the magnitude bits
    packed = (key << 32) | (0xFFFFFFFF - index)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    return 0xFFFFFFFF - (packed & 0xFFFFFFFF)
