"""Drop-in adapters for RL frameworks: each holds only what the framework's loop calls.

- :mod:`.verl`: every preset as a verl policy loss ``mp_grpo:<preset>`` (registered through verl's
  ``verl.plugins`` entry point when ``verl`` is imported), and the log-prob kernel in verl's Megatron engine.
- :mod:`.nemo_rl`: a NeMo-RL ``LossFunction`` (log-prob or vocabulary-sharded logit input).
- :mod:`.megatron_rl`: a ``forward_step`` for Megatron-LM's ``train_rl.py`` (sharded logits, the step's account).

Importing this package imports no framework; each adapter imports its framework lazily, where it is used.
"""
