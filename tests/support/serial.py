"""Pytest plugin: a test marked `serial` runs alone, with no other test of the run going on in
another pytest-xdist worker meanwhile (it measures CPU time or throughput, which a neighbour
on a 2-core machine would take). Every other test runs in parallel as usual.

A reader-writer lock between the workers, on two lock files of the run: a test holds the run
lock shared while it sets up, runs and tears down; a serial test holds it exclusively. A
serial test first takes the gate, so that no worker starts a new test while it waits for the
running ones to finish (writer preference: it is not starved).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

MARKER = "serial"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}: runs alone, no test in another xdist worker meanwhile (it measures CPU, time)"
    )


def _lock_dir(config: pytest.Config) -> Path | None:
    """The run's lock directory, shared by its workers; None outside pytest-xdist."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return None
    path = Path(tempfile.gettempdir()) / f"relayfleet-serial-{workerinput['testrunuid']}"
    path.mkdir(exist_ok=True)
    return path


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    where = _lock_dir(item.config)
    if where is None:
        yield
        return
    alone = item.get_closest_marker(MARKER) is not None
    gate = os.open(where / "gate", os.O_RDWR | os.O_CREAT, 0o600)
    run = os.open(where / "run", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if alone:
            fcntl.flock(gate, fcntl.LOCK_EX)  # no new test starts elsewhere ...
            fcntl.flock(run, fcntl.LOCK_EX)  # ... and the running ones have finished
        else:
            fcntl.flock(gate, fcntl.LOCK_SH)  # waits while a serial test is waiting or running
            fcntl.flock(run, fcntl.LOCK_SH)
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield
    finally:
        os.close(run)  # closing a descriptor releases its locks
        os.close(gate)
