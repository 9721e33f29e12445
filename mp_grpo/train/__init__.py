"""The main job — on-policy GRPO that learns a verifiable task — and what it needs beyond the adapter.

- :mod:`.loop`: :func:`~mp_grpo.train.loop.run` ``(cfg) -> per-step records`` (``python -m mp_grpo.train`` adds the
  table, progress bar, JSON log and plot of :mod:`.report`).
- :mod:`.rollout`: the rollout engine — its own copy of the policy in its own dtype, mismatch knobs.
- :mod:`.sampler`: vocab-parallel Gumbel-max sampling with noise keyed by (seed, step, sequence, position, token).
- :mod:`.task`: successor counting — keyed prompts, the exact checker, group-normalized advantages.
- :mod:`.cpu_model`, :mod:`.cpu_ddp`, :mod:`.cpu_schedule`: GPTModel, DDP and the schedule's loss contract on
  CPU, where megatron-core 0.16's own ones need CUDA.
- :mod:`.synthetic`: synthetic rollouts with noise rewards (tests of the adapter's plumbing).
- ``configs/``: the job's YAML configs (``--config cpu``, ``--config gpu``).

Nothing here is imported by :mod:`mp_grpo.megatron`: a user's own training loop needs none of it.
"""
