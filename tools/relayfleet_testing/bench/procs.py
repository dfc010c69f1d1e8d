"""Child processes of a benchmark run: started with a death signal, stopped by pid, always.

Every server and load generator the bench starts goes through :class:`Procs`, so one
``finally`` stops all of them, even on errors or Ctrl-C. Children also get
``PR_SET_PDEATHSIG`` so a SIGKILLed bench does not leave servers behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import resource
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from relay.retrying import READY_POLL, retrying

_PR_SET_PDEATHSIG = 1


class BenchError(Exception):
    """A benchmark step failed for a reason worth one clear line (no traceback)."""


def _set_pdeathsig() -> None:
    # Runs in the child between fork and exec: the kernel sends SIGTERM when the
    # bench dies, so no server outlives a killed bench.
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        ctypes.CDLL(libc_name, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def raise_nofile_limit() -> int:
    """Raise the soft open-files limit to the hard one (children inherit it); return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def rss_kib(pid: int) -> int:
    """Resident set size of one process in KiB (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return 0
    return 0


def child_pids(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            path = f"/proc/{pid}/task/{task}/children"
            # a thread may end between the listing and the read: skip it, keep the others
            with contextlib.suppress(OSError), open(path, encoding="ascii") as f:
                out.extend(int(p) for p in f.read().split())
    return out


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    out_path: Path

    def output(self) -> str:
        """What the child wrote to stdout (the log itself unless started with capture=True)."""
        try:
            return self.out_path.read_bytes().decode(errors="replace")
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


# Each child starts a session of its own, and so (Linux with autogroup scheduling) a
# scheduling group of its own, which competes with every other session's group as an equal
# whatever its processes' nice: the nice-10/19 test suites of others on a shared machine take
# as much CPU from a measured server as a nice-0 process would, and whichever side of a head
# to head runs while they do loses. The bench commands give every child's group this nice
# instead (the same for every target, the servers, Redis and the load generators alike), so
# the neighbours' niced work yields to the measurement as it means to; 0 leaves the groups
# as they are.
GROUP_NICE_ENV = "RELAYFLEET_BENCH_GROUP_NICE"
DEFAULT_GROUP_NICE = -10


def group_nice() -> int:
    """The scheduling-group nice the bench commands start their children with."""
    text = os.environ.get(GROUP_NICE_ENV, "").strip()
    try:
        return max(-20, min(19, int(text))) if text else DEFAULT_GROUP_NICE
    except ValueError:
        return DEFAULT_GROUP_NICE


def set_group_nice(pid: int, nice: int) -> bool:
    """Set the nice of ``pid``'s autogroup (proc(5) /proc/PID/autogroup); False where the
    kernel has no autogroups or this process may not (a negative nice needs CAP_SYS_NICE)."""
    try:
        with open(f"/proc/{pid}/autogroup", "w", encoding="ascii") as f:
            f.write(str(nice))
    except OSError:
        return False
    return True


class Procs:
    """Owns every child process of a run; :meth:`stop_all` ends each one by its pid."""

    def __init__(self, workdir: Path, group_nice: int = 0) -> None:
        self.workdir = workdir
        self._children: list[Child] = []
        self._seq = 0
        self.group_nice = group_nice  # each child's scheduling group's (GROUP_NICE_ENV); 0: unchanged
        self.group_nice_refused = False  # some child's group kept its nice (see GROUP_NICE_ENV)

    def start(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        capture: bool = False,
    ) -> Child:
        """Start a child; stderr (and stdout) go to a log file, stdout to its own file with capture=True.

        Files, not pipes: a child writing more than a pipe holds while nobody reads would block.
        """
        self._seq += 1
        log_path = self.workdir / f"{self._seq:03d}-{name}.log"
        out_path = log_path.with_suffix(".out") if capture else log_path
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        with open(log_path, "wb") as log, open(out_path, "ab") as out:
            try:
                popen = subprocess.Popen(
                    list(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=log,
                    env=full_env,
                    cwd=str(cwd) if cwd else None,
                    preexec_fn=_set_pdeathsig,
                    # own session: a terminal's Ctrl-C reaches only the bench, which then
                    # stops children in order (servers after their load generators)
                    start_new_session=True,
                )
            except OSError as exc:
                raise BenchError(f"cannot start {name} ({argv[0]}): {exc.strerror}") from None
        if self.group_nice and not set_group_nice(popen.pid, self.group_nice):
            self.group_nice_refused = True
        child = Child(name, popen, log_path, out_path)
        self._children.append(child)
        return child

    def stop(self, child: Child, timeout: float = 5.0) -> None:
        """SIGTERM by pid, SIGKILL after ``timeout``; always reaps."""
        if child.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGTERM)
            try:
                child.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGKILL)
                child.popen.wait()
        if child in self._children:
            self._children.remove(child)

    def stop_all(self) -> None:
        # newest first: load generators before the servers they talk to
        for child in reversed(list(self._children)):
            self.stop(child)

    def running(self) -> list[Child]:
        return [c for c in self._children if c.alive()]

    def __enter__(self) -> Procs:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop_all()


async def wait_exit(child: Child, within: float) -> int:
    """Wait for a child to exit on its own (a load generator run); kill it past ``within`` s."""
    deadline = time.monotonic() + within
    while child.popen.poll() is None:
        if time.monotonic() > deadline:
            raise BenchError(f"{child.name} did not finish within {within:.0f} s")
        await asyncio.sleep(0.02)
    return child.popen.returncode


async def wait_port(port: int, child: Child, within: float = 20.0) -> None:
    """Wait until something accepts TCP connections on 127.0.0.1:port; fail fast if the child died."""

    async def connect() -> None:
        if not child.alive():  # not retried: fails at once
            raise BenchError(
                f"{child.name} exited with status {child.popen.returncode} before listening:\n"
                + child.log_tail()
            )
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()

    deadline = asyncio.get_running_loop().time() + within
    try:
        await retrying(READY_POLL, OSError, deadline=deadline)(connect)
    except OSError:
        raise BenchError(f"{child.name} did not listen on port {port} within {within:.0f} s") from None
