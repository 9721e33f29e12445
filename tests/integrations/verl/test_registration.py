"""The verl plugin as a user meets it: after ``pip install`` of mp_grpo (its package metadata carries the entry
point), a fresh ``import verl`` registers every preset as ``mp_grpo:<preset>`` with no user code; the presets verl
cannot feed are registered as losses that say why; ``register`` adds a config of one's own under a name."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from tests.integrations.verl.helpers import require_verl

require_verl()

from mp_grpo.config import load_config, preset_names  # noqa: E402
from tests.distributed import REPO_ROOT  # noqa: E402

REFUSED = {"deepseek_v32", "megatron_lm_grpo", "mismatch_safe", "nemo_rl_grpo", "trl_vespo", "trl_dppo",
           "nemo_rl_dppo_binary_tv", "prime_rl_dppo", "areal_m2po"}
"""Presets with a KL term (verl adds its own), a mismatch skip, VESPO's folded IS weight, a trust region or M2PO (both
read the rollout log-probs) (a preset added later is expected refused exactly when verl_refusals names something)."""


KNOWN = REFUSED | {"gspo", "trl_cispo", "trl_dapo", "trl_dr_grpo", "trl_grpo", "trl_luspo", "trl_sapo", "verl_clip_cov",
                   "verl_kl_cov", "verl_ppo"}
"""The presets when these tests were written."""


def _fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter (nothing imported before it); it prints one JSON line."""
    import os

    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_entry_point_is_in_the_installed_metadata() -> None:
    points = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert points.get("mp_grpo") == "mp_grpo.integrations.verl.plugin", (
        f"entry points of verl.plugins: {points} — install mp_grpo (pip install -e .) so its metadata is present")


def test_import_verl_registers_every_preset() -> None:
    code = ("import json, sys\n"
            "import verl\n"
            "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R\n"
            "print(json.dumps({k: type(v).__name__ for k, v in R.items() if k.startswith('mp_grpo:')}))")
    registered = _fresh(code)
    assert sorted(registered) == sorted(f"mp_grpo:{p}" for p in preset_names())
    from mp_grpo.integrations.verl import verl_refusals

    for preset in preset_names():
        refused = bool(verl_refusals(load_config(preset)))
        assert refused == (preset in REFUSED) or preset not in KNOWN, f"{preset}: refused is {refused}"
        want = "RefusedPolicyLoss" if refused else "VerlPolicyLoss"
        assert registered[f"mp_grpo:{preset}"] == want, preset


def test_refused_presets_say_why() -> None:
    import verl  # noqa: F401
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    for preset in sorted(REFUSED):
        with pytest.raises(ValueError, match=f"mp_grpo:{preset} cannot run as a verl policy loss: "):
            get_policy_loss_fn(f"mp_grpo:{preset}")()


def test_register_a_config_of_ones_own() -> None:
    import verl  # noqa: F401
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from mp_grpo.integrations.verl import VerlPolicyLoss, register

    loss = register("mp_grpo:test_dapo_wider", load_config("trl_dapo", ["policy.eps_high=0.3"]))
    assert get_policy_loss_fn("mp_grpo:test_dapo_wider") is loss and isinstance(loss, VerlPolicyLoss)
    assert loss.config.policy.eps_high == 0.3
    with pytest.raises(ValueError, match="'vanilla' is one of verl's own loss modes"):
        register("vanilla", load_config("verl_ppo"))
    with pytest.raises(ValueError, match=r"mp_grpo:test_kl cannot run as a verl policy loss: kl.coef=0.1"):
        register("mp_grpo:test_kl", load_config("verl_ppo", ["kl.coef=0.1"]))
    with pytest.raises(TypeError, match="config must be a LossConfig"):
        register("mp_grpo:test_bad", {"policy": {}})  # type: ignore[arg-type]


def test_the_one_line_in_verls_own_config() -> None:
    """The documented command-line lines compose with verl's own Hydra config (ppo_megatron_trainer), the actor
    section becomes verl's McoreActorConfig (which rejects unknown keys), and its loss mode is mp_grpo's."""
    pytest.importorskip("hydra", reason="hydra-core is not installed (verl's CI stage installs hydra-core 1.3.2)")
    import os

    import verl
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils.config import omega_conf_to_dataclass

    from mp_grpo.integrations.verl import VerlPolicyLoss

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose("ppo_megatron_trainer", overrides=[
            "actor_rollout_ref.actor.policy_loss.loss_mode=mp_grpo:trl_dapo",
            '+ray_kwargs.ray_init.runtime_env.env_vars.MP_GRPO_VERL_LOGPROBS="1"',
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        ])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert type(actor).__name__ == "McoreActorConfig" and actor.loss_agg_mode == "token-mean"
    loss = get_policy_loss_fn(actor.policy_loss.loss_mode)
    assert isinstance(loss, VerlPolicyLoss) and loss.name == "mp_grpo:trl_dapo"
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.MP_GRPO_VERL_LOGPROBS == "1"  # Ray wants str values
