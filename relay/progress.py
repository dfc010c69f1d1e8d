"""Progress on stderr for the commands users wait on (`relayfleet migrate`, `backup`, `restore`).

Work reports progress as fast as it happens; `ProgressReporter.due` thins it to what a person
can read: the first report, the last, a new phase, and otherwise one every few seconds (every
0.1 s when the line is redrawn in place on a terminal) or every few percent.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Collection
from typing import TextIO

__all__ = ["ProgressReporter", "mib"]


class ProgressReporter:
    """One command's progress lines on `stream` (stderr by default).

    With `redraw` the line is rewritten in place when the stream is a terminal; otherwise (and
    always when it is not) each report is a line of its own. As a callable it reports
    `(phase, done, total)`: counts, or MiB for the phases in `byte_phases`.
    """

    def __init__(
        self,
        command: str,
        quiet: bool = False,
        *,
        stream: TextIO | None = None,
        redraw: bool = False,
        every_s: float = 2.0,
        every_pct: int | None = 10,
        byte_phases: Collection[str] = (),
    ) -> None:
        self.command = command
        self.quiet = quiet
        self._stream = stream
        self.redraw = redraw and self.stream.isatty()
        self.every_s = 0.1 if self.redraw else every_s
        self.every_pct = every_pct
        self.byte_phases = frozenset(byte_phases)
        self._phase: str | None = None
        self._at = 0.0
        self._pct = -100

    @property
    def stream(self) -> TextIO:
        # sys.stderr when it is written to, not when constructed (pytest swaps it per test)
        return self._stream if self._stream is not None else sys.stderr

    def due(self, phase: str, pct: int = 0, final: bool = False) -> bool:
        """Whether this report is to be shown; True also records it as the last one shown."""
        now = time.monotonic()
        if (
            not final
            and phase == self._phase
            and now - self._at < self.every_s
            and (self.every_pct is None or pct - self._pct < self.every_pct)
        ):
            return False
        self._phase, self._at, self._pct = phase, now, pct
        return True

    def show(self, line: str, final: bool = False) -> None:
        """Write a whole line (in place when redrawing: `final` ends it)."""
        if self.quiet:
            return
        if self.redraw:
            self.stream.write("\r" + line + "\033[K" + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def say(self, text: str) -> None:
        """A line of its own, after the command's name."""
        self.show(f"{self.command}: {text}", final=True)

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        pct = int(100 * done / total) if total else 0
        if not self.due(phase, pct, final=done == total):
            return
        if total and phase in self.byte_phases:
            self.say(f"{phase} {mib(done)}/{mib(total)} MiB ({pct}%)")
        elif total:
            self.say(f"{phase} {done}/{total} ({pct}%)")
        else:
            self.say(f"{phase} ...")


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"
