"""NeMo-RL's micro-batch data dict as the loss's per-token fields: shifted, and under context parallelism cut.

NeMo-RL's data dict holds token-aligned ``[B, S]`` fields (entry ``[b, s]`` describes token ``input_ids[b, s]``):
``token_mask``, ``advantages``, ``prev_logprobs``, ``generation_logprobs``, ``reference_policy_logprobs``, and
``[B]`` ``sample_mask``. The loss is taken at the logit positions: position ``t`` predicts token ``t+1``.

* **Log-prob input** (:func:`shifted_fields`): NeMo-RL hands ``[B, S-1]`` log-probs of tokens ``1..S-1``; every
  field is ``x[:, 1:]`` (``ClippedPGLossFn`` does the same).
* **Logit input** (:func:`logit_fields`): the logits are this rank's ``[B, S_local, V/TP]`` shard, not shifted,
  with ``S_local · CP = S_pad ≥ S``. Schedule:

  1. Shift on the whole sequence: position ``t < S-1`` gets the field of token ``t+1`` and target
     ``input_ids[t+1]``; positions ``t ≥ S-1`` (the last token, then NeMo-RL's padding up to ``S_pad``) have
     no target: mask 0, target ``IGNORE_INDEX``. Masked positions get target ``IGNORE_INDEX`` too.
  2. Context parallelism: NeMo-RL's load-balanced split, the one Megatron gives the model's input — ``S_pad``
     cut into ``2·CP`` chunks, rank r keeps chunks r and ``2·CP−1−r`` (``_get_tokens_on_this_cp_rank`` in
     ``nemo_rl/distributed/model_utils.py``; :func:`mp_grpo.megatron.context_parallel.cp_positions`). NeMo-RL's
     Megatron worker packs sequences when CP > 1 and calls a logit loss once per sequence with that
     sequence's ``[1, padded_len / CP, V/TP]`` slice: the same rule on one row.

  Shifting happens before the cut, so a chunk's last target — the first token of the next chunk, usually on
  another CP rank — is right.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from mp_grpo.collectives import ProcessGroup, group_rank, group_size
from mp_grpo.megatron.context_parallel import cp_positions, select_positions

IGNORE_INDEX = -100
"""Target of positions without a trained token (the log-prob kernel gives them 0, with no gradient)."""

TOKEN_FIELDS = ("advantages", "prev_logprobs", "generation_logprobs", "reference_policy_logprobs")
"""Token-aligned float fields of NeMo-RL's GRPO data dict the loss may read."""


class LossFields(NamedTuple):
    """The loss's per-token inputs at logit positions (this rank's positions under context parallelism)."""

    mask: torch.Tensor
    """Bool: ``token_mask`` of the predicted token × ``sample_mask`` of its row."""
    token_mask: torch.Tensor
    """Bool: ``token_mask`` of the predicted token alone (NeMo-RL's per-sequence means count these)."""
    sample_mask: torch.Tensor
    """``[B]`` bool."""
    fields: dict[str, torch.Tensor]
    """Each present :data:`TOKEN_FIELDS` entry (and ``curr_logprobs_unfiltered``), at the same positions."""
    target: torch.Tensor | None
    """Logit input only: the token each position predicts, ``IGNORE_INDEX`` where not trained on."""


def _get(data: Mapping[str, object], name: str) -> torch.Tensor:
    try:
        value = data[name]
    except KeyError:
        raise KeyError(f"data must hold {name!r} (NeMo-RL's GRPO data dict); it holds {sorted(data)}") from None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"data[{name!r}] must be a tensor, got {type(value).__name__}")
    return value


def _masks(data: Mapping[str, object]) -> tuple[torch.Tensor, torch.Tensor]:
    token_mask, sample_mask = _get(data, "token_mask"), _get(data, "sample_mask")
    if token_mask.dim() != 2:
        raise ValueError(f"data['token_mask'] must be [B, S], got shape {tuple(token_mask.shape)}")
    if sample_mask.shape != token_mask.shape[:1]:
        raise ValueError(f"data['sample_mask'] must be [B] = [{token_mask.shape[0]}], got shape {tuple(sample_mask.shape)}")
    return token_mask, sample_mask


