"""The agent's configuration: defaults, then a TOML file, then the environment, then flags.

Every setting has one dotted key, `<section>.<key>` (e.g. `policy.stall_seconds`), which is its
place in the TOML file (`[policy]` table, `stall_seconds = 3.0`), its environment variable
(`KVWATCH_POLICY_STALL_SECONDS`, see `env_name`) and its key in the `overrides` mapping the
CLI passes for the flags the user gave. Later layers win: flags over the environment over the
file over the defaults. Unknown keys in the file are errors with a "did you mean"; so are
unknown keys of a known section in the environment (`KVWATCH_POLICY_STAL_SECONDS`), while
variables of other sections (`KVWATCH_ENGINE_SOCKET`, `KVWATCH_REQUIRE_BPF`) are not ours.
Environment values are text: lists are comma-separated ("8000,8001"; "" is the empty list).
A renamed key (`RENAMED_KEYS`) still loads under its old name, file or environment, with a
warning naming the new one.
Every numeric setting has one range (`RANGES`), checked for the file, the environment and the
flags alike: `kvwatch run`'s flags reach `load_config`, and every command's flags for a setting
(`--port`, `--max-sockets`, ...) are checked on their own by `parse_flag`. The file is read
only when it is a regular file of at most MAX_CONFIG_BYTES of UTF-8 text; error messages quote
at most a short prefix of a bad value (kvwatch.errors.quoted).
The settings, their defaults and their rules are kvwatch.config.schema.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

from kvwatch.config.schema import CHECKS, RANGES, AgentConfig, PolicyConfig
from kvwatch.errors import ConfigError, quoted, quoted_path
from kvwatch.files import read_small_file

ENV_PREFIX = "KVWATCH_"
# A config file is a few kB; past this it is the wrong file (or a device, or an attack).
MAX_CONFIG_BYTES = 1 << 20
# An unknown name is compared with the known ones by its first characters only.
MAX_NAME_CHARS = 64
# Old dotted key -> the key it was renamed to; the old one still loads, with a warning.
RENAMED_KEYS = {"collector.send_hook": "collector.send_mode"}

log = logging.getLogger(__name__)

_SECTIONS: dict[str, type[Any]] = get_type_hints(AgentConfig)
# Dotted key -> the type hint of its field, e.g. "policy.actions" -> tuple[Action, ...].
_FIELDS: dict[str, Any] = {
    f"{section}.{name}": hint
    for section, cls in _SECTIONS.items()
    for name, hint in get_type_hints(cls).items()
}


def config_keys() -> list[str]:
    """Every dotted key, in declaration order."""
    return list(_FIELDS)


def env_name(key: str) -> str:
    """The variable of a dotted key: policy.stall_seconds -> KVWATCH_POLICY_STALL_SECONDS."""
    return ENV_PREFIX + key.replace(".", "_").upper()


@dataclass(frozen=True)
class _Origin:
    """Where a value came from, said in an error message and in its hint."""

    label: str
    fix: str


def _renamed(key: str, where: str, spell: Callable[[str], str] = str) -> str:
    """`key`, or the key it was renamed to, saying so (each written by `spell`)."""
    new = RENAMED_KEYS.get(key)
    if new is None:
        return key
    log.warning("%s is now %s (%s): rename it", spell(key), spell(new), where)
    return new


def _suggest_section(section: str) -> str:
    close = difflib.get_close_matches(section[:MAX_NAME_CHARS], list(_SECTIONS), n=1, cutoff=0.6)
    return f"did you mean [{close[0]}]?" if close else f"sections: {', '.join(_SECTIONS)}"


def _suggest_key(key: str, spell: Callable[[str], str] = str) -> str:
    """A hint for an unknown dotted `key`: the same key name in another section, or the
    closest key of its section, else the keys of its section; each written by `spell`."""
    section, _, name = key.partition(".")
    in_section = [known.partition(".")[2] for known in _FIELDS if known.startswith(section + ".")]
    close = difflib.get_close_matches(name[:MAX_NAME_CHARS], in_section, n=1, cutoff=0.6)
    elsewhere = [known for known in _FIELDS if known.partition(".")[2] == name]
    if close or elsewhere:
        return f"did you mean {spell(elsewhere[0] if elsewhere else f'{section}.{close[0]}')}?"
    if not in_section:
        return _suggest_section(section)
    return "known: " + ", ".join(spell(f"{section}.{known}") for known in in_section)


def _show(value: object) -> str:
    """A short quote of a bad value: a text in quotes, a list as TOML-ish brackets."""
    if isinstance(value, str):
        return f"'{quoted(value)}'"
    return quoted(repr(list(value)) if isinstance(value, tuple) else repr(value))


def _bad_value(key: str, value: object, allowed: str, origin: _Origin) -> ConfigError:
    return ConfigError(f"{key} must be {allowed} (got {_show(value)}, {origin.label})", origin.fix)


_KIND_NAMES = {
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    str: ("a string", "strings"),
}


def _describe(hint: Any, plural: bool = False) -> str:
    if get_origin(hint) is Literal:
        return ("any of " if plural else "one of ") + ", ".join(map(str, get_args(hint)))
    if get_origin(hint) is tuple:
        return "a list of " + _describe(get_args(hint)[0], plural=True)
    return _KIND_NAMES[hint][1 if plural else 0]


def _number(value: object, kind: type[int] | type[float]) -> int | float:
    """An int or float from a TOML/flag number or a text; ValueError for anything else
    (booleans, and fractions where an integer is wanted)."""
    if isinstance(value, str):
        return kind(value.strip())
    if isinstance(value, bool) or not isinstance(value, kind | int):
        raise ValueError(value)
    try:
        return kind(value)
    except OverflowError:  # an integer too large for a float
        raise ValueError(value) from None


def _coerce_scalar(value: object, hint: Any) -> object:
    """`value` as `hint` says; ValueError when it cannot be."""
    if get_origin(hint) is Literal:
        if value not in get_args(hint):
            raise ValueError(value)
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(value)
        return value
    number = _number(value, hint)
    if isinstance(number, float) and not math.isfinite(number):
        raise ValueError(value)
    return number


def _coerce(raw: object, key: str, origin: _Origin) -> object:
    """The typed value of `key` from a TOML value, a flag's value or an environment text."""
    hint = _FIELDS[key]
    try:
        if get_origin(hint) is not tuple:
            return _coerce_scalar(raw, hint)
        items = (
            [item.strip() for item in raw.split(",") if item.strip()]
            if isinstance(raw, str)
            else raw
        )
        if not isinstance(items, list | tuple):
            raise ValueError(raw)
        return tuple(_coerce_scalar(item, get_args(hint)[0]) for item in items)
    except ValueError:
        raise _bad_value(key, raw, _describe(hint), origin) from None


