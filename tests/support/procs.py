"""Stopping a test's subprocess the way its supervisor would."""

from __future__ import annotations

import subprocess
from typing import Any


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
