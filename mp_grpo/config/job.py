"""Typed schema of the main job (``python -m mp_grpo.train``, ``scripts/grpo_step.py``): model, parallel layout, training, rollouts, loss.

One dataclass per section, loaded through :func:`mp_grpo.config.load_config` (``OmegaConf.structured``),
so an unknown key, a wrong type or a bad enum value fails at load time; each section checks its
values in ``__post_init__``. :func:`load_job_config` adds the loss preset: ``loss_preset`` names a
preset of ``mp_grpo/presets`` whose keys are the base of the ``loss`` section, and the keys written in
the job's own ``loss`` section override them.

The data-parallel size is not a key: it is the world size divided by TP·CP, checked when the job starts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from mp_grpo.config.loading import load_config, preset_path
from mp_grpo.config.loss import ConfigError, LossConfig
from mp_grpo.config.precision import LogitDtype


class SequenceFormat(str, Enum):
    """How a micro-batch's sequences are laid out (``parallel.sequence_format``)."""

    PADDED = "padded"
    """``[B, S]`` rows padded to a common length (Megatron's ``sbhd``)."""
    PACKED = "packed"
    """One ``[1, T]`` row of end-to-end segments described by ``cu_seqlens`` (Megatron's ``thd``)."""


class ParamsDtype(str, Enum):
    """Parameter dtype of the trainer's model (``model.params_dtype``): GPTModel on GPUs, the CPU stand-in on CPU."""

    FP32 = "fp32"
    """float32 parameters and activations."""
    BF16 = "bf16"
    """bfloat16 through Megatron's ``Float16Module`` (fp32 gradients in the DDP buffers, fp32 main parameters in the
    optimizer); on CPU the stand-in in bfloat16 with the same gradient and optimizer contract
    (:mod:`mp_grpo.train.cpu_optimizer`)."""


class OutputPath(str, Enum):
    """How the loss reads the policy's output layer (``model.output_path``; :class:`mp_grpo.megatron.MegatronGRPO`).

    Both give the same log-probs and the same parameter gradients; they trade time for memory. Measured
    on one H100 at N = 16384 tokens, H = 4096, V = 151936, bf16 (``docs/benchmarks/fused.md``): forward +
    backward of the output layer and the GRPO loss takes 1.04x the bare output-layer matmuls on the logits
    path, and on the fused path 1.04x for token-level objectives (the loss's gradient made in forward) and
    1.34x for sequence-level ones such as GSPO (the logits recomputed in backward); the logits path holds the
    ``[tokens, V_local]`` logits (4.6 GiB there), the fused path 0.69–0.72 GiB beyond its inputs. MegatronGRPO
    writes the logits' gradient into them. In a whole training step of a Qwen2.5-1.5B-shaped GPTModel on one
    H100 both paths take ≤ 1.01x the time of the decoder without an output layer plus the bare output
    matmuls (``docs/benchmarks/step_local.md``, megatron-core's local layer spec).
    """

    LOGITS = "logits"
    """GPTModel computes its vocab-parallel logits; :func:`mp_grpo.vocab_parallel_logprobs` reads them.
    The default: the faster path, for as long as the logits fit in memory."""
    FUSED = "fused"
    """GPTModel's output layer is skipped; :func:`mp_grpo.fused_linear_logprobs` takes its (TP-gathered)
    input and weight and computes the log-probs chunk by chunk, never holding the logits. For long
    sequences or large vocabularies, where the logits path runs out of memory."""


class OutputRows(str, Enum):
    """Which rows of a micro-batch the output layer computes (``model.output_rows``; :class:`mp_grpo.megatron.MegatronGRPO`).

    A position outside the loss mask (a prompt, a tool output, padding: target ``ignore_index``) gets log-prob 0 and
    no gradient either way; ``LOSS`` skips its work. The loss, the metrics, the log-probs at the loss tokens and the
    parameter gradients are the same (to the GEMMs' rounding); what differs is the output at positions outside the
    loss mask: with ``LOSS`` their entropy (and, from the forward-only pass, their log-prob, 0 either way) is 0.
    """

    LOSS = "loss"
    """The default: the output layer's GEMMs, the log-prob statistics and the backward run on the rows whose target
    is trained on (the micro-batch's ``loss_rows``, made from its loss mask at data preparation); the hidden-state
    gradient of every other row is 0. Time and memory of the output layer scale with the loss tokens."""
    ALL = "all"
    """Every row, as a plain output layer: the entropy of every position (e.g. for a statistic over prompts)."""


