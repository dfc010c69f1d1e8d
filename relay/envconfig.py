"""Settings declared once: each is a `Setting` (variable, flag, type, default, bounds, help), and
everything else is derived from it: the environment reading, the flag, the validation (a bad
value is a ConfigError naming the flag or variable), `--help` and docs/configuration.md.

The relay declares its settings in relay/settings.py, the operator in relayfleet_operator/config.py;
both read them through this module, so empty means unset everywhere, a replaced name still works
(DEPRECATED_ENV, with one log line) and every message has the same form. It imports nothing of
the relay (a leaf: the operator and the Spark jobs may use it).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")
# the logger of the settings, whichever program reads them
log = logging.getLogger("relay.settings")


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the variable, never a secret."""


class BadItem(ValueError):
    """A list's parser refuses one item: the message shows that item, not the whole value."""

    def __init__(self, item: str) -> None:
        super().__init__(item)
        self.item = item


# Old name -> new name (prefix policy, docs/design-decisions.md): read with a warning.
DEPRECATED_ENV: dict[str, str] = {
    "RELAYFLEET_SHARD_HEALTH_INTERVAL": "RELAY_SHARD_HEALTH_INTERVAL_S",
    "RELAYFLEET_SHARD_STATS_INTERVAL": "RELAY_SHARD_STATS_INTERVAL_S",
    "RELAY_OPERATOR_NAMESPACE": "RELAYFLEET_OPERATOR_NAMESPACE",
}
_OLD_NAMES: dict[str, tuple[str, ...]] = {}
for _old, _new in DEPRECATED_ENV.items():
    _OLD_NAMES[_new] = (*_OLD_NAMES.get(_new, ()), _old)
_warned: set[str] = set()

# Variables of removed features -> what replaced them (docs/upgrade.md): ignored, with a warning
# in the log. Refusing them would crash-loop a rolling upgrade over a tuning knob that changes
# no guarantee; ignoring them silently would hide that the pod spec asks for something gone.
REMOVED_ENV: dict[str, str] = {
    "RELAY_BUSY_POLL_US": "busy-polling was removed; the loop sleeps between events",
    "RELAY_BUSY_POLL_SHARE": "busy-polling was removed; the loop sleeps between events",
}


def warn_removed_env() -> None:
    """One log line per removed variable still set (its name only, never its value)."""
    for name, why in REMOVED_ENV.items():
        if name in os.environ and name not in _warned:
            _warned.add(name)
            log.warning("%s is ignored: %s (docs/upgrade.md)", name, why)


def env_value(name: str) -> str | None:
    """The variable's value (empty counts as unset), or a deprecated name's, with a log line."""
    raw = os.environ.get(name)
    if raw:
        return raw
    for old in _OLD_NAMES.get(name, ()):
        raw = os.environ.get(old)
        if raw:
            if old not in _warned:
                _warned.add(old)
                # a log line, not a Python warning: deprecation must never fail a start-up
                log.warning("%s is deprecated: set %s instead (the old name still works)", old, name)
            return raw
    return None


def env_secret(name: str) -> str | None:
    """A secret from NAME_FILE (a mounted Secret; wins) or NAME. The error names the variable
    and the path, never the content."""
    path = os.environ.get(f"{name}_FILE")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().strip() or None
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(f"{name}_FILE {path}: {reason}") from None
    value = os.environ.get(name)
    return (value.strip() or None) if value else None


def _shown(raw: str) -> str:
    return raw if len(raw) <= 40 else raw[:40] + "..."


# -- value types: a parser and the words for what it takes ----------------------------------------


@dataclass(frozen=True, slots=True)
class Kind(Generic[T]):
    """How a setting's text becomes its value. `parse` raises ValueError (BadItem: show one item);
    with `explains`, the error's own text is the message (`NAME: why`), not `must be <kind>`."""

    parse: Callable[[str], T]
    kind: str  # "an integer": the message says `NAME must be an integer, got '...'`
    explains: bool = False
    show: Callable[[T], str] = str  # a value as --help and the docs show it

    def read(self, name: str, raw: str) -> T:
        try:
            return self.parse(raw)
        except BadItem as exc:
            raise ConfigError(f"{name} must be {self.kind}, got {_shown(exc.item)!r}") from None
        except ValueError as exc:
            if self.explains:
                raise ConfigError(f"{name}: {exc}") from None
            raise ConfigError(f"{name} must be {self.kind}, got {_shown(raw)!r}") from None


def _finite(raw: str) -> float:
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError(raw)
    return value


def _show_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


_BOOLS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


def _bool(raw: str) -> bool:
    value = _BOOLS.get(raw.strip().lower())
    if value is None:
        raise ValueError(raw)
    return value


