"""Load a typed config from YAML, a dict or a DictConfig, with dotlist overrides.

Schedule of :func:`load_config`
    1. Read the source (a YAML path, a mapping or a DictConfig); with ``section``, keep that top-level key.
    2. Turn every enum value of the source and the overrides into its enum member (omegaconf 2.3 converts a
       string by member *name* only, 2.4 by name or value; YAML files hold the values): a bad enum value fails
       here, naming the key, the value given and the allowed values.
    3. Merge them onto ``OmegaConf.structured(schema)``: unknown keys and wrong types fail here.
    4. Build the dataclasses (``OmegaConf.to_object``), which runs every section's value checks and the
       cross-section checks.
Every failure is a :class:`~mp_grpo.config.loss.ConfigError` naming the key and what is allowed.

A ``source`` string without a path separator and without a ``.yaml`` / ``.yml`` suffix is the name of a
preset shipped in the package (``mp_grpo/presets/<name>.yaml``): ``load_config("trl_dapo")`` works from any
working directory of an installed mp_grpo. Tested with omegaconf 2.3 (hydra-core 1.3) and 2.4.

omegaconf is imported inside the functions, so importing mp_grpo never needs it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from mp_grpo.config.loss import ConfigError, LossConfig

if typing.TYPE_CHECKING:
    from omegaconf import DictConfig

T = TypeVar("T")

PRESETS_DIR = Path(__file__).resolve().parents[1] / "presets"
"""The preset YAML files, package data of mp_grpo (``mp_grpo/presets``): present in a checkout, a wheel and
an installed package alike."""

_YAML_SUFFIXES = (".yaml", ".yml")


def preset_names() -> list[str]:
    """Names of the shipped presets (``mp_grpo/presets/*.yaml``), sorted."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def preset_path(name: str, *, key: str = "preset") -> Path:
    """Path of the shipped preset ``<name>`` (``mp_grpo/presets/<name>.yaml``); the error (naming ``key``)
    suggests the closest name and lists the presets."""
    path = PRESETS_DIR / f"{name}.yaml"
    if not isinstance(name, str) or not _is_preset_name(name) or not path.is_file():
        names = preset_names()
        raise ConfigError(f"{key}: no preset named {name!r}{_notes(did_you_mean(str(name), names))}; allowed: {' | '.join(names)}")
    return path


def did_you_mean(given: str, choices: Sequence[str], *, prefix: str = "") -> str | None:
    """``"did you mean <prefix><closest>?"`` when one of ``choices`` is close to ``given`` (difflib), else None."""
    close = difflib.get_close_matches(given, list(choices), n=1)
    return f"did you mean {prefix}{close[0]}?" if close else None


def _notes(*notes: str | None) -> str:
    """``" (a; b)"`` of the notes that are not None, or ``""``."""
    kept = [n for n in notes if n]
    return f" ({'; '.join(kept)})" if kept else ""


def _is_preset_name(source: str) -> bool:
    """A bare name (no path separator, no YAML suffix) names a preset; anything else is a file path."""
    return bool(source) and "/" not in source and "\\" not in source and not source.endswith(_YAML_SUFFIXES)


def load_config(
    source: str | Path | Mapping[str, Any] | DictConfig | None,
    overrides: Sequence[str] | None = None,
    *,
    schema: type[T] = LossConfig,  # type: ignore[assignment]
    section: str | None = None,
) -> T:
    """A validated ``schema`` instance (default :class:`LossConfig`) from ``source`` and ``overrides``.

    Args:
        source: a preset name (``"trl_dapo"``: a string without ``/`` and without a ``.yaml`` suffix; see
            :func:`preset_names`), a YAML file path, a mapping or a DictConfig holding the keys of ``schema``
            (missing keys keep their defaults); ``None`` means the defaults. A DictConfig is not modified.
        overrides: dotlist strings applied after the source, e.g. ``["policy.eps_high=0.28", "kl.coef=0.001"]``.
        schema: the dataclass to load: :class:`LossConfig`, or a job config that nests it next to other sections.
        section: take only this top-level key of the source (e.g. the ``loss`` section of a job YAML).
    """
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not dataclasses.is_dataclass(schema) or not isinstance(schema, type):
        raise TypeError(f"schema must be a dataclass type, got {schema!r}")
    # --- 1. read the source ---
    loaded = _read_source(source)
    if section is not None:
        if section not in loaded:
            raise ConfigError(f"{section}: no such top-level section in the source; allowed: {' | '.join(map(str, loaded))}")
        loaded = loaded[section]
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"{section}: must be a mapping of keys, got {type(loaded).__name__}")
    if overrides is not None and (isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides)):
        raise TypeError(f"overrides must be a list of 'key=value' strings, got {overrides!r}")
    _check_sections(loaded, schema, "")
    try:
        dotlist = OmegaConf.from_dotlist(list(overrides or []))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"overrides: {str(exc).splitlines()[0]}; allowed: 'key=value' strings") from exc
    # --- 2. enum values → enum members, in the source and the overrides (both are our own copies) ---
    _enum_members(loaded, schema, "")
    _enum_members(dotlist, schema, "")
    # --- 3. merge onto the structured schema: unknown keys and types fail here ---
    try:
        merged = OmegaConf.merge(_structured(schema), loaded, dotlist)
        # --- 4. build the dataclasses: runs every value and combination check ---
        obj = OmegaConf.to_object(merged)
    except ConfigError as exc:
        raise _with_full_key(exc, merged) from None
    except OmegaConfBaseException as exc:
        raise _explain(exc, schema, loaded, dotlist) from exc
    return obj  # type: ignore[return-value]


@functools.lru_cache(maxsize=None)
def _structured(schema: type) -> DictConfig:
    """The schema's structured DictConfig, built once per schema (merging never modifies its inputs)."""
    from omegaconf import OmegaConf

    return OmegaConf.structured(schema)


def _read_source(source: str | Path | Mapping[str, Any] | DictConfig | None) -> DictConfig:
    from omegaconf import DictConfig, OmegaConf

    if source is None:
        return OmegaConf.create({})
    if isinstance(source, DictConfig):
        return copy.deepcopy(source)  # step 2 rewrites enum values in place: never in the caller's config
    if isinstance(source, (str, Path)):
        path = preset_path(source) if isinstance(source, str) and _is_preset_name(source) else Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"source: no config file at {path}")
        loaded = OmegaConf.load(path)
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"source: {path} must hold a mapping of sections, got a list")
        return loaded
    if isinstance(source, Mapping):
        return OmegaConf.create(dict(source))
    raise TypeError(f"source must be a YAML path, a mapping or a DictConfig, got {type(source).__name__}")


def _with_full_key(exc: ConfigError, merged: DictConfig) -> ConfigError:
    """The error of a value check, with its key prefixed by where the failing section sits in ``merged``.

    A section's check names its key from the section (``policy.delta``); inside a job config that section
    may sit deeper (``loss.policy``), so the deepest node whose construction fails gives the prefix.
    """
    path = _failing_node(merged, [])
    if not path:
        return exc
    key = str(exc).split(":", 1)[0]
    prefix = path[:-1] if key.split(".", 1)[0] == path[-1] else path
    return ConfigError(".".join(prefix + [str(exc)])) if prefix else exc


def _failing_node(node: DictConfig, path: list[str]) -> list[str] | None:
    from omegaconf import DictConfig, OmegaConf

    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            found = _failing_node(child, path + [str(key)])
            if found is not None:
                return found
    try:
        OmegaConf.to_object(node)
    except ConfigError:
        return path
    return None


def _check_sections(loaded: DictConfig, schema: type, prefix: str) -> None:
    """A section of the schema must be given as a mapping (OmegaConf's own error would not name it)."""
    from omegaconf import DictConfig, OmegaConf

    hints = _field_types(schema)
    for key in loaded:
        inner = _strip_optional(hints.get(str(key)))
        if not dataclasses.is_dataclass(inner):
            continue
        value = loaded._get_node(key)  # the raw node: no interpolation is resolved here
        if isinstance(value, DictConfig):
            _check_sections(value, inner, f"{prefix}{key}.")  # type: ignore[arg-type]
        elif not OmegaConf.is_missing(loaded, key) and loaded[key] is not None:
            raise ConfigError(f"{prefix}{key}: must be a mapping, got {loaded[key]!r}; allowed: {_describe(inner)}")


def _enum_members(loaded: DictConfig, schema: type, prefix: str) -> None:
    """Replace, in place, each enum field's string (its value as written in YAML, or its member name) by the
    enum member, so that omegaconf 2.3 (names only) and 2.4 (names or values) merge it alike.

    Interpolations and ``null`` / ``???`` are left to OmegaConf. Any other value that is no member of the
    enum fails here: the message names the key, the value given and the allowed values.
    """
    from omegaconf import DictConfig, OmegaConf

    hints = _field_types(schema)
    for key in list(loaded):
        inner = _strip_optional(hints.get(str(key)))
        node = loaded._get_node(key)
        if dataclasses.is_dataclass(inner) and isinstance(node, DictConfig):
            _enum_members(node, inner, f"{prefix}{key}.")  # type: ignore[arg-type]
        elif isinstance(inner, type) and issubclass(inner, Enum):
            if OmegaConf.is_interpolation(loaded, str(key)) or OmegaConf.is_missing(loaded, str(key)):
                continue
            value = node._value()  # type: ignore[union-attr]
            if value is None or isinstance(value, inner):
                continue
            loaded[key] = _enum_member(inner, value, f"{prefix}{key}", hints[str(key)])


def _enum_member(enum: type[Enum], value: Any, key: str, annotation: Any) -> Enum:
    """The member of ``enum`` whose value (or name, as omegaconf spells it: ``NAME`` or ``Enum.NAME``) is ``value``."""
    if isinstance(value, str):
        name = value.removeprefix(f"{enum.__name__}.")
        if name in enum.__members__:
            return enum[name]
        for member in enum:
            if member.value == value:
                return member
    hint = _notes(did_you_mean(str(value), [str(m.value) for m in enum]))
    raise ConfigError(f"{key}: got {value!r}{hint}; allowed: {_describe(annotation)}")


def _explain(exc: Exception, schema: type, *sources: DictConfig) -> ConfigError:
    """Turn an OmegaConf error into a ConfigError naming the full key and the allowed values; for an unknown
    key, the value given (looked up in ``sources``) and the closest known key."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError

    full_key = str(getattr(exc, "full_key", "") or "")
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    parent, leaf = _resolve(schema, full_key.split(".") if full_key else [])
    if isinstance(exc, ConfigKeyError) or leaf is None:
        keys = [f.name for f in dataclasses.fields(parent)] if parent is not None else []
        if not full_key:
            return ConfigError(f"<root>: {message}; allowed keys: {' | '.join(keys)}")
        head, _, name = full_key.rpartition(".")
        given = next((v for s in sources if (v := OmegaConf.select(s, full_key, default=None)) is not None), None)
        got = None if given is None or OmegaConf.is_config(given) else f"given {given!r}"
        hint = did_you_mean(name, keys, prefix=f"{head}." if head else "")
        return ConfigError(f"{full_key}: no such key{_notes(got, hint)}; allowed keys: {' | '.join(keys)}")
    if isinstance(_strip_optional(leaf), type) and issubclass(_strip_optional(leaf), Enum):
        message = message.split(", expected")[0]  # OmegaConf lists the member names; we list the values
    return ConfigError(f"{full_key}: {message}; allowed: {_describe(leaf)}")


def _resolve(schema: type, path: list[str]) -> tuple[type | None, Any]:
    """(dataclass holding the last key, type of that key) — (holder, None) when the key is unknown."""
    holder: type | None = schema
    annotation: Any = schema
    for name in path:
        if holder is None or not dataclasses.is_dataclass(holder):
            return holder, None
        hints = _field_types(holder)
        if name not in hints:
            return holder, None
        annotation = hints[name]
        inner = _strip_optional(annotation)
        if dataclasses.is_dataclass(inner) and name != path[-1]:
            holder = inner  # type: ignore[assignment]
    return holder, annotation


def _field_types(cls: type) -> dict[str, Any]:
    """Field name → type of a dataclass; a field whose annotation cannot be resolved falls back to the type of
    its default (its default factory for a section)."""
    try:
        return typing.get_type_hints(cls)
    except NameError:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                out[f.name] = f.default_factory  # type: ignore[misc]
            else:
                out[f.name] = f.type if isinstance(f.type, type) else type(f.default)
        return out


def _strip_optional(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


def _describe(annotation: Any) -> str:
    nullable = type(None) in typing.get_args(annotation)
    inner = _strip_optional(annotation)
    prefix = "null | " if nullable else ""
    if isinstance(inner, type) and issubclass(inner, Enum):
        return prefix + " | ".join(str(m.value) for m in inner)
    if dataclasses.is_dataclass(inner):
        return "a mapping with keys " + " | ".join(f.name for f in dataclasses.fields(inner))
    return prefix + getattr(inner, "__name__", str(inner))