_CONFIG_FIX = "point --config at a TOML file"


def _parse_toml(data: bytes, path: str) -> dict[str, Any]:
    """The TOML document in `data`; ConfigError for bytes that are not UTF-8 TOML."""
    shown = quoted_path(path)
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {shown} is not UTF-8 text (byte {data[exc.start]:#04x} at offset "
            f"{exc.start})",
            _CONFIG_FIX,
        ) from exc
    except ValueError as exc:  # TOMLDecodeError, or an integer of over 4300 digits
        raise ConfigError(
            f"config file {shown} is not valid TOML: {quoted(str(exc))}",
            "fix the syntax at the place shown",
        ) from exc
    except RecursionError as exc:
        raise ConfigError(
            f"config file {shown} nests arrays or tables too deeply",
            "a kvwatch config holds [section] tables of plain values and flat lists",
        ) from exc


def _read_file(path: str) -> dict[str, object]:
    """The raw values of a TOML file, by dotted key; unknown tables and keys are errors."""
    shown = quoted_path(path)
    values: dict[str, object] = {}
    data = read_small_file(path, "config file", _CONFIG_FIX, MAX_CONFIG_BYTES)
    for section, table in _parse_toml(data, path).items():
        if section not in _SECTIONS:
            raise ConfigError(
                f"unknown section [{quoted(section)}] in {shown}", _suggest_section(section)
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{section} in {shown} must be a table", f"write it as [{section}]")
        for name, value in table.items():
            key = _renamed(f"{section}.{name}", f"in {shown}")
            if key not in _FIELDS:
                raise ConfigError(f"unknown key {quoted(key)} in {shown}", _suggest_key(key))
            values[key] = value
    return values


def _read_env(env: Mapping[str, str]) -> dict[str, object]:
    """The KVWATCH_<SECTION>_<KEY> variables of our sections, by dotted key."""
    values: dict[str, object] = {}
    known = {env_name(key): key for key in (*_FIELDS, *RENAMED_KEYS)}
    for name, text in env.items():
        section = name[len(ENV_PREFIX) :].split("_", 1)[0].lower()
        if not name.startswith(ENV_PREFIX) or section not in _SECTIONS:
            continue
        if name not in known:
            key = section + "." + name[len(ENV_PREFIX) + len(section) + 1 :].lower()
            hint = _suggest_key(key, env_name)
            raise ConfigError(f"unknown environment variable {quoted(name)}", hint)
        values[_renamed(known[name], "in the environment", env_name)] = text
    return values


def _layers(
    path: str | None, env: Mapping[str, str], overrides: Mapping[str, object]
) -> list[tuple[dict[str, object], Callable[[str], _Origin]]]:
    layers: list[tuple[dict[str, object], Callable[[str], _Origin]]] = []
    if path is not None:
        shown = quoted_path(path)
        layers.append((_read_file(path), lambda _key: _Origin(f"in {shown}", f"edit {shown}")))
    layers.append(
        (_read_env(env), lambda key: _Origin(f"from ${env_name(key)}", f"change ${env_name(key)}"))
    )
    for key in overrides:
        if key not in _FIELDS:
            raise ConfigError(f"unknown setting {quoted(key)}", _suggest_key(key))
    flags = {key: value for key, value in overrides.items() if value is not None}
    layers.append(
        (flags, lambda _key: _Origin("from the command line", "change the command-line flag"))
    )
    return layers


def _check(key: str, value: object, raw: object, origin: _Origin) -> None:
    """Raises ConfigError unless the typed `value` of `key` is in its range (each item, for a
    list) and passes its check."""
    bounds = RANGES.get(key)
    numbers: tuple[Any, ...] = value if isinstance(value, tuple) else (value,)
    if bounds is not None and not all(bounds.holds(number) for number in numbers):
        raise _bad_value(key, raw, bounds.allowed(isinstance(value, tuple)), origin)
    check = CHECKS.get(key)
    if check is not None and not check[0](value):
        raise _bad_value(key, raw, check[1], origin)


def parse_flag(key: str, raw: object, flag: str) -> object:
    """The typed value of setting `key` from command-line `flag` (a repeatable flag's values
    as a tuple), checked as a value from the file or the environment is; ConfigError naming
    the flag. Every command's flags for a setting go through here, not only `kvwatch run`'s."""
    origin = _Origin(f"from {flag}", f"change {flag}")
    value = _coerce(raw, key, origin)
    _check(key, value, raw, origin)
    return value


def load_config(
    path: str | None, env: Mapping[str, str], overrides: Mapping[str, object]
) -> AgentConfig:
    """The effective configuration: defaults < file at `path` (None: no file) < `env`
    (pass os.environ) < `overrides` (dotted key -> flag value; None means "flag not given").
    Raises ConfigError naming the key, the bad value, where it came from and what is allowed."""
    values: dict[str, object] = {}
    raws: dict[str, object] = {}
    origins: dict[str, _Origin] = {}
    for layer, origin_of in _layers(path, env, overrides):
        for key, raw in layer.items():
            origins[key] = origin_of(key)
            raws[key] = raw
            values[key] = _coerce(raw, key, origins[key])
    for key in _FIELDS:
        if key in values:
            _check(key, values[key], raws[key], origins[key])
    sections: dict[str, dict[str, object]] = {section: {} for section in _SECTIONS}
    for key, value in values.items():
        section, name = key.split(".", 1)
        sections[section][name] = value
    config = AgentConfig(**{name: _SECTIONS[name](**kw) for name, kw in sections.items()})
    _check_hold_bounds(config.policy, origins)
    return config


def _check_hold_bounds(policy: PolicyConfig, origins: Mapping[str, _Origin]) -> None:
    """The release bound must lie below the pause bound, or a released stream would be
    paused again at once (and a paused one never released)."""
    if policy.release_seconds < policy.pause_seconds:
        return
    key = next(
        (k for k in ("policy.release_seconds", "policy.pause_seconds") if k in origins),
        "policy.release_seconds",
    )
    origin = origins.get(key, _Origin("by default", f"set {key}"))
    raise ConfigError(
        f"policy.release_seconds {policy.release_seconds} must be below policy.pause_seconds "
        f"{policy.pause_seconds} ({key} {origin.label})",
        f"{origin.fix}: for example release_seconds = pause_seconds / 2",
    )


def config_to_dict(config: AgentConfig) -> dict[str, dict[str, object]]:
    """The configuration as TOML-shaped plain data (lists, not tuples), for showing it."""
    return {
        section: {
            name: list(value) if isinstance(value, tuple) else value
            for name, value in dataclasses.asdict(getattr(config, section)).items()
        }
        for section in _SECTIONS
    }
