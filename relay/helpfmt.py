"""--help text that always says where a flag's value comes from and what it is by default.

Every `relayfleet` subcommand's parser uses EnvHelpFormatter: a flag whose help already names
its variable (`[env RELAY_PORT; default 8080]`, written by relay/cli.py's `_flag`, or
`(env NAME)`) is left alone; any other gets `[no env; default X]` (or `required` / `default off`)
appended, so no flag's help leaves the reader guessing (docs/api.md, "Command line").
"""

from __future__ import annotations

import argparse
import re

_NAMES_ENV = re.compile(r"\benv [A-Z][A-Z0-9_]+")


class EnvHelpFormatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if text == argparse.SUPPRESS or isinstance(action, argparse._HelpAction) or "[env " in text:
            return action.help
        if not action.option_strings and action.nargs is None and action.default is None:
            return action.help  # a subcommand's line in the command list: its own --help tells
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
