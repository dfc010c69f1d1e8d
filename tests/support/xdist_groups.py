"""Pytest plugin: `--dist loadgroup` that keeps the tests of one `xdist_group` on one worker.

pytest-xdist 3.8 groups by a suffix it writes into each test's node id, which pytest 9 no
longer takes (the id is a structure of its own now): the marks were ignored and a group's
tests went to every worker, each then starting its own control plane, JVM or agents (and the
agent tests, which build on each other, failed). Here each worker writes the groups it
collected (node id -> group) to a file of the run, and the controller's scheduler, xdist's
own scope scheduler, reads its work units from it: a group is one unit, any other test a unit
of its own. Every worker collects the same tests, so any worker's file is the run's.

The work units go out longest first (tests/durations.json: each slow test's seconds in a
measured run; `--store-durations` refreshes it), not xdist's most-tests-first: a 40 s test
handed out last would leave the other workers idle at the end. A `serial` test goes last of
all: it waits for whatever runs elsewhere to end, and at the end that is short. A group whose
tests share a control plane can be split in parts (tests/support/durations.py, `split_group`),
each part a unit that starts its own on the worker it lands on.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support.durations import DEFAULT_SECONDS, DURATIONS, STORED_FROM, load_durations


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--store-durations",
        action="store_true",
        default=False,
        help=f"write each test's seconds (those of {STORED_FROM:g} s or more) to tests/durations.json",
    )


def _groups_file(run: str) -> Path:
    return Path(tempfile.gettempdir()) / f"relayfleet-xdist-groups-{run}.json"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """On the controller: name the run up front (its workers get the same id), so the
    scheduler finds the file its workers write; record the durations if asked."""
    if hasattr(config, "workerinput"):
        return
    if config.getoption("store_durations"):
        config.pluginmanager.register(_DurationRecorder(), "relayfleet-durations")
    if not config.pluginmanager.hasplugin("xdist"):
        return
    if config.getoption("testrunuid", None) is None:
        config.option.testrunuid = uuid.uuid4().hex


@pytest.hookimpl(trylast=True)  # after tests/conftest.py marked the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if workerinput is None:
        return
    groups = {}
    last = []
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        if mark is not None:
            groups[item.nodeid] = str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
        if item.get_closest_marker("serial") is not None:  # tests/support/serial.py
            last.append(item.nodeid)
    final = _groups_file(workerinput["testrunuid"])
    partial = final.with_name(f"{final.name}.{workerinput['workerid']}")
    partial.write_text(json.dumps({"groups": groups, "last": last}))
    os.replace(partial, final)  # whole, never half-written


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own LoadGroupScheduling
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    groups_file = _groups_file(str(config.getoption("testrunuid")))

    seconds = load_durations()

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's scope scheduler, its scopes being our groups, the longest unit handed out first."""

        groups: dict[str, str] | None = None
        last: frozenset[str] = frozenset()
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # read once every worker has collected (and written it)
                found = json.loads(groups_file.read_text()) if groups_file.exists() else {}
                self.groups = found.get("groups", {})
                self.last = frozenset(found.get("last", ()))
            return self.groups.get(nodeid, nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:  # the first hand-out: schedule() has filled the queue
                self.ordered = True

                # A `serial` test waits for every running test to end, holding the others back
                # meanwhile: last, when what still runs is short, not beside a long group.
                def order(unit: tuple[str, dict[str, bool]]) -> tuple[bool, float]:
                    nodeids = unit[1]
                    alone = any(n in self.last for n in nodeids)
                    return alone, -sum(seconds.get(n, DEFAULT_SECONDS) for n in nodeids)

                units = sorted(self.workqueue.items(), key=order)
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    return GroupScheduling(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist"):
        return
    run = config.getoption("testrunuid", None)
    if run is not None:
        _groups_file(str(run)).unlink(missing_ok=True)


class _DurationRecorder:
    """Sums each test's setup, call and teardown seconds as the reports arrive (on the
    controller under pytest-xdist) and merges them into tests/durations.json at the end."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.seconds:
            return
        kept = {n: s for n, s in load_durations().items() if n not in self.seconds}
        kept.update({n: s for n, s in self.seconds.items() if s >= STORED_FROM})
        DURATIONS.write_text(json.dumps({n: round(kept[n], 1) for n in sorted(kept)}, indent=0) + "\n")