MIN_GROUP_SIZE = 2
"""Fewest completions per prompt: a group's advantages are its rewards minus their mean, all 0 for a group of one."""


def _positive(key: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}: got {value!r}; allowed: an integer ≥ 1")


def _fraction(key: str, value: float, *, closed_high: bool) -> None:
    ok = 0.0 <= value <= 1.0 if closed_high else 0.0 <= value < 1.0
    if not ok:
        raise ConfigError(f"{key}: got {value}; allowed: a float with 0 ≤ x {'≤' if closed_high else '<'} 1")


@dataclass
class ModelConfig:
    """``model``: a small GPTModel (megatron-core's local layer spec) — or the CPU stand-in on a CPU machine."""

    vocab_size: int = 1024
    """Vocabulary size, already padded: a multiple of the TP size (each rank holds vocab_size / TP ids)."""
    hidden_size: int = 128
    """Hidden size H."""
    num_layers: int = 2
    """Transformer layers (GPTModel only; the CPU stand-in has one residual block)."""
    num_attention_heads: int = 4
    """Attention heads (GPTModel only); a multiple of the TP size."""
    max_sequence_length: int = 128
    """Longest sequence the position embeddings cover (prompt + completion + padding)."""
    params_dtype: ParamsDtype = ParamsDtype.BF16
    """fp32 | bf16 parameters and activations of the trainer's model (:class:`ParamsDtype`); bf16 keeps fp32 gradients
    and fp32 main parameters in the optimizer."""
    init_seed: int = 1234
    """Seed of the initial weights (the same on every rank: every TP layout starts from the same model)."""
    output_path: OutputPath = OutputPath.LOGITS
    """logits | fused: how the loss reads the output layer (:class:`OutputPath`; same gradients, fused
    never holds the ``[tokens, V_local]`` logits, at the same speed for token-level objectives)."""
    output_rows: OutputRows = OutputRows.LOSS
    """loss | all: the output layer on the rows that carry loss only, or on every row (:class:`OutputRows`; the same
    loss, metrics and gradients — ``loss`` skips the prompt rows' work)."""
    logit_dtype: LogitDtype = LogitDtype.BF16
    """bf16 | fp32: the precision of the trainer's logits (:class:`~mp_grpo.config.precision.LogitDtype`, Megatron-LM's
    ``--output-logit-dtype``), on both output paths, in the training step and in the forward-only passes (old and
    reference log-probs): bf16 = the output layer's own dtype (rounded to bf16 under ``params_dtype = bf16``; an
    fp32 model's logits are fp32 either way); fp32 = the same bf16 operands' products summed and kept in fp32. Its
    pairing with the rollout engine's head (``engine.logit_dtype``) is measured in ``docs/mismatch.md`` (g)."""
    cpu_logit_offset: float = 0.0
    """CPU stand-in only (must be 0 with GPTModel): the output layer reads one more input channel, a constant 1,
    whose weights start at this value — every initial logit shifted by it, the softmax unchanged, the shift then
    trained as a per-token bias. The stand-in's logits are otherwise a few units, a trained LLM's 15–30: with an
    offset of ~16 their bf16 rounding is at an LLM's scale (what ``docs/mismatch.md`` (g) measures). 0 = no
    extra channel."""

    def __post_init__(self) -> None:
        for key in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "max_sequence_length"):
            _positive(f"model.{key}", getattr(self, key))
        if isinstance(self.cpu_logit_offset, bool) or not math.isfinite(self.cpu_logit_offset):
            raise ConfigError(f"model.cpu_logit_offset: got {self.cpu_logit_offset!r}; allowed: a finite float (0 = off)")


