"""Drop-in adapters for RL frameworks: each holds only what the framework's loop calls.

- :mod:`.nemo_rl`: a NeMo-RL ``LossFunction`` (log-prob or vocabulary-sharded logit input).
- :mod:`.megatron_rl`: a ``forward_step`` for Megatron-LM's ``train_rl.py`` (sharded logits, the step's account).

Importing this package imports no framework; each adapter imports its framework lazily, where it is used.
"""
