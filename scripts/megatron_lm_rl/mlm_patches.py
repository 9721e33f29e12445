"""What the launcher changes in Megatron-LM's process at run time, and why — none of it in mp_grpo's code, none in
Megatron-LM's source tree (each is an attribute set on an imported module or class, here).

Applied in every process of the run (:func:`apply_process_patches`; the launcher re-applies them in the processes
Megatron-LM spawns, which import the launcher as ``__mp_main__``):

1. ``wandb`` stub, when wandb is not installed: ``megatron/rl/rl_utils.py`` imports ``wandb.wandb_run`` at import time
   (for a type annotation) although the run logs nothing to wandb. The stub has ``run = None`` and
   ``wandb_run.Run``; Megatron-LM's dynamic engine then sees ``wandb.run is None`` and logs nothing.
2. The NullTokenizer's ``bos_id`` (None: no BOS id) and ``eos_id`` (its end-of-document id): Megatron-LM's text
   tokenizer reads ``tokenizer.bos`` / ``eos`` from its library tokenizer, which the NullTokenizer lacks.
3. The flash-attn stand-in on ``sys.path`` when asked (``flash_attn_standin/``: the rollout engine's attention
   only).

Applied in the launcher's process before ``pretrain`` (:func:`apply_run_patches`):

4. ``megatron.training.initialize._compile_dependencies``: a barrier only. Megatron-LM compiles its dataset index
   helpers (C++, ``make``) at start-up; ``train_rl.py`` builds no dataset.
5. Loopback only: the inference coordinator and the engine's ZMQ sockets bind ``127.0.0.1`` (Megatron-LM binds
   ``socket.gethostname()``, which must then resolve), the OpenAI-style text server binds ``127.0.0.1:8294`` (not
   ``0.0.0.0``) and the agents' client calls it there (``rl_utils.get_inference_interface`` rewritten with that
   host; the rest as Megatron-LM's).
6. The successor-counting agent registered in Megatron-LM's agent allowlist (``AGENT_REGISTRY``).
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

LOOPBACK = "127.0.0.1"
TEXT_SERVER_PORT = 8294
"""Megatron-LM's own port for the text generation server (``rl_utils.get_inference_interface``)."""
STAND_IN_ENV = "MP_GRPO_FLASH_ATTN_STAND_IN"
"""Set to 1 by the launcher when the flash-attn stand-in is used (read again in the spawned processes)."""
STAND_IN_DIR = Path(__file__).resolve().parent / "flash_attn_standin"


def stub_wandb() -> bool:
    """Patch 1; True when the stub was installed (wandb absent)."""
    try:
        import wandb  # noqa: F401

        return False
    except ImportError:
        pass
    wandb = types.ModuleType("wandb")
    wandb.__doc__ = "Stub installed by scripts/megatron_lm_rl (wandb is not installed; nothing is logged to it)."
    wandb.run = None
    run_module = types.ModuleType("wandb.wandb_run")
    run_module.Run = type("Run", (), {})
    wandb.wandb_run = run_module
    sys.modules["wandb"], sys.modules["wandb.wandb_run"] = wandb, run_module
    return True


def null_tokenizer_bos_eos() -> None:
    """Patch 2."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    if not hasattr(NullTokenizer, "bos_id"):
        NullTokenizer.bos_id = property(lambda self: None)
    if not hasattr(NullTokenizer, "eos_id"):
        NullTokenizer.eos_id = property(lambda self: self._eod_id)


def use_flash_attn_stand_in() -> None:
    """Patch 3: ``import flash_attn`` finds the stand-in (refused if a real flash-attn is already imported)."""
    loaded = sys.modules.get("flash_attn")
    if loaded is not None and not getattr(loaded, "IS_STAND_IN", False):
        raise RuntimeError("a real flash_attn is already imported; the stand-in would not be used")
    if str(STAND_IN_DIR) not in sys.path:
        sys.path.insert(0, str(STAND_IN_DIR))


def apply_process_patches() -> dict[str, bool]:
    """Patches 1–3 (what each did)."""
    done = {"wandb_stub": stub_wandb()}
    null_tokenizer_bos_eos()
    done["null_tokenizer_bos_eos"] = True
    done["flash_attn_stand_in"] = os.environ.get(STAND_IN_ENV) == "1"
    if done["flash_attn_stand_in"]:
        use_flash_attn_stand_in()
    return done


def skip_dataset_helpers() -> None:
    """Patch 4."""
    import torch

    from megatron.training import initialize

    def _compile_dependencies() -> None:  # train_rl.py builds no dataset: no index helpers to compile
        torch.distributed.barrier()

    initialize._compile_dependencies = _compile_dependencies


def loopback_only() -> None:
    """Patch 5."""
    import functools

    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.text_generation_server import dynamic_text_gen_server
    from megatron.rl import rl_utils
    from megatron.rl.inference.megatron import MegatronLocal

    listen = DynamicInferenceEngine.start_listening_to_data_parallel_coordinator

    @functools.wraps(listen)
    async def listen_on_loopback(self, *args, **kwargs):
        kwargs["hostname"] = kwargs.get("hostname") or LOOPBACK
        return await listen(self, *args, **kwargs)

    DynamicInferenceEngine.start_listening_to_data_parallel_coordinator = listen_on_loopback
    dynamic_text_gen_server.start_text_gen_server = functools.partial(dynamic_text_gen_server.start_text_gen_server,
                                                                      hostname=LOOPBACK)

    def get_inference_interface(args, loop, model):  # rl_utils.get_inference_interface, with the loopback host
        if rl_utils._INFERENCE_INTERFACE is None:
            rl_utils._eager_train_comm_warmup()
            rl_utils._INFERENCE_INTERFACE = loop.run_until_complete(MegatronLocal.launch(
                model[0], host=LOOPBACK, port=TEXT_SERVER_PORT, verbose=args.inference_text_gen_server_logging))
        return rl_utils._INFERENCE_INTERFACE

    rl_utils.get_inference_interface = get_inference_interface


def register_agent() -> None:
    """Patch 6."""
    from megatron.rl.agent.registry import AGENT_REGISTRY
    from mlm_agent import AGENT_NAME, AGENT_TARGET

    AGENT_REGISTRY[AGENT_NAME] = AGENT_TARGET


def apply_run_patches() -> None:
    """Patches 4–6."""
    skip_dataset_helpers()
    loopback_only()
    register_agent()
