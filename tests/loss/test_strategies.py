"""The property tests' own draws (tests/loss/strategies.py) do what their docstrings say."""

from __future__ import annotations

import torch

from tests.loss.strategies import _place_on_edges, build_config


def test_edges_are_a_hair_off_each_bound_never_on_it() -> None:
    """``_place_on_edges`` moves ratios to a bound × (1 ± 1e-9). Its ±1e-9 was made in torch's default float32,
    where 1 ± 1e-9 is 1: the ratios sat exactly on the bounds — knife edges whose side two correct implementations
    may take differently (an ulp of exp, of a sum's order), which failed the float64 properties on GPUs."""
    cfg = build_config({"policy": {"eps_low": 0.2, "eps_high": 0.28},
                        "rollout_correction": {"reject_level": "token", "reject_max": 7.831}})
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(64, 16, generator=gen, dtype=torch.float64) - 0.05
    mask = torch.ones(64, 16, dtype=torch.bool)
    old, rollout = _place_on_edges(cfg, gen, lp, lp + 0.3, lp + 0.3 - 0.7, mask)
    ratios = {"old": (torch.exp(lp - old), [0.8, 1.28]), "rollout": (torch.exp(old - rollout), [7.831])}
    for name, (ratio, bounds) in ratios.items():
        placed = 0
        for bound in bounds:
            off = (ratio / bound - 1.0).abs()
            near = off < 1e-6
            placed += int(near.sum())
            assert bool((off[near] > 0.5e-9).all() & (off[near] < 2e-9).all()), f"{name}: {off[near].tolist()}"
        assert placed > 0, f"no {name} ratio was placed on an edge"


def test_a_ratio_within_rounding_of_a_bound_is_a_knife_edge() -> None:
    """eps_low = 0 puts PPO's lower clip at ratio 1: bf16 log-probs and fp16 old log-probs of the same −1e-6 differ
    by ~1e-8, a ratio of exactly 1 in the loss's float32 (not clipped) and 0.99999999 in the float64 reference
    (clipped): 102 of 1423 tokens of a GPU-sized draw did (clip_frac/low 0.141 vs 0.190). Such draws are rejected;
    a ratio of exactly 1 (old = log π) and one clearly inside the range are not."""
    from tests.loss.properties import _ratio_at_a_bound
    from tests.loss.strategies import Step

    cfg = build_config({"policy": {"eps_low": 0.0}})
    lp = torch.full((1, 3), -1.0e-6, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)

    def step(old: torch.Tensor) -> Step:
        return Step(cfg, {"logprobs": lp.to(torch.bfloat16), "old_logprobs": old, "loss_mask": mask,
                          "advantages": torch.tensor([-1.0])}, False, None, None, 1.0)

    assert _ratio_at_a_bound(step(lp.to(torch.float16)))
    assert not _ratio_at_a_bound(step(lp.to(torch.bfloat16)))  # lp = old: ratio 1 in both
    assert not _ratio_at_a_bound(step(lp.to(torch.bfloat16) + 0.01))  # ratio 0.99: clipped in both


def test_a_top_entropy_selection_within_float32_rounding_is_a_knife_edge() -> None:
    """Near-deterministic rows (two logits 110 and 130 apart at scale 1) have float64 entropies of ~1e-46 and
    ~1e-55, both 0 in float32: which one the 50 % top-entropy selection keeps is float32's tie. Rows of clearly
    different entropies are no knife edge."""
    from tests.loss.properties import _entropy_selection_at_its_threshold
    from tests.reference import logprobs_reference

    cfg = build_config({"entropy": {"top_quantile": 0.5}})
    mask = torch.ones(1, 2, dtype=torch.bool)
    for gaps, edge in (((110.0, 130.0), True), ((0.5, 3.0), False)):
        logits = torch.tensor([[[0.0, -gaps[0]], [0.0, -gaps[1]]]], dtype=torch.float64)
        _, entropy = logprobs_reference(logits, torch.zeros(1, 2, dtype=torch.int64), temperature=1.0)
        assert _entropy_selection_at_its_threshold(cfg, logits, entropy, mask, 1.0) == edge, gaps
