"""mp_grpo inside Megatron-LM's RL loop (``train_rl.py``): :class:`GRPOForwardStep` (``docs/integrations.md``).

In ``train_rl.py``'s ``__main__``, the forward step handed to ``pretrain``::

    from mp_grpo.integrations.megatron_rl import GRPOForwardStep
    forward_step = GRPOForwardStep.from_args()   # Megatron-LM's loss; GRPOForwardStep("trl_dapo") for another

- :mod:`.forward_step`: the forward step (logits kept vocab-sharded) and its pre-step hook (the step's account).
- :mod:`.batch`: a Megatron-LM RL micro-batch and the loss's fields at this rank's logit positions.
- :mod:`.config`: Megatron-LM's loss as a LossConfig, and :class:`EntropyTerm`.
"""

from mp_grpo.integrations.megatron_rl.batch import LossInputs, RLMicroBatch, loss_inputs
from mp_grpo.integrations.megatron_rl.config import EntropyTerm, loss_config_from_args
from mp_grpo.integrations.megatron_rl.forward_step import GRPOForwardStep, StepMicroBatches, megatron_metrics

__all__ = ["EntropyTerm", "GRPOForwardStep", "LossInputs", "RLMicroBatch", "StepMicroBatches", "loss_config_from_args",
           "loss_inputs", "megatron_metrics"]
