"""--help text that always says where a flag's value comes from and what it is by default.

Every `relayfleet` subcommand's parser is an EnvHelpParser: each flag's help is annotated when
the flag is added (argparse's public `add_argument`, on the parser or one of its groups). A help
that already names its variable (`[env RELAY_PORT; default 8080]`, written by relay/cli.py's
`_flag`, or `(env NAME)`) is left alone; any other gets `[no env; default X]` (or `required` /
`default off`) appended, so no flag's help leaves the reader guessing (docs/api.md, "Command line").
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

_NAMES_ENV = re.compile(r"\benv [A-Z][A-Z0-9_]+")


def env_help(action: argparse.Action) -> str | None:
    """`action`'s help with its variable and default named (argparse expands `%(default)s`)."""
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
