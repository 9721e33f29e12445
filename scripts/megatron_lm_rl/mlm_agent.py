"""The launcher's verifiable task for Megatron-LM's RL loop: successor counting, as mp_grpo's main job
(``mp_grpo/train/task.py``), spoken through Megatron-LM's text interface.

With ``--tokenizer-type NullTokenizer`` a text is token ids separated by spaces. A prompt is ``prompt_tokens`` random
ids from ``[0, modulus)``; a correct completion counts on from the prompt's last id, ``last + 1, last + 2, …``
(mod ``modulus``), until the engine stops it (the end of the sequence, or the end-of-document id). The reward is
the fraction of the completion budget (``sequence_length − prompt length`` tokens) whose id equals the previous
id + 1 (mod ``modulus``), the first compared with the prompt's last id: partial credit, exact, from ids only. A
uniformly random policy over a vocabulary of V scores about 1/V.

:func:`successor_reward` and :func:`make_prompt` are plain Python (tested on CPU);
:func:`successor_agent_class` builds the Megatron-LM agent (a ``RewardOnlyAgent``), registered in its allowlist
(``megatron.rl.agent.registry.AGENT_REGISTRY``) under ``AGENT_NAME`` by the launcher.
"""

from __future__ import annotations

import random

AGENT_NAME = "MpGrpoSuccessorCounting"
"""The agent type of the launcher's environment config (``--langrl-env-config``)."""
AGENT_TARGET = "mlm_agent:successor_counting_agent"
"""Its import target for Megatron-LM's registry (``module:attribute``; the launcher's folder is on ``sys.path``)."""


def make_prompt(rng: random.Random, *, prompt_tokens: tuple[int, int], modulus: int) -> list[int]:
    """A prompt of ``prompt_tokens[0] … prompt_tokens[1]`` ids from ``[0, modulus)``."""
    lo, hi = prompt_tokens
    return [rng.randrange(modulus) for _ in range(rng.randint(lo, hi))]


def parse_ids(text: str) -> list[int]:
    """The ids of a NullTokenizer text (``"3 4 5"``); a non-integer word is an error naming it."""
    try:
        return [int(word) for word in text.split()]
    except ValueError as err:
        raise ValueError(f"a NullTokenizer text holds integers separated by spaces, got {text!r}") from err


def successor_reward(prompt: list[int], completion: list[int], *, budget: int, modulus: int, eod: int) -> float:
    """Fraction of the ``budget`` completion tokens equal to the previous token + 1 (mod ``modulus``); the
    completion ends at its first ``eod`` (the rest of the budget counts as wrong)."""
    if budget <= 0 or not prompt:
        raise ValueError(f"budget must be > 0 and the prompt non-empty, got budget={budget}, prompt={prompt}")
    if eod in completion:
        completion = completion[:completion.index(eod)]
    previous, correct = prompt[-1], 0
    for token in completion[:budget]:
        correct += token == (previous + 1) % modulus
        previous = token
    return correct / budget


def successor_agent_class():
    """The Megatron-LM agent class (imports Megatron-LM's RL package: call with its tree on ``sys.path``)."""
    from pydantic import PrivateAttr

    from megatron.rl.agent.reward_only_agent import RewardOnlyAgent

    class SuccessorCountingAgent(RewardOnlyAgent):
        """Successor counting (module docstring); the agent arguments of the environment config are its fields."""

        env_id: str | None = "successor_counting"
        modulus: int = 16
        min_prompt_tokens: int = 2
        max_prompt_tokens: int = 6
        sequence_length: int = 24
        """The engine's ``--inference-max-seq-length``: prompt + completion."""
        eod: int = -1
        seed: int = 1234
        _rng: random.Random = PrivateAttr(default=None)

        def model_post_init(self, context) -> None:
            super().model_post_init(context)
            self._rng = random.Random(self.seed)

        def _prompt(self, rng: random.Random) -> tuple[str, dict]:
            ids = make_prompt(rng, prompt_tokens=(self.min_prompt_tokens, self.max_prompt_tokens), modulus=self.modulus)
            return " ".join(map(str, ids)), {"prompt": ids}

        async def get_prompt(self, validation: bool = False) -> tuple[str, dict]:
            return self._prompt(random.Random(self.seed + 1) if validation else self._rng)

        async def evaluation_prompts(self, num_prompts: int, validation: bool = False) -> list[tuple[str, dict]]:
            rng = random.Random(self.seed + 1)
            return [self._prompt(rng) for _ in range(num_prompts)]

        async def get_reward(self, response: str, golden: dict, finish_reason: str) -> float:
            prompt = golden["prompt"]
            return successor_reward(prompt, parse_ids(response), budget=self.sequence_length - len(prompt),
                                    modulus=self.modulus, eod=self.eod)

        async def _rollout_from_episode(self, request, episode, golden):
            """Megatron-LM's rollout, with its generation cap stamped when the engine stopped it at the sequence's end
            (finish reason ``length``): Megatron-LM accepts a single-turn rollout shorter than ``--seq-length``
            only when it ends in eod or at that stamped cap (``single_turn_termination_ok``)."""
            rollout = await super()._rollout_from_episode(request, episode, golden)
            last = episode.responses[-1]
            if last.finish_reason == "length" and getattr(rollout, "generation_mask", None):
                rollout.generation_cap = int(sum(rollout.generation_mask[-1]))
            return rollout

    return SuccessorCountingAgent


def __getattr__(name: str):
    if name == "successor_counting_agent":  # the registry's import target, built on first use
        cls = successor_agent_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
