"""Test hook: the named protocol steps at which `relayfleet migrate` can be made to die like
a killed process (tests/relay/fleet/test_migration_crash.py kills it at each one and reruns it)."""

from __future__ import annotations

import os
import sys

__all__ = ["CRASH_ENV", "CRASH_EXIT", "STEPS", "crash_point"]

CRASH_ENV = "RELAYFLEET_MIGRATION_CRASH_AT"
# Points the test hook can stop the process at, in protocol order.
STEPS = ("fenced", "mid-copy", "copied", "mid-flip", "flipped", "published", "woken", "mid-cleanup")
CRASH_EXIT = 86


def crash_point(step: str) -> None:
    """Test hook: die here, like a killed process, when the environment asks for it."""
    if os.environ.get(CRASH_ENV) == step:
        sys.stderr.write(f"\nrelayfleet migrate: {CRASH_ENV}={step}: exiting now\n")
        sys.stderr.flush()
        os._exit(CRASH_EXIT)
