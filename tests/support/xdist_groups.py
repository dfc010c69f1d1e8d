"""Pytest plugin: `--dist loadgroup` that keeps the tests of one `xdist_group` on one worker.

pytest-xdist 3.8 groups by a suffix it writes into each test's node id, which pytest 9 no
longer takes (the id is a structure of its own now): the marks were ignored and a group's
tests went to every worker, each then starting its own control plane, JVM or agents (and the
agent tests, which build on each other, failed). Here each worker writes the groups it
collected (node id -> group) to a file of the run, and the controller's scheduler, xdist's
own scope scheduler, reads its work units from it: a group is one unit, any other test a unit
of its own. Every worker collects the same tests, so any worker's file is the run's.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest


def _groups_file(run: str) -> Path:
    return Path(tempfile.gettempdir()) / f"relayfleet-xdist-groups-{run}.json"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """On the controller: name the run up front (its workers get the same id), so the
    scheduler finds the file its workers write."""
    if hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist"):
        return
    if config.getoption("testrunuid", None) is None:
        config.option.testrunuid = uuid.uuid4().hex


@pytest.hookimpl(trylast=True)  # after tests/conftest.py marked the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if workerinput is None:
        return
    groups = {}
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        if mark is not None:
            groups[item.nodeid] = str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    final = _groups_file(workerinput["testrunuid"])
    partial = final.with_name(f"{final.name}.{workerinput['workerid']}")
    partial.write_text(json.dumps(groups))
    os.replace(partial, final)  # whole, never half-written


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own LoadGroupScheduling
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    groups_file = _groups_file(str(config.getoption("testrunuid")))

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's scope scheduler, its scopes being our groups (largest first)."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # read once every worker has collected (and written it)
                self.groups = json.loads(groups_file.read_text()) if groups_file.exists() else {}
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist"):
        return
    run = config.getoption("testrunuid", None)
    if run is not None:
        _groups_file(str(run)).unlink(missing_ok=True)
