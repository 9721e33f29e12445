"""Loss presets shipped with mp_grpo: one YAML file of :class:`mp_grpo.config.LossConfig` keys per preset.

Load one by name from any working directory: ``mp_grpo.load_config("trl_dapo")``;
``mp_grpo.config.preset_names()`` lists them. They are package data (``pyproject.toml``), so a wheel or a
``pip install .`` carries them; a package (not only a folder) so that Hydra can put it on its search path
(``hydra.searchpath=[pkg://mp_grpo.presets]``) and ``importlib.resources.files("mp_grpo.presets")`` finds it.
"""
