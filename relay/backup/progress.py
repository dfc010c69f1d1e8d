"""Progress lines on stderr for `relayfleet backup` and `relayfleet restore`."""

from __future__ import annotations

import sys
import time

__all__ = ["Reporter", "mib"]


class Reporter:
    """Progress lines on stderr: each phase once, then at most every 2 s or 10 %."""

    def __init__(self, command: str, quiet: bool = False) -> None:
        self.command = command
        self.quiet = quiet
        self._phase = ""
        self._at = 0.0
        self._pct = -100

    def say(self, text: str) -> None:
        if not self.quiet:
            print(f"{self.command}: {text}", file=sys.stderr, flush=True)

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        now = time.monotonic()
        pct = int(100 * done / total) if total else 0
        if phase == self._phase and now - self._at < 2 and pct - self._pct < 10 and done != total:
            return
        self._phase, self._at, self._pct = phase, now, pct
        if total and phase in _BYTE_PHASES:
            self.say(f"{phase} {mib(done)}/{mib(total)} MiB ({pct}%)")
        elif total:
            self.say(f"{phase} {done}/{total} ({pct}%)")
        else:
            self.say(f"{phase} ...")


_BYTE_PHASES = {"snapshot", "sending", "loaded"}


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"