@dataclass
class ParallelConfig:
    """``parallel``: the Megatron layout. DP = world size / (TP · CP)."""

    tensor_model_parallel_size: int = 1
    """TP: ranks the vocabulary (and every layer) is sharded over."""
    context_parallel_size: int = 1
    """CP: ranks every sequence is split over (2·CP chunks, rank r holds chunks r and 2·CP−1−r)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (GPU only; needs TP > 1)."""
    sequence_format: SequenceFormat = SequenceFormat.PADDED
    """padded | packed micro-batches."""
    calculate_per_token_loss: bool = False
    """Megatron's ``calculate_per_token_loss``: the loss function returns (loss, num_tokens, metrics)."""
    average_in_collective: bool = False
    """Megatron DDP's ``average_in_collective`` (must be false with calculate_per_token_loss)."""

    def __post_init__(self) -> None:
        _positive("parallel.tensor_model_parallel_size", self.tensor_model_parallel_size)
        _positive("parallel.context_parallel_size", self.context_parallel_size)
        if self.calculate_per_token_loss and self.average_in_collective:
            raise ConfigError(
                "parallel.average_in_collective: Megatron DDP cannot average in the collective with "
                "calculate_per_token_loss; allowed: false with calculate_per_token_loss = true"
            )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError("parallel.sequence_parallel: needs tensor_model_parallel_size > 1; allowed: false with TP = 1")


@dataclass
class TrainConfig:
    """``train``: optimizer steps and their micro-batches."""

    steps: int = 4
    """Optimizer steps."""
    num_microbatches: int = 2
    """Micro-batches per DP rank per optimizer step (M of ``forward_backward_func``)."""
    micro_batch_size: int = 4
    """Sequences per micro-batch. Global batch = DP · M · micro_batch_size sequences."""
    updates_per_rollout: int = 2
    """Optimizer steps on each rollout batch: the first is on-policy, later ones see ratios ≠ 1."""
    lr: float = 1e-3
    """Adam learning rate."""
    clip_grad: float = 1.0
    """Gradient-norm clipping threshold (Megatron's ``clip_grad``)."""
    seed: int = 0
    """Seed of the synthetic rollouts (the same on every rank)."""

    def __post_init__(self) -> None:
        for key in ("steps", "num_microbatches", "micro_batch_size", "updates_per_rollout"):
            _positive(f"train.{key}", getattr(self, key))
        for key in ("lr", "clip_grad"):
            if not getattr(self, key) > 0.0:
                raise ConfigError(f"train.{key}: got {getattr(self, key)}; allowed: a float > 0")


@dataclass
class RolloutConfig:
    """``rollout``: the synthetic rollout engine (random prompts and completions, synthetic rewards)."""

    group_size: int = 4
    """Completions per prompt (≥ 2); advantages are normalized within each group, so a group of one has advantage
    0 and nothing is learned. Divides the global batch."""
    prompt_min_length: int = 4
    """Shortest prompt (tokens)."""
    prompt_max_length: int = 16
    """Longest prompt (tokens)."""
    completion_min_length: int = 1
    """Shortest completion (tokens)."""
    completion_max_length: int = 48
    """Longest completion (tokens)."""
    temperature: float = 1.0
    """Sampling temperature of the rollout engine; the trainer's log-probs use the same (logits / T)."""
    mismatch_std: float = 0.05
    """Train–inference mismatch: the rollout engine's log-probs are the trainer's plus N(0, mismatch_std²)
    noise per token (in nats); 0 makes them equal."""
    tool_mask_fraction: float = 0.0
    """Fraction of each completion inside one tool-output span (excluded from the loss mask); 0 = no tools."""

    def __post_init__(self) -> None:
        for key in ("prompt_min_length", "prompt_max_length", "completion_min_length", "completion_max_length"):
            _positive(f"rollout.{key}", getattr(self, key))
        if not isinstance(self.group_size, int) or self.group_size < MIN_GROUP_SIZE:
            raise ConfigError(f"rollout.group_size: got {self.group_size!r}; allowed: an integer ≥ {MIN_GROUP_SIZE} (advantages "
                              "are normalized within a group: with one completion per prompt every advantage is 0 and nothing is learned)")
        if self.prompt_min_length > self.prompt_max_length:
            raise ConfigError(f"rollout.prompt_min_length: {self.prompt_min_length} exceeds prompt_max_length "
                              f"{self.prompt_max_length}; allowed: prompt_min_length ≤ prompt_max_length")
        if self.completion_min_length > self.completion_max_length:
            raise ConfigError(f"rollout.completion_min_length: {self.completion_min_length} exceeds completion_max_length "
                              f"{self.completion_max_length}; allowed: completion_min_length ≤ completion_max_length")
        if not self.temperature > 0.0:
            raise ConfigError(f"rollout.temperature: got {self.temperature}; allowed: a float > 0")
        if not self.mismatch_std >= 0.0:
            raise ConfigError(f"rollout.mismatch_std: got {self.mismatch_std}; allowed: a float ≥ 0")
        _fraction("rollout.tool_mask_fraction", self.tool_mask_fraction, closed_high=False)


