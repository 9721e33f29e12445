"""The command line of one run of Megatron-LM's ``train_rl.py`` loop under the launcher, and its environment config.

One tiny GPT (2 layers, hidden 256, 4 heads, RoPE, Transformer Engine's layer spec), random init, the
NullTokenizer (``VOCAB`` ids; ``EOD`` ends a document, ``PAD`` pads), the successor-counting agent
(``mlm_agent``) on prompts of 2–6 ids from ``[0, MODULUS)``, rollouts of ``INFERENCE_SEQ`` tokens, training rows /
packing bins of ``SEQ`` tokens. GRPO: ``PROMPTS`` prompts × ``GROUP`` samples a step, one optimizer step per
rollout batch, clip 0.2 / 0.28, no KL, no entropy term, ``--calculate-per-token-loss`` (the normalization mp_grpo
reproduces exactly, docs/integrations.md). The three runs differ only in :class:`RunSpec`'s fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

VOCAB = 32
"""The NullTokenizer's ids (and the padded vocabulary: ``--make-vocab-size-divisible-by VOCAB``)."""
EOD = VOCAB - 1
"""The NullTokenizer's end-of-document id (its default, ``vocab_size − 1``)."""
PAD = VOCAB - 2
"""``--null-tokenizer-pad-id``: Megatron-LM's RL code pads rows with it (the NullTokenizer's default −1 is no id)."""
MODULUS = 16
"""Prompt ids and the counting's modulus: below PAD and EOD."""
SEQ = 64
"""``--seq-length``: a training row, or a packing bin (2–3 rollouts)."""
INFERENCE_SEQ = 24
"""``--inference-max-seq-length``: prompt + completion of a rollout (the engine stops generating there)."""
PROMPTS, GROUP = 16, 8
"""``--grpo-prompts-per-step``, ``--grpo-group-size``: 128 rollouts a step (the global batch)."""
KV_CACHE_GB = 1.0
"""``--inference-dynamic-batching-buffer-size-gb``: Megatron-LM's default, 40, is for real models."""


class ForwardStep(str, Enum):
    """Which ``forward_step`` ``pretrain`` receives."""

    MP_GRPO = "mp_grpo"
    """``GRPOForwardStep.from_args(args)`` (with the first step's loss-parity check, ``mlm_parity``)."""
    MEGATRON_LM = "megatron_lm"
    """``train_rl.py``'s own ``forward_step``."""


@dataclass(frozen=True)
class RunSpec:
    """One run of the launcher."""

    forward_step: ForwardStep = ForwardStep.MP_GRPO
    """The forward step (``--forward-step``)."""
    packing: bool = False
    """``--rl-use-sequence-packing``."""
    logit_dtype: str = "fp32"
    """``--output-logit-dtype`` (``fp32`` | ``bf16``)."""
    train_iters: int = 20
    """``--train-iters``: GRPO steps."""
    lr: float = 3e-4
    """``--lr`` (Adam, constant)."""
    seed: int = 1234
    """``--seed`` (the model's init and the agent's prompts)."""

    @property
    def name(self) -> str:
        return f"{self.forward_step.value}_{'packed' if self.packing else 'unpacked'}_{self.logit_dtype}"


RUNS = (RunSpec(ForwardStep.MP_GRPO, packing=False), RunSpec(ForwardStep.MP_GRPO, packing=True),
        RunSpec(ForwardStep.MEGATRON_LM, packing=False))
"""The runs the issue asks for: mp_grpo with packing off, then on; Megatron-LM's own forward step, packing off."""


def build_argv(spec: RunSpec, env_config: Path) -> list[str]:
    """``train_rl.py``'s arguments for ``spec`` (module docstring), without the program name."""
    if spec.logit_dtype not in ("fp32", "bf16"):
        raise ValueError(f"logit_dtype must be fp32 or bf16, got {spec.logit_dtype!r}")
    if spec.train_iters < 1:
        raise ValueError(f"train_iters must be >= 1, got {spec.train_iters}")
    model = ["--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "1024", "--num-attention-heads", "4",
             "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--position-embedding-type", "rope",
             "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--attention-dropout", "0.0",
             "--hidden-dropout", "0.0", "--transformer-impl", "transformer_engine", "--bf16",
             "--output-logit-dtype", spec.logit_dtype]
    tokenizer = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by",
                 str(VOCAB), "--null-tokenizer-pad-id", str(PAD)]
    training = ["--micro-batch-size", "1", "--global-batch-size", str(PROMPTS * GROUP), "--train-iters",
                str(spec.train_iters), "--lr", str(spec.lr), "--lr-decay-style", "constant", "--min-lr", str(spec.lr),
                "--weight-decay", "0.0", "--clip-grad", "1.0", "--seed", str(spec.seed), "--calculate-per-token-loss",
                "--no-gradient-accumulation-fusion", "--log-interval", "1", "--eval-iters", "0", "--eval-interval",
                str(10 * spec.train_iters), "--distributed-timeout-minutes", "20"]
    rl = ["--perform-rl-step", "--langrl-env-config", str(env_config), "--grpo-prompts-per-step", str(PROMPTS),
          "--grpo-group-size", str(GROUP), "--grpo-iterations", "1", "--grpo-clamp-eps-lower", "0.2",
          "--grpo-clamp-eps-upper", "0.28", "--grpo-kl-beta", "0.0", "--grpo-entropy-term-weight", "0.0",
          "--rl-default-temperature", "1.0", "--inference-max-seq-length", str(INFERENCE_SEQ),
          "--inference-dynamic-batching-buffer-size-gb", str(KV_CACHE_GB), "--cuda-graph-impl", "none"]
    if spec.packing:
        rl.append("--rl-use-sequence-packing")
    return model + tokenizer + training + rl


def env_config_yaml(seed: int) -> str:
    """The environment config (``--langrl-env-config``): the successor-counting agent alone."""
    from mlm_agent import AGENT_NAME

    return (f"- agent_type: {AGENT_NAME}\n  weight: 1.0\n  agent_args:\n    modulus: {MODULUS}\n"
            f"    min_prompt_tokens: 2\n    max_prompt_tokens: 6\n    sequence_length: {INFERENCE_SEQ}\n"
            f"    eod: {EOD}\n    seed: {seed}\n")
