"""Stopping a test's subprocess the way its supervisor would."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

# `relayfleet` run as a subprocess by this interpreter: the checkout first on its path, not the
# installed console script (an editable install may point at another tree)
RELAYFLEET = (sys.executable, "-c", "import sys; from relay.cli import main; sys.exit(main())")


def stop_process(proc: subprocess.Popen[Any] | None, grace: float, kill_wait: float | None = 5.0) -> None:
    """SIGTERM and up to `grace` s for the exit; then SIGKILL and up to `kill_wait` s (None: no
    limit). Nothing when it has exited already (or there is none)."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(kill_wait)
