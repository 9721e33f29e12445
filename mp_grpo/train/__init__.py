"""The main job and what it needs beyond the adapter: CPU stand-ins for GPTModel, DDP and the schedule.

- :mod:`.cpu_model`, :mod:`.cpu_ddp`, :mod:`.cpu_schedule`: GPTModel, DDP and the schedule's loss contract on
  CPU, where megatron-core 0.16's own ones need CUDA.
- :mod:`.synthetic`: synthetic rollouts with noise rewards (tests of the adapter's plumbing).

Nothing here is imported by :mod:`mp_grpo.megatron`: a user's own training loop needs none of it.
"""
