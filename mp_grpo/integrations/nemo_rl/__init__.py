"""mp_grpo inside NeMo-RL: :class:`MPGRPOLossFn`, a NeMo-RL ``LossFunction`` (``docs/integrations.md``).

In the launcher, after ``setup(...)``::

    from mp_grpo.integrations.nemo_rl import MPGRPOLossFn
    loss_fn = MPGRPOLossFn.from_master_config(master_config, "nemo_rl_grpo")

- :mod:`.loss`: the LossFunction (log-prob and logit input) and the step's account from NeMo-RL's counts.
- :mod:`.data`: the data dict at logit positions — shifted, and cut like the logits under context parallelism.
- :mod:`.metrics`: the metrics dict in NeMo-RL's form.
- :mod:`.interfaces`: NeMo-RL's enums (its own when importable).
"""

from mp_grpo.integrations.nemo_rl.loss import InputType, MPGRPOLossFn, step_account

__all__ = ["InputType", "MPGRPOLossFn", "step_account"]
