"""Whether the output layer's weight gradient goes straight into Megatron DDP's ``main_grad``.

Both output paths compute the output layer's weight gradient themselves (:mod:`.fused_output`,
:mod:`.logits_output`). Returned through autograd, as megatron-core's layer returns it without
gradient-accumulation fusion, it costs memory under tied embeddings: the shared weight is one leaf used
twice (embedding lookup, output layer), so autograd sums both gradients before the weight's
AccumulateGrad node runs, and the output layer's ``[V_local, H]`` gradient — made at the start of
backward — stays alive through the decoder's whole backward, where the step's memory peaks (0.43 GiB in
bf16 at the Qwen2.5-1.5B shape). Added into ``main_grad`` in the op's own backward, it is gone at once,
and summed in fp32 (one rounding fewer).

:func:`accumulates_into_main_grad` decides:

1. No gradient is made (a no-grad pass, a frozen weight): no.
2. The layer's ``gradient_accumulation_fusion``: yes — Megatron's own setting (the op checks that
   ``main_grad`` exists).
3. Otherwise yes when the weight follows Megatron DDP's protocol: it has ``main_grad`` and the flag
   ``grad_added_to_main_grad``, which tells DDP's backward hook that the gradient is in ``main_grad``
   already and ``.grad`` holds a placeholder. A weight the model passes to the layer (tied embeddings)
   also gets the embedding lookup's gradient through ``.grad``; the hook adds it only under
   ``zero_out_wgrad`` (megatron-core's ``LanguageModule`` sets it on a weight shared on one pipeline
   stage). Without that flag the op returns its gradient through autograd, as before, so that the
   hook never drops the embedding's gradient.
"""

from __future__ import annotations

import torch


def accumulates_into_main_grad(layer: torch.nn.Module, weight: torch.Tensor) -> bool:
    """Whether the op computing ``layer``'s output with ``weight`` adds the weight gradient into ``weight.main_grad``
    (see the module docstring)."""
    # --- 1. no gradient made ---
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return False
    # --- 2. Megatron's own gradient-accumulation fusion ---
    if getattr(layer, "gradient_accumulation_fusion", False):
        return True
    # --- 3. Megatron DDP's main_grad protocol; a passed (tied) weight only under zero_out_wgrad ---
    under_ddp = isinstance(getattr(weight, "main_grad", None), torch.Tensor) and hasattr(weight, "grad_added_to_main_grad")
    own_weight = weight is getattr(layer, "weight", None)
    return under_ddp and (own_weight or bool(getattr(weight, "zero_out_wgrad", False)))
