"""Sampling profiles of a running server with py-spy, and a plain-text summary of them.

py-spy attaches to the pid from outside (no code change, no restart). Output is the
collapsed-stack text format, which speedscope and flamegraph.pl both read.
"""

from __future__ import annotations

import shutil
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from relayfleet_testing.bench.procs import BenchError, Procs, wait_exit


def py_spy() -> str:
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if not found:
        raise BenchError("py-spy is not installed (pip install py-spy)")
    return found


@dataclass
class Profile:
    raw: Path
    text: Path
    samples: int = 0

    def summary(self) -> str:
        return (
            f"py-spy profile of relay-1p under 256 B enqueue load: {self.raw} "
            f"({self.samples} samples), top frames in {self.text}"
        )


def _frame_name(frame: str) -> str:
    # "handler (relay/api/queues.py:42)" -> "handler (relay/api/queues.py)"; lines split one function
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0]})" if where else name


def summarize(raw_text: str, top: int = 30) -> tuple[int, str]:
    """Self and inclusive sample shares per function from collapsed stacks."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in raw_text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame_name(f) for f in stack.split(";") if f]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        for name in set(frames):
            incl[name] += count
    if total == 0:
        return 0, "no samples\n"
    out = [f"{total} samples", "", "self time (where the CPU was):"]
    out += [f"  {100 * c / total:5.1f}%  {name}" for name, c in own.most_common(top)]
    out += ["", "inclusive time (function and what it called):"]
    out += [f"  {100 * c / total:5.1f}%  {name}" for name, c in incl.most_common(top)]
    return total, "\n".join(out) + "\n"


@asynccontextmanager
async def recording(procs: Procs, pid: int, out_dir: Path, name: str, seconds: int) -> AsyncIterator[Profile]:
    """Sample ``pid`` for ``seconds`` while the body runs; summarize when both are done."""
    prof = Profile(out_dir / f"{name}.collapsed.txt", out_dir / f"{name}.top.txt")
    argv = [py_spy(), "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "250"]
    argv += ["--format", "raw", "--output", str(prof.raw)]
    child = procs.start("py-spy", argv)
    try:
        yield prof
        await wait_exit(child, seconds + 30)
    finally:
        procs.stop(child)
    if not prof.raw.exists():
        raise BenchError(f"py-spy wrote no profile: {child.log_tail(3)}")
    prof.samples, text = summarize(prof.raw.read_text())
    prof.text.write_text(text)
