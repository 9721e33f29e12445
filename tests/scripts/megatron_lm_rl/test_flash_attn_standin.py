"""The flash-attn stand-in of the Megatron-LM RL launcher against dense attention in float64, on CPU.

Requests with a random number of queries and keys (``s_k >= s_q``: a prefill after earlier context, as chunked
prefill gives; ``s_q = s_k``: a fresh prefill; ``s_q = 0``: a padding request), their keys and values written at
random blocks of a paged cache: ``flash_attn_varlen_func`` (prefill) and ``flash_attn_with_kvcache`` (decode, one
or two queries per request) must equal softmax(q·kᵀ·scale) over the keys each query may see — causal aligned to
the bottom right, a sliding window, grouped-query heads — and their log-sum-exp. A mutant aligning the causal mask
to the top left fails.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.distributed import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts" / "megatron_lm_rl" / "flash_attn_standin"))
import flash_attn  # noqa: E402

BLOCK = 4
HQ, HK, D = 4, 2, 8


def _cache(seed: int, k_lens: list[int]):
    """A paged cache holding each request's keys / values at random blocks, and the dense keys / values."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(1, max(-(-n // BLOCK) for n in k_lens))
    num_blocks = len(k_lens) * max_blocks + 3
    k_cache = torch.randn(num_blocks, BLOCK, HK, D, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, HK, D, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(k_lens), max_blocks), -1, dtype=torch.int32)
    dense_k, dense_v = [], []
    for b, n in enumerate(k_lens):
        ids = order[b * max_blocks:(b + 1) * max_blocks]
        used = -(-n // BLOCK)
        table[b, :used] = ids[:used].to(torch.int32)
        dense_k.append(k_cache[ids].reshape(-1, HK, D)[:n])
        dense_v.append(v_cache[ids].reshape(-1, HK, D)[:n])
    return k_cache, v_cache, table, dense_k, dense_v


def _dense(q, k, v, scale, causal, left):
    """float64 attention of one request: q [s_q, HQ, D], k / v [s_k, HK, D]; out and lse [HQ, s_q]."""
    s_q, s_k = q.shape[0], k.shape[0]
    k = k.double().repeat_interleave(HQ // HK, dim=1)
    v = v.double().repeat_interleave(HQ // HK, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    i, j = torch.arange(s_q).view(-1, 1), torch.arange(s_k).view(1, -1)
    keep = torch.ones(s_q, s_k, dtype=torch.bool)
    if causal:
        keep &= j <= i + s_k - s_q
    if left >= 0:
        keep &= j >= i + s_k - s_q - left
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v), torch.logsumexp(scores, -1)


@pytest.mark.parametrize("left", [-1, 3])
def test_varlen_prefill_matches_dense(left: int) -> None:
    q_lens, k_lens = [5, 3, 0, 7], [5, 9, 0, 11]
    k_cache, v_cache, table, dense_k, dense_v = _cache(1, k_lens)
    pad = 2  # query rows past the last request (the engine pads its token count)
    q = torch.randn(sum(q_lens) + pad, HQ, D, generator=torch.Generator().manual_seed(2))
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    out, lse, _ = flash_attn.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens),
                                                    softmax_scale=0.3, causal=True, window_size=(left, -1),
                                                    block_table=table, return_attn_probs=True)
    for b in range(len(q_lens)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        if q_lens[b] == 0:
            continue
        want, want_lse = _dense(q[rows], dense_k[b], dense_v[b], 0.3, True, left)
        torch.testing.assert_close(out[rows].double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[:, rows].double(), want_lse, rtol=1e-5, atol=1e-5)
    assert torch.all(out[sum(q_lens):] == 0)


@pytest.mark.parametrize("s_q", [1, 2])
def test_kvcache_decode_matches_dense(s_q: int) -> None:
    k_lens = [6, 1 + s_q, 13]
    k_cache, v_cache, table, dense_k, dense_v = _cache(3, k_lens)
    q = torch.randn(len(k_lens), s_q, HQ, D, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out, lse = flash_attn.flash_attn_with_kvcache(q, k_cache.bfloat16(), v_cache.bfloat16(),
                                                  cache_seqlens=torch.tensor(k_lens, dtype=torch.int32),
                                                  block_table=table, softmax_scale=D ** -0.5, causal=True,
                                                  return_softmax_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    for b, n in enumerate(k_lens):
        want, want_lse = _dense(q[b].float(), dense_k[b].bfloat16().float(), dense_v[b].bfloat16().float(),
                                D ** -0.5, True, -1)
        torch.testing.assert_close(out[b].double(), want, rtol=2e-2, atol=2e-2)  # bf16 output
        torch.testing.assert_close(lse[b].double(), want_lse, rtol=1e-5, atol=1e-5)


def test_top_left_causal_mutant_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The causal mask aligned to the top left (query i sees keys j <= i): the prefill check must fail."""
    real = flash_attn._attend

    def top_left(q, k, v, q_valid, q_len, k_len, *rest):
        return real(q, k, v, q_valid, q_len, q_len, *rest)

    monkeypatch.setattr(flash_attn, "_attend", top_left)
    with pytest.raises(AssertionError):
        test_varlen_prefill_matches_dense(-1)


def test_refuses_what_it_does_not_implement() -> None:
    q = torch.zeros(2, 1, HQ, D)
    with pytest.raises(NotImplementedError, match="block_table"):
        flash_attn.flash_attn_with_kvcache(q, q, q, cache_seqlens=torch.ones(2, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="rotary_cos"):
        flash_attn.flash_attn_with_kvcache(q, q, q, rotary_cos=torch.ones(1), cache_seqlens=torch.ones(2),
                                           block_table=torch.zeros(2, 1, dtype=torch.int32))
    assert flash_attn.__version__.startswith("2.7.3+") and flash_attn.IS_STAND_IN
