"""Plug-ins for RL training frameworks: thin adapters from what each framework hands a loss to mp_grpo.

- :mod:`.verl`: every preset as a verl policy loss ``mp_grpo:<preset>`` (registered through verl's
  ``verl.plugins`` entry point when ``verl`` is imported), and the log-prob kernel in verl's Megatron engine.

Each adapter imports its framework; ``import mp_grpo`` imports none of them.
"""