TEXT: Kind[str] = Kind(str, "a string")
INT: Kind[int] = Kind(int, "an integer")
FLOAT: Kind[float] = Kind(_finite, "a number", show=_show_number)
BOOL: Kind[bool] = Kind(_bool, "one of 1/0, true/false, yes/no, on/off", show=lambda v: "1" if v else "0")
PORT_NUMBER: Kind[int] = Kind(int, "a port number")  # its range is the setting's bounds


def choice(*allowed: str, upper: bool = False) -> Kind[str]:
    """One of `allowed` (`upper`: case-insensitive, the value upper-cased)."""

    def parse(raw: str) -> str:
        value = raw.strip().upper() if upper else raw
        if value not in allowed:
            raise ValueError(raw)
        return value

    words = " or ".join(allowed) if len(allowed) == 2 else "one of " + ", ".join(allowed)
    return Kind(parse, words)


# -- the declaration ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setting(Generic[T]):
    """One setting, declared once. `read()` is its value from the environment; a CLI gets its
    flag from `add_flag`; --help and docs/configuration.md show `help` with `shown_default`."""

    env: str
    kind: Kind[T]
    default: T
    help: str
    flag: str | None = None  # the command-line flag that sets it too (it wins)
    metavar: str | None = None
    # Bounds (inclusive; `lo_open`: above lo). Outside them a value is moved to the bound, as the
    # relay always did, or, with `refuse`, refused: "NAME <refuse>", formatted with {value}.
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    refuse: str | None = None
    shown: str | None = None  # the default as shown, when it is not a value (derived, computed)
    secret: bool = False  # also NAME_FILE: a file holding the value (a mounted Secret; wins)
    field: str | None = None  # the settings dataclass's attribute ("limits.x": QueueLimits's)
    limit_key: str | None = None  # the RelayShard spec.limits key the operator maps onto it
    limit_scale: int = 1  # the variable is the key's value times this (seconds -> ms)

    @property
    def names(self) -> tuple[str, ...]:
        """Every variable it is read from (a secret's NAME_FILE too)."""
        return (self.env, f"{self.env}_FILE") if self.secret else (self.env,)

    @property
    def shown_default(self) -> str:
        if self.shown is not None:
            return self.shown
        return "none" if self.default is None else self.kind.show(self.default)

    @property
    def bounds(self) -> str:
        """The bounds as the docs show them ("" without)."""
        lo = None if self.lo is None else _show_number(self.lo)
        hi = None if self.hi is None else _show_number(self.hi)
        if lo is not None and hi is not None:
            return f"{lo}..{hi}"
        if lo is not None:
            return f"> {lo}" if self.lo_open else f">= {lo}"
        return "" if hi is None else f"<= {hi}"

    def read(self, default: T | None = None) -> T:
        """From the environment (checked and bounded), else `default` (if given) or the declared."""
        raw = env_secret(self.env) if self.secret else env_value(self.env)
        if raw is None:
            return self.default if default is None else default
        return self.parse(self.env, raw)

    def parse(self, name: str, raw: str) -> T:
        """`raw` as given for `name` (this variable, or its flag): ConfigError when bad."""
        return self.bounded(name, self.kind.read(name, raw))

    def bounded(self, name: str, value: T) -> T:
        number: Any = value
        low = self.lo is not None and (number <= self.lo if self.lo_open else number < self.lo)
        high = self.hi is not None and number > self.hi
        if not (low or high):
            return value
        if self.refuse is not None:
            raise ConfigError(f"{name} {self.refuse.format(value=value)}")
        bound: Any = type(number)(self.lo if low else self.hi)
        return bound  # type: ignore[no-any-return]


# -- flags ------------------------------------------------------------------------------------------


class _AddsArguments(Protocol):
    """A parser or one of its groups (argparse names no public type for both)."""

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action: ...


def flag_help(setting: Setting[Any], help: str | None = None) -> str:
    return f"{help or setting.help} [env {setting.env}; default {setting.shown_default}]"


def add_flag(
    parser: argparse.ArgumentParser, setting: Setting[Any], to: _AddsArguments | None = None
) -> None:
    """The setting's flag on `parser` (or its group `to`), its help naming variable and default;
    the value is resolved after parsing (`resolve_flags`), so a bad variable of another
    subcommand never matters."""
    assert setting.flag is not None, setting.env
    action = (to or parser).add_argument(
        setting.flag, default=None, metavar=setting.metavar, help=flag_help(setting)
    )
    flags = list(parser.get_default("env_flags") or [])
    flags.append((action.dest, setting))
    parser.set_defaults(env_flags=flags)