def _check_token_field(name: str, x: torch.Tensor, shape: torch.Size) -> None:
    if x.shape != shape:
        raise ValueError(f"data[{name!r}] has shape {tuple(x.shape)}, data['token_mask'] has {tuple(shape)}")
    if not x.is_floating_point():
        raise TypeError(f"data[{name!r}] must be a floating-point tensor, got {x.dtype}")


def shifted_fields(data: Mapping[str, object], names: tuple[str, ...]) -> LossFields:
    """Log-prob input: every field of ``names`` as ``x[:, 1:]``, the masks likewise (``[B, S-1]``).

    ``curr_logprobs_unfiltered`` (NeMo-RL's unfiltered log-probs under top-k / top-p filtering) is already
    ``[B, S-1]`` and is taken as it is.
    """
    token_mask, sample_mask = _masks(data)
    keep = sample_mask != 0
    tm = token_mask[:, 1:] != 0
    out = {}
    for name in names:
        x = _get(data, name)
        _check_token_field(name, x, token_mask.shape)
        out[name] = x[:, 1:]
    if "curr_logprobs_unfiltered" in data:
        unfiltered = _get(data, "curr_logprobs_unfiltered")
        if unfiltered.shape != tm.shape:
            raise ValueError(f"data['curr_logprobs_unfiltered'] must be [B, S-1] = {tuple(tm.shape)}, got "
                             f"{tuple(unfiltered.shape)}")
        out["curr_logprobs_unfiltered"] = unfiltered
    return LossFields(mask=tm & keep.unsqueeze(1), token_mask=tm, sample_mask=keep, fields=out, target=None)


def logit_fields(
    data: Mapping[str, object], names: tuple[str, ...], local_len: int, cp_group: ProcessGroup | None
) -> LossFields:
    """Logit input: the fields of ``names`` and the targets at this rank's ``local_len`` logit positions
    (module docstring, steps 1–2)."""
    token_mask, sample_mask = _masks(data)
    input_ids = _get(data, "input_ids")
    if input_ids.shape != token_mask.shape or input_ids.is_floating_point():
        raise ValueError(f"data['input_ids'] must be integer [B, S] = {tuple(token_mask.shape)}, got "
                         f"{input_ids.dtype} {tuple(input_ids.shape)}")
    cp_size, cp_rank = group_size(cp_group), group_rank(cp_group)
    seq_len, padded = token_mask.shape[1], local_len * cp_size
    if padded < seq_len:
        raise ValueError(f"logits: {local_len} positions × context-parallel size {cp_size} = {padded} < the data's "
                         f"sequence length {seq_len}: the logits do not cover data['input_ids']")
    keep = sample_mask != 0

    # --- 1. shift on the whole (padded) sequence: position t gets token t+1's fields ---
    def shift(x: torch.Tensor, fill) -> torch.Tensor:
        tail = x.new_full((x.shape[0], padded - seq_len + 1), fill)
        return torch.cat([x[:, 1:], tail], dim=1)

    mask = shift(token_mask != 0, False) & keep.unsqueeze(1)
    tm = shift(token_mask != 0, False)
    target = torch.where(mask, shift(input_ids.long(), 0), torch.full((), IGNORE_INDEX, device=input_ids.device))
    out = {}
    for name in names:
        x = _get(data, name)
        _check_token_field(name, x, token_mask.shape)
        out[name] = shift(x, 0.0)

    # --- 2. context parallelism: chunks r and 2·CP−1−r of the padded sequence ---
    if cp_size > 1:
        positions = cp_positions(padded, cp_size, cp_rank, device=token_mask.device)
        mask, tm, target = (select_positions(x, positions) for x in (mask, tm, target))
        out = {name: select_positions(x, positions) for name, x in out.items()}
    return LossFields(mask=mask, token_mask=tm, sample_mask=keep, fields=out, target=target)
