"""Waiting for a condition with a deadline, instead of sleeping a fixed time: as short as the
machine allows when it is quiet, as long as it needs (up to the deadline) when it is loaded."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T | None], timeout: float = 90.0, interval: float = 0.5) -> T:
    """`check()`'s first truthy value, tried every `interval` s; fails the test after `timeout` s
    (a kubectl that fails meanwhile counts as not yet, its stderr is shown then)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            result = check()
        except subprocess.CalledProcessError as exc:
            result, last = None, exc.stderr
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}" + (f": {last}" if last else ""))
        time.sleep(interval)


async def until(
    what: str, check: Callable[[], object], timeout: float = 10.0, interval: float = 0.05
) -> None:
    """The asyncio form of `wait_for`, for a condition only: `check` may be a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(interval)