def resolve_flags(args: argparse.Namespace) -> None:
    """Fill every flag not given on the command line from its variable; a given one is checked by
    the same rule (ConfigError naming the flag or the variable)."""
    for dest, setting in getattr(args, "env_flags", None) or []:
        given = getattr(args, dest)
        if given is None:
            setattr(args, dest, setting.read())
        elif isinstance(given, str):
            setattr(args, dest, setting.parse(setting.flag, given))


# -- --help: every flag names its variable and default ---------------------------------------------

_NAMES_ENV = re.compile(r"\benv [A-Z][A-Z0-9_]+")


def env_help(action: argparse.Action) -> str | None:
    """`action`'s help with its variable and default named (argparse expands `%(default)s`).
    A help that already names its variable (`add_flag`'s `[env NAME; default X]`, or `(env NAME)`)
    is left alone; any other gets `[no env; default X]` (or `required` / `default off`)."""
    text = action.help
    if not text or not text.strip() or text == argparse.SUPPRESS or "[env " in text:
        return text  # no help line at all (as argparse shows it), or one naming its variable
    if not action.option_strings and action.nargs is None and action.default is None:
        return action.help  # a positional without a default: its help says what it is
    if "[no env" in text:
        return text
    parts = [] if _NAMES_ENV.search(text) else ["no env"]
    if action.required:
        parts.append("required")
    elif action.nargs == 0:
        parts.append("default off")
    elif "default" not in text:
        none = action.default is None or action.default == argparse.SUPPRESS or action.default == []
        parts.append("default none" if none else "default %(default)s")
    return f"{text} [{'; '.join(parts)}]".lstrip() if parts else text


class EnvHelpParser(argparse.ArgumentParser):
    """An ArgumentParser whose flags (its own and its groups') get `env_help` as their help, and
    which keeps each flag with the help it was written with (`flags_as_written`, for tests that
    hold the code to naming every variable itself)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.flags_as_written: list[tuple[argparse.Action, str | None]] = []
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        return self._annotated(super().add_argument, *args, **kwargs)

    def _annotated(self, add: Callable[..., argparse.Action], *args: Any, **kwargs: Any) -> argparse.Action:
        action = add(*args, **kwargs)
        if kwargs.get("action") != "help":  # -h: argparse's own words
            self.flags_as_written.append((action, action.help))
            action.help = env_help(action)
        return action

    # argparse's groups add their flags themselves: theirs are annotated the same way
    def add_argument_group(self, *args: Any, **kwargs: Any) -> Any:
        return self._annotating(super().add_argument_group(*args, **kwargs))

    def add_mutually_exclusive_group(self, **kwargs: Any) -> Any:
        return self._annotating(super().add_mutually_exclusive_group(**kwargs))

    def _annotating(self, group: Any) -> Any:
        add = group.add_argument
        group.add_argument = lambda *args, **kwargs: self._annotated(add, *args, **kwargs)
        return group


def epilog(title: str, settings: Iterable[Setting[Any]], removed: Mapping[str, str] | None = None) -> str:
    """The environment section of --help: every variable with its default (a secret's NAME_FILE
    on a line of its own), the deprecated names of these variables, and `removed` ones."""
    rows: list[tuple[str, str]] = []
    for s in settings:
        rows.append((s.env, f"{s.help} [default {s.shown_default}]"))
        if s.secret:
            rows.append((f"{s.env}_FILE", f"a file holding {s.env} (a mounted Secret; wins) [default none]"))
    width = max(len(name) for name, _ in rows)
    lines = [title, *(f"  {name:<{width}}  {text}" for name, text in rows)]
    ours = {name for name, _ in rows}
    old = [(o, n) for o, n in DEPRECATED_ENV.items() if n in ours]
    if old:
        lines.append("deprecated names (still read, with a warning in the log):")
        lines += [f"  {o} -> {n}" for o, n in old]
    if removed:
        lines.append("removed names (ignored, with a warning in the log; docs/upgrade.md):")
        lines += [f"  {name}: {why}" for name, why in removed.items()]
    return "\n".join(lines)


# -- docs/configuration.md --------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table(settings: Sequence[Setting[Any]]) -> str:
    """One row per variable: the variable, its flag, default, bounds and help."""
    lines = ["| variable | flag | default | bounds | what it sets |", "|---|---|---|---|---|"]
    for s in settings:
        flag = f"`{s.flag}`" if s.flag else ""
        bounds = s.bounds + (" (else refused)" if s.refuse and s.bounds else "")
        names = " / ".join(f"`{n}`" for n in s.names)
        lines.append(f"| {names} | {flag} | `{_cell(s.shown_default)}` | {_cell(bounds)} | {_cell(s.help)} |")
    return "\n".join(lines)
