"""The property tests' own draws (tests/loss/strategies.py) do what their docstrings say."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mp_grpo.config import ConfigError, load_config
from tests.hypothesis_profiles import examples
from tests.loss.strategies import _direct_config, _place_on_edges, build_config, loss_configs, raw_config_overrides


@settings(max_examples=examples(10))
@given(cfg_dict=st.sampled_from(["torch", "triton"]).flatmap(loss_configs))
def test_a_drawn_config_is_built_as_load_config_builds_it(cfg_dict: dict) -> None:
    """The property tests build their drawn configs without OmegaConf (``build_config``'s direct path, ~70× faster):
    every drawn config takes that path and gives what ``load_config`` gives, field types included (its repr)."""
    direct = _direct_config(cfg_dict)
    assert direct is not None, f"a drawn config left the direct path: {cfg_dict}"
    assert repr(direct) == repr(load_config(cfg_dict))
    assert repr(build_config(cfg_dict)) == repr(direct)


@settings(max_examples=examples(10))
@given(sections=raw_config_overrides())
def test_any_config_dict_is_built_or_refused_as_load_config_does(sections: dict) -> None:
    """Valid or not (the config layer property's draws): ``build_config`` gives ``load_config``'s config, or raises
    its ConfigError with the same message."""
    try:
        want = repr(load_config(sections))
    except ConfigError as error:
        with pytest.raises(ConfigError) as refused:
            build_config(sections)
        assert str(refused.value) == str(error)
        return
    assert repr(build_config(sections)) == want


def test_the_direct_path_leaves_other_types_and_keys_to_load_config() -> None:
    """An int for a float field is stored as a float; a value of another type, an enum member's name, an unknown key
    or section is not built directly (load_config converts or refuses it)."""
    assert repr(_direct_config({"kl": {"coef": 1}})) == repr(load_config({"kl": {"coef": 1}}))
    assert type(_direct_config({"kl": {"coef": 1}}).kl.coef) is float
    for sections in ({"kl": {"coef": "0.1"}}, {"kl": {"coef": True}}, {"policy": {"objective": "PPO_CLIP"}},
                     {"policy": {"objective": "nope"}}, {"kl": {"cof": 0.1}}, {"kll": {}}, {"kl": None},
                     {"aggregation": {"count_empty_sequences": 1}}):
        assert _direct_config(sections) is None, sections


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
