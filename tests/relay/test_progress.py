"""The one progress reporter behind `relayfleet migrate`, `backup` and `restore` (relay/progress.py)."""

from __future__ import annotations

import io

import pytest

from relay import progress as P
from relay.fleet.migration.command import ProgressBar
from relay.fleet.migration.report import Progress


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr("relay.progress.time.monotonic", c)
    return c


def _step(done: int, phase: str = "copy") -> Progress:
    return Progress(
        slots_done=done, slots_total=4, keys=done * 10, bytes=done * 2_000_000, elapsed_s=2.0, phase=phase
    )


def test_migration_bar_redraws_in_place_on_a_terminal(clock: _Clock) -> None:
    out = _Tty()
    bar = ProgressBar("b", stream=out, width=4)
    bar(_step(1))
    bar(_step(2))  # within 0.1 s: thinned
    clock.now += 0.2
    bar(_step(3))
    bar(_step(4, "done"))  # the last one always shows, and ends the line
    assert out.getvalue() == (
        "\rmigrate -> b [#...] 1/4 slots  10 keys  2.0 MB  1.0 MB/s  copy\033[K"
        "\rmigrate -> b [###.] 3/4 slots  30 keys  6.0 MB  3.0 MB/s  copy\033[K"
        "\rmigrate -> b [####] 4/4 slots  40 keys  8.0 MB  4.0 MB/s  done\033[K\n"
    )


def test_migration_bar_writes_a_line_every_two_seconds_elsewhere(clock: _Clock) -> None:
    out = io.StringIO()
    bar = ProgressBar("b", stream=out, width=4)
    bar(_step(1))
    clock.now += 1.0
    bar(_step(2))
    clock.now += 1.5
    bar(_step(3))
    bar(_step(4, "done"))
    assert [line.split("]")[1].split("slots")[0].strip() for line in out.getvalue().splitlines()] == [
        "1/4",
        "3/4",
        "4/4",
    ]


def test_phase_reports_show_each_phase_every_ten_percent_and_the_end(
    clock: _Clock, capsys: pytest.CaptureFixture[str]
) -> None:
    report = P.ProgressReporter("backup", byte_phases={"sending"})
    for done in range(0, 101, 5):
        report("sending", done * 2**20, 100 * 2**20)
    report("new epochs, slots", 1, 3)
    clock.now += 2.5
    report("new epochs, slots", 2, 3)
    report("loading", 0, None)
    report.say("done")
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        *(f"backup: sending {p:.1f}/100.0 MiB ({p}%)" for p in range(0, 101, 10)),
        "backup: new epochs, slots 1/3 (33%)",
        "backup: new epochs, slots 2/3 (66%)",
        "backup: loading ...",
        "backup: done",
    ]


def test_quiet_writes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    report = P.ProgressReporter("restore", quiet=True)
    report("loaded", 1, 1)
    report.say("done")
    assert capsys.readouterr() == ("", "")
