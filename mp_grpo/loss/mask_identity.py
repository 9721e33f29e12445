"""Whether a loss mask is one a GlobalBatch was built from: the wrong-step protection of the step's account.

A :class:`~mp_grpo.loss.global_batch.GlobalBatch` holds the loss masks it counted and each one's in-place version
counter. A micro-batch's mask passes when it is one of them — the same storage, shape, strides and device (the
same tensor, or a view taken the same way), not modified in place since — or, another tensor of one of their
shapes (a copy), when its content equals one of them: compared on the device and reported through the deferred
error ledger (:mod:`mp_grpo.ops.checks`: at once on the CPU, at the step's next sync point on a GPU; no host read
here). Any other mask — another step's, even of the same shapes — raises :class:`StaleGlobalBatchError`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mp_grpo.ops.checks import record_errors


class StaleGlobalBatchError(ValueError):
    """A GlobalBatch is used with a micro-batch, step or config it was not built for."""


def check_known_mask(
    loss_mask: torch.Tensor, name: str, masks: Sequence[torch.Tensor], versions: Sequence[int],
    shapes: Sequence[tuple[int, ...]],
) -> None:
    """Raise :class:`StaleGlobalBatchError` unless ``loss_mask`` is one of ``masks`` (built at ``versions``; their
    token ``shapes`` for the message), as the module docstring says."""
    for mask, version in zip(masks, versions):
        if _same_tensor(mask, loss_mask):
            if loss_mask._version != version:
                raise StaleGlobalBatchError(
                    f"{name} was modified in place after the GlobalBatch was built from it: its counts are stale; "
                    "build the GlobalBatch after the micro-batches are final"
                )
            return
    same_shape = [m for m in masks if m.shape == loss_mask.shape]
    if not same_shape:
        raise StaleGlobalBatchError(
            f"{name} is not one of the loss masks this GlobalBatch was built from: it has shape "
            f"{tuple(loss_mask.shape)}, the batch's micro-batches have shapes {list(shapes)} "
            "(a GlobalBatch from another step?)"
        )
    # Another tensor of a known shape (a copy, e.g. an indexed selection made again): it must equal one of
    # them. Compared on the device; on a GPU the verdict waits for mp_grpo.check_errors() (no host read).
    equal = torch.stack([(m == loss_mask).all() for m in same_shape]).any()
    record_errors(
        "stale GlobalBatch", (~equal).to(torch.int64),
        lambda _: (f"{name} is not one of the loss masks this GlobalBatch was built from (another tensor of shape "
                   f"{tuple(loss_mask.shape)} with other content): a GlobalBatch from another step, or micro-batches "
                   "rebuilt after the batch? Build the GlobalBatch from the very micro-batches the step runs"),
        StaleGlobalBatchError,
    )


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same elements of the same storage (``a is b``, or a view taken the same way)."""
    return a is b or (
        a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        and a.numel() > 0 and a.data_ptr() == b.data_ptr()
    )
