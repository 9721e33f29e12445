"""The CPU stand-in's options the learning job uses (mp_grpo/train/cpu_model.py): bf16 parameters, the logit-offset
channel that puts its logits at an LLM's scale."""

from __future__ import annotations

import pytest
import torch

from mp_grpo.train.cpu_model import CpuGPTStandIn, cpu_model_config, random_full_weights

VOCAB, HIDDEN, MAX_LEN, OFFSET = 32, 16, 8, 16.0


@pytest.fixture(scope="module", autouse=True)
def solo_world(tmp_path_factory):
    """A gloo world of one (megatron-core's layers want a TP group object), torn down after the module."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(dtype: torch.dtype, offset: float) -> CpuGPTStandIn:
    import torch.distributed as dist

    config = cpu_model_config(hidden_size=HIDDEN, params_dtype=dtype)
    m = CpuGPTStandIn(config, vocab_size=VOCAB, max_sequence_length=MAX_LEN, tp_group=dist.group.WORLD,
                      logit_offset_channel=offset != 0.0)
    m.load_full_weights(random_full_weights(config, vocab_size=VOCAB, max_sequence_length=MAX_LEN, seed=3, logit_offset=offset))
    return m


def _logits(m: CpuGPTStandIn) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (4, MAX_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return m(ids, torch.arange(MAX_LEN).expand(4, MAX_LEN))


def test_logit_offset_shifts_every_logit_and_leaves_the_softmax() -> None:
    plain, shifted = _logits(_model(torch.float32, 0.0)), _logits(_model(torch.float32, OFFSET))
    torch.testing.assert_close(shifted, plain + OFFSET, rtol=0, atol=4e-6)  # fp32 rounding at 16
    torch.testing.assert_close(torch.log_softmax(shifted, -1), torch.log_softmax(plain, -1), rtol=0, atol=1e-5)
    assert float(plain.max(-1).values.mean()) < 5.0 < 15.0 < float(shifted.max(-1).values.mean()) < 30.0


def test_bf16_parameters_and_logits() -> None:
    m = _model(torch.bfloat16, OFFSET)
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    assert m.output_layer.weight.shape == (VOCAB, HIDDEN + 1)
    bf16, fp32 = _logits(m), _logits(_model(torch.float32, OFFSET))
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), fp32, rtol=0, atol=0.5)  # bf16 weights and activations, logits ~18


def test_weights_must_match_the_channel() -> None:
    import torch.distributed as dist

    config = cpu_model_config(hidden_size=HIDDEN)
    m = CpuGPTStandIn(config, vocab_size=VOCAB, max_sequence_length=MAX_LEN, tp_group=dist.group.WORLD, logit_offset_channel=True)
    with pytest.raises(ValueError, match="output_layer.weight"):
        m.load_full_weights(random_full_weights(config, vocab_size=VOCAB, max_sequence_length=MAX_LEN, seed=3))
    with pytest.raises(ValueError, match="logit_offset_channel"):
        CpuGPTStandIn(config, vocab_size=VOCAB, max_sequence_length=MAX_LEN, tp_group=dist.group.WORLD,
                      logit_offset_channel=True, share_embeddings_and_output_weights=True)
