"""accumulates_into_main_grad (mp_grpo/megatron/main_grad.py): when the output paths write the output weight's
gradient into Megatron DDP's ``main_grad`` themselves.

The decision on every combination of what it reads: gradients on or off, the weight frozen, the layer's
gradient-accumulation fusion, DDP's ``main_grad`` and ``grad_added_to_main_grad``, the layer's own weight or one
passed to it (tied embeddings) with or without ``zero_out_wgrad``. The paths' gradients under each decision are
compared with the model's own layer in ``test_logits_output.py`` and ``test_fused_output.py``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mp_grpo.megatron.main_grad import accumulates_into_main_grad


def _layer(fusion: bool) -> torch.nn.Module:
    layer = torch.nn.Linear(4, 6, bias=False)
    layer.gradient_accumulation_fusion = fusion
    return layer


def _under_ddp(weight: torch.Tensor, *, flag: bool = True) -> torch.Tensor:
    weight.main_grad = torch.zeros(weight.shape)
    if flag:
        weight.grad_added_to_main_grad = False
    return weight


@pytest.mark.parametrize("fusion,ddp,tied,zero_out", list(itertools.product((False, True), repeat=4)))
def test_the_decision(fusion: bool, ddp: bool, tied: bool, zero_out: bool) -> None:
    layer = _layer(fusion)
    weight = torch.nn.Parameter(torch.randn(6, 4)) if tied else layer.weight
    if ddp:
        _under_ddp(weight)
    if zero_out:
        weight.zero_out_wgrad = True
    expected = fusion or (ddp and (not tied or zero_out))
    assert accumulates_into_main_grad(layer, weight) == expected


def test_no_gradient_made_no_accumulation() -> None:
    layer = _layer(True)
    _under_ddp(layer.weight)
    with torch.no_grad():
        assert not accumulates_into_main_grad(layer, layer.weight)
    layer.weight.requires_grad_(False)
    assert not accumulates_into_main_grad(layer, layer.weight)


def test_main_grad_without_ddp_flag_is_not_ddp() -> None:
    """A ``main_grad`` without DDP's flag: DDP's hook would not know the gradient is there already."""
    layer = _layer(False)
    _under_ddp(layer.weight, flag=False)
    assert not accumulates_into_main_grad(layer, layer.weight)
    layer.weight.main_grad = None
    layer.weight.grad_added_to_main_grad = False
    assert not accumulates_into_main_grad(layer, layer.weight)
