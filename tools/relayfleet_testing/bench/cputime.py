"""CPU time of process trees from /proc: what a server and its Redis spend per message.

On a shared machine throughput follows everyone else's load; the CPU a process spends
per answered request moves much less. A process tree's CPU is counted as utime + stime
of the root and every live descendant, plus cutime + cstime of each (children it has
already reaped), so a fork that ends between two readings (Redis's AOF rewrite, an
nginx worker) moves its time from one term to the other instead of vanishing.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

from relayfleet_testing.bench.procs import child_pids

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        # the command name (field 2) may hold spaces and parentheses: split after its last ")"
        return f.read().rpartition(")")[2].split()


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads); fields 14 and 15 of proc(5)."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of ``pid``, plus the same of every live descendant.

    0 when the process is gone (a stopped server contributes nothing further).
    """
    try:
        fields = _stat_fields(pid)
    except (OSError, ValueError):
        return 0.0
    own = sum(int(fields[i]) for i in (11, 12, 13, 14)) * _TICK_S  # utime stime cutime cstime
    return own + sum(tree_cpu_seconds(child) for child in child_pids(pid))


def total_cpu_seconds(pids: Iterable[int]) -> float:
    return sum(tree_cpu_seconds(p) for p in pids)


@dataclass(frozen=True)
class CpuWindow:
    """CPU seconds a server and its Redis spent between two readings, and per message."""

    server_s: float
    redis_s: float
    messages: int

    def per_message_us(self) -> tuple[float, float, float]:
        """(server, Redis, total) µs per message; NaN without messages."""
        if self.messages <= 0:
            nan = float("nan")
            return nan, nan, nan
        server = self.server_s / self.messages * 1e6
        redis = self.redis_s / self.messages * 1e6
        return server, redis, server + redis

    def values(self) -> dict[str, float]:
        """The Row values of one enqueue run."""
        server, redis, total = self.per_message_us()
        return {"server_cpu_us": server, "redis_cpu_us": redis, "cpu_us": total}


def machine_busy_seconds() -> float:
    """CPU seconds every core of this machine has been busy (or stolen by the hypervisor)
    since boot: /proc/stat's first line less idle and iowait."""
    with open("/proc/stat", encoding="ascii") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) * _TICK_S


def own_seconds() -> float:
    """CPU of this process and of the children it has reaped (the load generators)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class ForeignLoad:
    """The CPU that no process of a measurement spent over its window: the neighbours' load
    on a shared machine, which is what makes two runs seconds apart disagree."""

    def __init__(self, pids: Iterable[int]) -> None:
        self._pids = list(pids)
        self._start = self._reading()
        self._wall = time.monotonic()

    def _reading(self) -> tuple[float, float]:
        return machine_busy_seconds(), own_seconds() + total_cpu_seconds(self._pids)

    def seconds(self) -> float:
        """Foreign CPU seconds since construction (≥ 0; /proc counts 10 ms ticks)."""
        busy, ours = self._reading()
        return max(0.0, (busy - self._start[0]) - (ours - self._start[1]))

    def cores(self) -> float:
        """The foreign CPU since construction as cores kept busy on average: over this window's
        own wall time, not the load generator's (its run is shorter than the window around it,
        and a busy machine's neighbours filled the difference, reading as more cores than exist)."""
        elapsed = time.monotonic() - self._wall
        return self.seconds() / elapsed if elapsed > 0 else math.nan
