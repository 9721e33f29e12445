"""The training–inference mismatch lab: the failure modes of the seeds, reproduced and measured against mp_grpo.

``python -m mp_grpo.train.mismatch_lab [--experiments a b c d e f g h i] [--full] [--out docs/mismatch]`` runs, on CPU:

- (a) :mod:`.is_correction`: the same batch's gradient with the rollout IS correction applied vs omitted
  (the Liger-Kernel #1082 ~100× grad norm), over a range of rollout mismatch;
- (b) :mod:`.normalizer`: a per-micro-batch normalizer (the bug of that report, reproduced as a labelled
  baseline) vs mp_grpo's :class:`~mp_grpo.GlobalBatch` over 1, 2, 4, 8 micro-batches of unequal lengths;
- (c) :mod:`.nan_guard`: unclamped ``exp`` of log-ratios with garbage at masked positions vs mp_grpo;
- (d) :mod:`.training`: GRPO runs of :mod:`mp_grpo.train` with the rollout engine's mismatch knob rising,
  with and without rollout correction and the mismatch skip;
- (e) :mod:`.top_p_replay`: the rollout engine sampling with top-p — vllm-kl and the IS-ratio mean between
  its log-probs and the trainer's, without and with the filter replayed (``SamplingFilter(top_p=p)``);
- (f) :mod:`.top_p_loop`: (e)'s top-p row through the learning loop itself — GRPO runs with ``engine.top_p``,
  the trainer replaying the filter (``engine.replay_filter``) or not: IS means, vllm-kl, reward;
- (g) :mod:`.pairing`: the trainer's logit precision × the engine's head precision (``model.logit_dtype`` ×
  ``engine.logit_dtype``, bf16 / fp32) at several levels of upstream difference: vllm-kl, RMS of the log-prob
  difference, IS-ratio spread, the low-probability tokens' share of it, reward;
- (h) :mod:`.support_replay`: no replay vs a recomputed filter vs the engine's captured support, at top-p 0.95 and
  top-k 50;
- (i) :mod:`.trust_region_loop`: GRPO runs with the mismatch knob at fixed levels, PPO ratio clipping vs DPPO's
  binary TV vs its top-K TV (K = 20, the engine's top-K log-probs): reward, grad-norm spread, tokens masked,
  IS-ratio spread, non-finite values.

(d)–(i) run quick sizes by default; ``--full`` runs the sizes ``docs/mismatch.md`` reports.

:mod:`.policy` is the tiny policy and noisy bf16 rollout engine of (a)–(c); :mod:`.report` writes the
JSON, markdown tables and PNGs that ``docs/mismatch.md`` shows.
"""