class EngineDtype(str, Enum):
    """Weight and activation dtype of the rollout engine's copy of the policy (``engine.dtype``)."""

    BF16 = "bf16"
    """bfloat16 weights and activations, as vLLM / SGLang (a different numerics path from an fp32 trainer)."""
    FP32 = "fp32"
    """float32: the trainer's numerics (rollout and trainer log-probs agree to reduction order)."""


@dataclass
class EngineConfig:
    """``engine``: the rollout engine of the learning job (:mod:`mp_grpo.train.rollout`) and its mismatch knobs.

    With the trainer's dtype (``dtype`` = ``model.params_dtype``), the trainer's logit precision (``logit_dtype`` =
    ``model.logit_dtype``) and every knob at 0, its log-probs equal the trainer's to fp32 reduction order.
    """

    dtype: EngineDtype = EngineDtype.BF16
    """bf16 | fp32: the engine's copy of the weights and its activations (the trainer's: ``model.params_dtype``)."""
    logit_noise_std: float = 0.0
    """Mismatch knob: N(0, std²) noise added to the engine's logits before sampling (keyed like the sampler's,
    so layout-invariant); its log-probs are those of the noisy logits. It enters the head's fp32 sums, before
    they are rounded to the head's dtype (``logit_dtype``): a difference upstream of the head, as the engine's
    other kernels, batch composition or quantization make one."""
    weight_lag: int = 0
    """Mismatch knob: the engine samples with the trainer's weights of ``weight_lag`` optimizer steps ago
    (off-policy staleness, as asynchronous RL)."""
    top_k: int = 0
    """Top-k sampling, as vLLM: the engine samples from the renormalized distribution over the tokens whose logit
    is ≥ the k-th largest (ties at the k-th value kept), before top-p (vLLM's order: top-k, then top-p on what
    is left). An integer ≥ 0; 0 = off (vLLM's ``top_k = 0 / -1``); k ≥ the vocabulary keeps every token."""
    top_p: float = 1.0
    """Nucleus sampling, as vLLM: the engine samples from the renormalized distribution over the tokens whose
    strictly-larger probability mass is < top_p (ties at the threshold kept; vLLM's convention,
    :mod:`mp_grpo.ops.sampling_filter`) and reports log-probs of that filtered distribution. In (0, 1]; 1 = off.
    Found vocab-parallel, without gathering the logits (:func:`mp_grpo.train.sampler.sampling_filter_keep`)."""
    logit_dtype: LogitDtype = LogitDtype.BF16
    """bf16 | fp32: the precision of the engine's head, as vLLM's ``head_dtype`` / sglang's ``--enable-fp32-lm-head``
    (:class:`~mp_grpo.config.precision.LogitDtype`). The engine computes its logits from its own weights (``dtype``):
    the output layer's products summed in fp32, plus ``logit_noise_std``'s noise, then bf16 = rounded to the
    engine's dtype (a bf16 engine's default head), fp32 = kept in fp32 (the head's bf16 operands upcast and
    multiplied in fp32, as vLLM and sglang do). An fp32 engine's logits are fp32 either way. Its pairing with the
    trainer's ``model.logit_dtype`` is measured in ``docs/mismatch.md`` (g)."""
    replay_filter: bool = True
    """The trainer replays ``top_k`` / ``top_p`` (:meth:`~mp_grpo.megatron.MicroBatch.with_sampling_filter`) in
    the old-log-prob pass and the training pass: its log-probs are those of the filtered, renormalized
    distribution the engine sampled from, as the engine reports them. false: full-vocabulary log-probs — every
    token ratio trainer / engine is then the kept mass of its position (< 1), a systematic mismatch
    (``docs/mismatch.md``). Reference log-probs (the KL term) are always of the full vocabulary.

    **Boundary tokens.** A bf16 engine and an fp32 trainer put the filter's threshold at slightly different
    logits, so the engine can sample a token that the trainer's replayed filter drops (its log-prob there is
    −inf: the trainer's filtered policy gives it probability 0). Rule: a sampled token outside the trainer's
    filter in the old-log-prob pass is taken out of the loss mask — it enters no term, no denominator and no
    metric of the step, as a token the trainer does not train on (its importance weight against the trainer's
    filtered old policy is 0) — and counted: ``outside_filter`` in each step's record is the fraction of the
    rollout's sampled tokens so dropped. A later update on the same rollout batch (``train.updates_per_rollout``
    > 1) whose filter drops a token that the old pass kept gives that token probability 0 under the current
    policy: the loss drops the position (no term, no gradient: its non-finite guard, ``docs/loss.md``), it stays
    in the step's denominators (counted before the forward), and the metrics ``sampling_filter/outside_tokens``
    and ``nonfinite_inputs`` count it. The ops therefore run unchecked while replaying; any other non-finite
    input stops the step (:func:`mp_grpo.train.loop.check_replayed_step`)."""

    topk_logprobs: int = 0
    """K: the engine also returns, for every sampled token, the K most probable ids of the distribution it sampled
    from and its log-probs at them (vLLM's ``SamplingParams(logprobs=K)``; with ``top_k`` / ``top_p`` the filtered
    distribution, as its sampled log-prob), and the loop hands them to the loss
    (:meth:`~mp_grpo.megatron.MicroBatch.with_rollout_top_k`): the input of ``loss.trust_region.mode`` topk_tv /
    topk_kl, which need K ≥ 1 (DPPO and TRL: 20); 0 = off, required with every other mode. An integer ≤
    ``model.vocab_size``."""

    def __post_init__(self) -> None:
        if isinstance(self.topk_logprobs, bool) or not isinstance(self.topk_logprobs, int) or self.topk_logprobs < 0:
            raise ConfigError(f"engine.topk_logprobs: got {self.topk_logprobs!r}; allowed: an integer ≥ 0 (0 = off)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"engine.top_p: got {self.top_p!r}; allowed: a float in (0, 1] (1 = off)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"engine.top_k: got {self.top_k!r}; allowed: an integer ≥ 0 (0 = off)")
        if not self.logit_noise_std >= 0.0:
            raise ConfigError(f"engine.logit_noise_std: got {self.logit_noise_std}; allowed: a float ≥ 0")
        if not isinstance(self.weight_lag, int) or self.weight_lag < 0:
            raise ConfigError(f"engine.weight_lag: got {self.weight_lag!r}; allowed: an integer ≥ 0")


