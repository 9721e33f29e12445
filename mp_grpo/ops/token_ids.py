"""Per-token lists of vocabulary ids in CSR form (vLLM's layout): the rollout engine's captured support of every token
(:class:`CapturedSupport`) and its top-K ids (:class:`TokenIds`).

Token i's ids are ``ids[indptr[i] : indptr[i + 1]]``, over the flattened tokens of the op's ``target`` (row-major);
``indptr`` has one entry more than there are tokens, ``indptr[0] = 0``, it never decreases, and
``indptr[-1] = len(ids)``. vLLM returns a token's sampling support so (``SamplingMask(token_ids, offsets)``, its ids
in vocabulary order), and prime-rl / verifiers carry them as ids plus per-token counts (``indptr`` is their running
sum with a leading 0).

Checks: the types, shapes and devices on the host (:meth:`TokenIds.__post_init__`, :func:`check_token_ids`); the
values — the row pointer's structure, ids in ``[0, V_global)`` and, for a support, each token's ids strictly
increasing (no id twice) — on the device (:func:`record_token_ids_errors`), through the deferred error ledger like
every check of a value (``mp_grpo.ops.checks``): no host read on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mp_grpo.ops.checks import CheckInputs, record_errors


@dataclass(frozen=True)
class TokenIds:
    """Each token's list of global vocabulary ids, CSR over the flattened tokens: token i's ids are
    ``ids[indptr[i] : indptr[i + 1]]`` (see the module docstring). What
    :func:`mp_grpo.vocab_parallel_logprobs_with_top_k` and the fused ops take as the rollout engine's top-K ids (any
    order within a token)."""

    indptr: torch.Tensor
    """``[tokens + 1]`` int64 row pointer: ``indptr[0] = 0``, non-decreasing, ``indptr[-1] = len(ids)``."""
    ids: torch.Tensor
    """``[nnz]`` int64 global vocabulary ids, ``[0, V_global)``."""

    def __post_init__(self) -> None:
        name = _name(self)
        for field, x in (("indptr", self.indptr), ("ids", self.ids)):
            if not isinstance(x, torch.Tensor) or x.dtype != torch.int64 or x.dim() != 1:
                got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise TypeError(f"{name}.{field} must be a 1-D int64 tensor, got {got}")
        if self.indptr.numel() == 0:
            raise ValueError(f"{name}.indptr must hold tokens + 1 entries (a leading 0), got an empty tensor")
        if self.ids.device != self.indptr.device:
            raise ValueError(f"{name}.ids is on {self.ids.device} but {name}.indptr is on {self.indptr.device}")

    @property
    def num_tokens(self) -> int:
        return self.indptr.numel() - 1

    @property
    def nnz(self) -> int:
        """Entries of all tokens together (``len(ids)``)."""
        return self.ids.numel()

    def to(self, device: torch.device | str) -> TokenIds:
        return type(self)(self.indptr.to(device), self.ids.to(device))

    @classmethod
    def from_lists(cls, lists: Sequence[Sequence[int]], device: torch.device | str | None = None) -> TokenIds:
        """From one list of ids per token (an empty list: no ids)."""
        counts = torch.tensor([len(x) for x in lists], dtype=torch.int64)
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        ids = torch.tensor([i for x in lists for i in x], dtype=torch.int64)
        return cls(indptr, ids) if device is None else cls(indptr.to(device), ids.to(device))


@dataclass(frozen=True)
class CapturedSupport(TokenIds):
    """The rollout engine's captured support of every token: the ids its sampler kept (top-k / top-p / min-p, …) when
    it drew the token, CSR over the flattened tokens (vLLM's ``SamplingMask``; module docstring), each token's ids
    strictly increasing (vLLM's order; :meth:`sorted` orders others). Passed as ``captured_support=`` the log-prob ops
    return the log-probs, entropy and gradient of each token's distribution renormalized over its support; a token
    with no ids is not restricted (the whole vocabulary)."""

    def sorted(self) -> CapturedSupport:
        """The same support with each token's ids in increasing order (one sort of all the ids)."""
        row = torch.repeat_interleave(torch.arange(self.num_tokens, device=self.ids.device),
                                      self.indptr[1:] - self.indptr[:-1], output_size=self.nnz)
        order = torch.sort(self.ids, stable=True).indices
        order = order[torch.sort(row[order], stable=True).indices]
        return CapturedSupport(self.indptr, self.ids[order])


def _name(ids: TokenIds) -> str:
    return "captured_support" if isinstance(ids, CapturedSupport) else "top_k_ids"


def check_token_ids(ids: TokenIds, name: str, target_shape: torch.Size, device: torch.device,
                    kind: type[TokenIds] = TokenIds) -> None:
    """Host checks of a CSR argument ``name`` against the op's tokens: its type, one row per token of
    ``target_shape`` and the logits' ``device`` (its values: :func:`record_token_ids_errors`)."""
    if not isinstance(ids, kind):
        raise TypeError(f"{name} must be a mp_grpo.{kind.__name__} or None, got {type(ids).__name__}")
    tokens = target_shape.numel()
    if ids.num_tokens != tokens:
        raise ValueError(f"{name}.indptr has {ids.indptr.numel()} entries but target {tuple(target_shape)} holds "
                         f"{tokens} tokens: it must hold tokens + 1 = {tokens + 1} (CSR over the flattened tokens)")
    if ids.indptr.device != device:
        raise ValueError(f"{name} is on {ids.indptr.device} but the logits are on {device}")


def record_token_ids_errors(ids: TokenIds, name: str, v_global: int, mode: CheckInputs, *,
                            strictly_increasing: bool) -> None:
    """Count, on the device, the entries of ``ids`` that break the CSR's rules — ``indptr[0] = 0``, ``indptr``
    non-decreasing, ``indptr[-1] = nnz``, ids in ``[0, v_global)`` and (``strictly_increasing``) each token's ids in
    increasing order, none twice — into the deferred error ledger (raised at once on the CPU, at the next
    ``mp_grpo.check_errors()`` on a GPU; nothing with ``mode`` OFF). The kernels read nothing out of bounds either
    way (a malformed row reads as empty; an id outside the vocabulary belongs to no shard)."""
    if mode is CheckInputs.OFF:
        return
    indptr, values = ids.indptr, ids.ids
    nnz = values.numel()
    broken = (indptr[0] != 0).to(torch.int64) + (indptr[1:] < indptr[:-1]).sum() + (indptr[-1] != nnz).to(torch.int64)
    broken = broken + ((values < 0) | (values >= v_global)).sum()
    rules = f"indptr[0] = 0, indptr non-decreasing, indptr[-1] = len(ids) = {nnz}, ids in [0, {v_global})"
    if strictly_increasing and nnz > 1:
        # An entry that starts no token follows its token's previous id: it must be larger.
        starts = torch.zeros(nnz + 1, dtype=torch.bool, device=values.device)
        starts.index_fill_(0, indptr.clamp(0, nnz), True)
        broken = broken + (~starts[1:nnz] & (values[1:] <= values[:-1])).sum()
        rules += ", each token's ids strictly increasing (CapturedSupport.sorted() orders them; none twice)"
    record_errors(f"{name} malformed", broken, lambda n: f"{name}: {n} violation(s) of the CSR's rules ({rules})",
                  mode=mode)
