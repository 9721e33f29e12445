"""A plain-torch stand-in for the two flash-attn functions Megatron-LM's dynamic inference engine calls.

NOT flash-attn. The launcher (``scripts/megatron_lm_rl/run.py --flash-attn stand-in``) puts this folder on
``sys.path`` when the real flash-attn (a long CUDA compile, no binary wheel) is not installed. It replaces the
attention kernel of the rollout engine only — ``megatron/core/transformer/attention.py``'s dynamic-batching path
(``flash_decode_and_prefill``: prefill through :func:`flash_attn_varlen_func`, decode through
:func:`flash_attn_with_kvcache`, both on the engine's paged KV cache). The training forward (Transformer Engine's
attention), mp_grpo's code and Megatron-LM's training loop never call it. Slow (one gather of each request's
keys, dense scores in fp32) and exact to the semantics below; tested against dense causal attention in
``tests/scripts/megatron_lm_rl/test_flash_attn_standin.py``.

Semantics kept from flash-attn 2 (the arguments Megatron-LM passes; anything else is refused):

- paged KV cache ``[num_blocks, block_size, H_kv, D]`` with ``block_table [B, max_blocks]``: key j of request b is
  at ``block_table[b, j // block_size]``, slot ``j % block_size``;
- causal masking aligned to the bottom right (query i of a request with ``s_q`` queries and ``s_k`` keys sees
  keys ``j <= i + s_k - s_q``), a sliding window ``(left, right)`` with -1 for none, grouped-query attention
  (``H_q`` a multiple of ``H_kv``);
- ``return_attn_probs`` / ``return_softmax_lse``: the log-sum-exp of the scaled scores, ``[H, total_q]`` (varlen)
  or ``[B, H, S_q]`` (kvcache); rows without a key give output 0 and lse −inf.
"""

from __future__ import annotations

import torch

__version__ = "2.7.3+mpgrpo.torch.standin"
"""Megatron-LM requires flash-attn >= 2.7.3 for dynamic batching (``is_fa_min_version``); the local version label
says what this is, in every log line that prints it."""
IS_STAND_IN = True


def _check(window_size, block_table, extra: dict) -> tuple[int, int]:
    unsupported = {k: v for k, v in extra.items() if v not in (None, False, 0, 0.0)}
    if unsupported:
        raise NotImplementedError(f"flash_attn stand-in: arguments not supported: {sorted(unsupported)}")
    if block_table is None:
        raise NotImplementedError("flash_attn stand-in: only the paged KV cache (block_table) is supported")
    left, right = (-1, -1) if window_size is None else window_size
    return int(left), int(right)


def _paged_keys(cache: torch.Tensor, block_table: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``[B, num_keys, H_kv, D]``: each request's first ``num_keys`` cache slots (unused table entries clamped to
    block 0; the masks below keep them out)."""
    blocks = cache[block_table.long().clamp(min=0)]  # [B, max_blocks, block_size, H, D]
    B, nb, bs, H, D = blocks.shape
    keys = blocks.reshape(B, nb * bs, H, D)
    if num_keys > nb * bs:
        raise ValueError(f"flash_attn stand-in: {num_keys} keys do not fit the block table's {nb * bs} slots")
    return keys[:, :num_keys]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_valid: torch.Tensor, q_len: torch.Tensor,
            k_len: torch.Tensor, scale: float, causal: bool, left: int, right: int):
    """Padded attention: ``q [B, Sq, Hq, D]``, ``k / v [B, Sk, Hk, D]``, lengths ``[B]``. Returns out
    ``[B, Sq, Hq, D]`` (q's dtype) and lse ``[B, Hq, Sq]`` (fp32)."""
    B, Sq, Hq, D = q.shape
    Hk = k.shape[2]
    if Hq % Hk:
        raise ValueError(f"flash_attn stand-in: {Hq} query heads are not a multiple of {Hk} key heads")
    k = k.repeat_interleave(Hq // Hk, dim=2)
    v = v.repeat_interleave(Hq // Hk, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    i = torch.arange(Sq, device=q.device).view(1, Sq, 1)
    j = torch.arange(k.shape[1], device=q.device).view(1, 1, -1)
    offset = (k_len - q_len).view(B, 1, 1)  # bottom-right alignment
    keep = (j < k_len.view(B, 1, 1)) & q_valid.view(B, Sq, 1)
    if causal:
        keep = keep & (j <= i + offset)
    if left >= 0:
        keep = keep & (j >= i + offset - left)
    if right >= 0 and not causal:
        keep = keep & (j <= i + offset + right)
    keep = keep.unsqueeze(1)  # [B, 1, Sq, Sk]
    scores = torch.where(keep, scores, torch.full((), float("-inf"), device=q.device))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, Sq]; -inf where no key
    probs = torch.where(keep, torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1)),
                        torch.zeros((), device=q.device))
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.float())
    return out.to(q.dtype), lse


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2's varlen attention on a paged KV cache: ``q [total_q, H_q, D]``, ``k / v`` the cache, request b's
    queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` against its ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` keys.
    Returns out ``[total_q, H_q, D]`` (and, with ``return_attn_probs``, ``(out, lse [H_q, total_q], None)``). Query
    rows past ``cu_seqlens_q[-1]`` (padding) give 0."""
    left, right = _check(window_size, block_table, dict(dropout_p=dropout_p, softcap=softcap, alibi_slopes=alibi_slopes))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    B = cu_q.numel() - 1
    q_len, k_len = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    Sq, Sk = int(max_seqlen_q), int(max_seqlen_k)
    pos = torch.arange(Sq, device=q.device).view(1, Sq)
    q_valid = pos < q_len.view(B, 1)
    rows = torch.where(q_valid, cu_q[:-1].view(B, 1) + pos, torch.zeros((), dtype=torch.long, device=q.device))
    qp = q[rows]  # [B, Sq, H, D]
    keys, values = _paged_keys(k, block_table[:B], Sk), _paged_keys(v, block_table[:B], Sk)
    out_p, lse_p = _attend(qp, keys, values, q_valid, q_len, k_len, scale, causal, left, right)
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    out[rows[q_valid]] = out_p[q_valid]
    lse[:, rows[q_valid]] = lse_p.permute(1, 0, 2)[:, q_valid]
    return (out, lse, None) if return_attn_probs else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn 2's decode attention: ``q [B, S_q, H_q, D]`` against each request's ``cache_seqlens[b]`` keys of the
    paged cache (``k`` / ``v`` / rotary / ``cache_batch_idx`` / ``cache_leftpad``: not supported). Returns out
    ``[B, S_q, H_q, D]`` (and ``lse [B, H_q, S_q]`` with ``return_softmax_lse``)."""
    left, right = _check(window_size, block_table, dict(k=k is not None, v=v is not None, rotary_cos=rotary_cos,
                                                        rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx,
                                                        cache_leftpad=cache_leftpad, softcap=softcap,
                                                        alibi_slopes=alibi_slopes))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    B, Sq = q.shape[:2]
    k_len = cache_seqlens.long().view(B)
    q_len = torch.full_like(k_len, Sq)
    Sk = block_table.shape[1] * k_cache.shape[1]
    keys, values = _paged_keys(k_cache, block_table[:B], Sk), _paged_keys(v_cache, block_table[:B], Sk)
    q_valid = torch.ones(B, Sq, dtype=torch.bool, device=q.device)
    out, lse = _attend(q, keys, values, q_valid, q_len, k_len, scale, causal, left, right)
    return (out, lse) if return_softmax_lse else out