@dataclass
class TaskConfig:
    """``task``: the verifiable task of the learning job (:mod:`mp_grpo.train.task`).

    Successor counting: the prompt is random tokens; a correct completion continues it with
    ``last + 1, last + 2, …`` (mod ``modulus``). Reward = fraction of completion tokens equal to the
    previous token + 1 (mod ``modulus``) — an exact checker with partial credit.
    """

    completion_length: int = 8
    """Tokens the engine samples per completion (no end-of-sequence token: every completion has this length)."""
    modulus: int | None = None
    """Counting is modulo this (prompt tokens are drawn from [0, modulus)); None = the vocabulary size."""

    def __post_init__(self) -> None:
        _positive("task.completion_length", self.completion_length)
        if self.modulus is not None:
            _positive("task.modulus", self.modulus)


@dataclass
class OutputConfig:
    """``output``: what the job writes, and where (:mod:`mp_grpo.train.outputs`)."""

    dir: str | None = None
    """Run directory of ``log.json`` and ``curves.png`` (rank 0). None = ``out/<config name>-seed<seed>-<digest>``,
    the digest a hash of every other key: runs of different configs never share a directory."""
    overwrite: bool = False
    """Allow ``dir`` to replace the files of a run of another config (those of the same config are always replaced)."""
    progress_bar: bool = True
    """Show a tqdm progress bar on rank 0."""
    plot: bool = True
    """Write ``curves.png``: reward, loss, grad norm, vllm-kl and IS statistics per step."""


