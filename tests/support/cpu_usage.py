"""Pytest plugin: the CPU seconds each test costs, its processes' included (`--cpu-report=DIR`).

Wall time on a shared 2-core machine says more about the neighbours than about the test; what
the suite's length is made of is CPU work divided by the cores. A test's CPU here is that of
the pytest process itself, of the children it reaped (resource.RUSAGE_CHILDREN) and of the
descendants still running (/proc), taken before and after the test's setup, call and teardown:
a server a fixture starts is paid by the test that starts it and the one that stops it.
Each process (an xdist worker or a lone pytest) writes DIR/<worker>.json: its start-up (the
interpreter, the imports, the collection), each test's CPU and wall seconds, and its total.
`python -m tests.support.cpu_usage DIR` sums them up.
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


class _Processes:
    """The CPU of this process's descendants, and of the daemons its tests start (kwokctl's
    control plane runs under init: a process whose command line names the worker's
    temporary directory is counted too). A process once counted stays counted until it ends;
    one that ends under init (a JVM its Python driver left behind) takes its seconds along, so
    they are kept here, as last seen: a thread looks every SAMPLE_S."""

    SAMPLE_S = 0.5

    def __init__(self, marker: str) -> None:
        self.marker = marker.encode()
        self.seen: dict[int, tuple[int, float]] = {}  # pid -> (parent, CPU seconds)
        self.ended = 0.0
        self.lock = threading.Lock()
        threading.Thread(target=self._sample, name="cpu-usage", daemon=True).start()

    def _sample(self) -> None:
        while True:
            time.sleep(self.SAMPLE_S)
            self.cpu()

    def cpu(self) -> float:
        with self.lock:
            return self._cpu()

    def _cpu(self) -> float:
        parent: dict[int, int] = {}
        cpu: dict[int, float] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    stat = f.read()
                fields = stat[stat.rindex(b")") + 2 :].split()
                parent[pid] = int(fields[1])
                cpu[pid] = sum(int(x) for x in fields[11:15]) / _TICK  # utime stime cutime cstime
                if parent[pid] == 1 and pid not in self.seen and self.marker:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if self.marker in f.read():
                            self.seen[pid] = (1, 0.0)  # counted from now on
            except (OSError, ValueError):
                continue  # ended meanwhile
        children: dict[int, list[int]] = {}
        for pid, pp in parent.items():
            children.setdefault(pp, []).append(pid)
        me = os.getpid()
        counted: set[int] = set()
        todo = children.get(me, []) + [p for p in self.seen if p in cpu]
        while todo:
            pid = todo.pop()
            if pid not in counted and pid in cpu:
                counted.add(pid)
                todo.extend(children.get(pid, ()))
        gone = {pid: seen for pid, seen in self.seen.items() if pid not in counted}
        for pid, (was_parent, seconds) in gone.items():
            del self.seen[pid]
            # reaped by this process (RUSAGE_CHILDREN has it) or by one counted here (its
            # cutime has it), or else by init: then its seconds would be lost
            if was_parent != me and was_parent not in counted and was_parent not in gone:
                self.ended += seconds
        for pid in counted:
            self.seen[pid] = (parent[pid], cpu[pid])
        return self.ended + sum(cpu[p] for p in counted)


def cpu_seconds(processes: _Processes | None = None) -> float:
    """This process's CPU, its reaped children's and (with `processes`) the rest of its own."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = me.ru_utime + me.ru_stime + reaped.ru_utime + reaped.ru_stime
    return own + (processes.cpu() if processes is not None else 0.0)


def _process_age() -> float:
    """Wall seconds since this process started."""
    with open("/proc/self/stat", "rb") as f:
        stat = f.read()
    start_ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / _TICK


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-report",
        metavar="DIR",
        default=None,
        # as --cpu-report=DIR: a DIR of its own, before the plugin is loaded, reads as a test path
        help="write each test's CPU seconds (its processes' included) to DIR/<worker>.jsonl",
    )


class _Recorder:
    """Appends one line per test to DIR/<worker>.jsonl as it ends (a run cut short keeps what
    it measured): {"test": node id, "cpu": s, "wall": s, "outcome": passed|failed|error|skipped},
    and the process's own lines {"worker": id, "phase": "collected" | "end", "cpu": s, "wall": s
    since it started}."""

    def __init__(self, out: Path, worker: str) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / f"{worker}.jsonl"
        self.worker = worker
        self.processes = _Processes("")
        self.outcome = "passed"

    def write(self, line: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def phase(self, name: str) -> None:
        self.write(
            {"worker": self.worker, "phase": name, "cpu": cpu_seconds(self.processes), "wall": _process_age()}
        )

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self) -> None:
        self.phase("collected")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed or (report.skipped and report.when != "teardown"):
            self.outcome = "error" if report.failed and report.when != "call" else report.outcome

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        self.outcome = "passed"
        cpu, wall = cpu_seconds(self.processes), time.monotonic()
        yield
        took = cpu_seconds(self.processes) - cpu
        wall = time.monotonic() - wall
        self.write(
            {"test": item.nodeid, "cpu": round(took, 3), "wall": round(wall, 3), "outcome": self.outcome}
        )

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self) -> None:  # after the session fixtures' teardown
        self.phase("end")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    out = config.getoption("cpu_report")
    if not out:
        return
    workerinput = getattr(config, "workerinput", None)
    # the xdist controller runs no test; its "end" CPU is the run's (its workers are its children)
    worker = workerinput["workerid"] if workerinput else "main"
    config.pluginmanager.register(_Recorder(Path(out), worker), "relayfleet-cpu-usage")


@pytest.fixture(scope="session", autouse=True)
def _cpu_usage_marker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The daemons a test starts name the run's temporary directory."""
    recorder = request.config.pluginmanager.get_plugin("relayfleet-cpu-usage")
    if isinstance(recorder, _Recorder):
        recorder.processes.marker = f"{tmp_path_factory.getbasetemp()}/".encode()


def _summary(out: Path, top: int) -> None:
    tests: dict[str, tuple[float, float]] = {}
    outcomes: dict[str, str] = {}
    for path in sorted(out.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "test" in row:
                tests[row["test"]] = (row["cpu"], row["wall"])
                outcomes[row["test"]] = row.get("outcome", "")
            else:
                who, phase = row["worker"], row["phase"]
                print(f"{who:>5} {phase:>9}: {row['cpu']:7.1f} s CPU, {row['wall']:7.1f} s wall")
    cpu = sum(c for c, _ in tests.values())
    print(f"tests: {len(tests)}, {cpu:.0f} s CPU, {sum(w for _, w in tests.values()):.0f} s wall (summed)")
    for nodeid, (c, w) in sorted(tests.items(), key=lambda t: -t[1][0])[:top]:
        mark = "" if outcomes[nodeid] in ("passed", "") else f"  ({outcomes[nodeid]})"
        print(f"{c:7.1f} s CPU {w:7.1f} s wall  {nodeid}{mark}")


if __name__ == "__main__":
    import sys

    _summary(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 30)