@dataclass
class JobConfig:
    """The main job: one field per section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Megatron layout."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimizer steps and micro-batches."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout batch shape: group size, prompt lengths, sampling temperature (the noise-reward fields
    ``mismatch_std``, ``tool_mask_fraction``, completion lengths are used by :mod:`mp_grpo.train.synthetic` only)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The rollout engine and its mismatch knobs."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The verifiable task."""
    loss_preset: str | None = None
    """Name of a loss preset in ``mp_grpo/presets`` (e.g. ``mismatch_safe``) used as the base of ``loss``."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The loss; keys written here override the preset's."""
    output: OutputConfig = field(default_factory=OutputConfig)
    """Logs."""

    def __post_init__(self) -> None:
        tp = self.parallel.tensor_model_parallel_size
        if self.model.vocab_size % tp:
            raise ConfigError(f"model.vocab_size: {self.model.vocab_size} is not a multiple of "
                              f"parallel.tensor_model_parallel_size {tp}; allowed: a multiple of {tp} (pad the vocabulary)")
        if self.model.num_attention_heads % tp:
            raise ConfigError(f"model.num_attention_heads: {self.model.num_attention_heads} is not a multiple of "
                              f"parallel.tensor_model_parallel_size {tp}; allowed: a multiple of {tp}")
        longest = self.rollout.prompt_max_length + self.task.completion_length
        if longest > self.model.max_sequence_length:
            raise ConfigError(f"model.max_sequence_length: {self.model.max_sequence_length} is shorter than the longest "
                              f"rollout (rollout.prompt_max_length + task.completion_length = {longest}); allowed: ≥ {longest}")
        k = self.engine.topk_logprobs
        if k > self.model.vocab_size:
            raise ConfigError(f"engine.topk_logprobs: {k} exceeds model.vocab_size {self.model.vocab_size}; allowed: "
                              "an integer ≤ the vocabulary size")
        mode = self.loss.trust_region.mode.value
        if self.loss.needs_topk_logprobs and k == 0:
            raise ConfigError(f"engine.topk_logprobs: 0, but loss.trust_region.mode={mode} takes its divergence over "
                              "the engine's top-K log-probs; allowed: an integer K ≥ 1 (DPPO: 20)")
        if not self.loss.needs_topk_logprobs and k > 0:
            raise ConfigError(f"engine.topk_logprobs: {k} has no effect with loss.trust_region.mode={mode} (only "
                              "topk_tv | topk_kl read the engine's top-K log-probs); allowed: 0, or set "
                              "loss.trust_region.mode to topk_tv | topk_kl")
        if self.task.modulus is not None and self.task.modulus > self.model.vocab_size:
            raise ConfigError(f"task.modulus: {self.task.modulus} exceeds model.vocab_size {self.model.vocab_size}; "
                              "allowed: ≤ the vocabulary size")


def load_job_config(source: str | Path | DictConfig | dict, overrides: Sequence[str] | None = None) -> JobConfig:
    """A validated :class:`JobConfig`: the source, its ``loss_preset`` under its ``loss`` keys, then ``overrides``."""
    from omegaconf.errors import OmegaConfBaseException

    raw = OmegaConf.load(source) if isinstance(source, (str, Path)) else OmegaConf.create(source)
    try:
        raw = OmegaConf.merge(raw, OmegaConf.from_dotlist(list(overrides or [])))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"overrides: {str(exc).splitlines()[0]}; allowed: 'key=value' strings") from exc
    preset = raw.get("loss_preset")
    if preset is not None:
        inline = raw.get("loss") or {}
        raw.loss = OmegaConf.merge(OmegaConf.load(preset_path(str(preset), key="loss_preset")), inline)
    return load_config(raw, schema=JobConfig)
