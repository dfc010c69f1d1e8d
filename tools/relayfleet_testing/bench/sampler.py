"""A CPU-time sampling profiler around a Python module run, for servers on shared cores.

py-spy samples wall-clock time: on a busy machine a process that wakes Redis or the
load generator is often preempted inside that write, so the write looks far costlier
than the CPU it uses. This samples on ITIMER_PROF instead, which ticks only while the
process runs (user or system time), and records the Python stack at each tick. Time in
C code is charged to the Python frame that called it; time in the event loop between
callbacks lands on the next Python frame to run.

Run: python tools/relayfleet_testing/bench/sampler.py OUT.collapsed [--hz N] -m MODULE [ARGS...]
(as a script, so it works for trees without this file; the working directory comes
first on sys.path, as with ``python -m``). SIGUSR1 starts sampling afresh, SIGUSR2
stops it (so startup is left out); the collapsed stacks are written on exit.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from collections import Counter
from types import FrameType


def _stack(frame: FrameType | None) -> str:
    names: list[str] = []
    while frame is not None:
        code = frame.f_code
        names.append(f"{code.co_qualname} ({_short(code.co_filename)}:{frame.f_lineno})")
        frame = frame.f_back
    return ";".join(reversed(names))


def _short(path: str) -> str:
    for marker in ("/site-packages/", "/lib/python3"):
        if marker in path:
            return path.split(marker, 1)[1]
    cwd = os.getcwd() + "/"
    return path[len(cwd) :] if path.startswith(cwd) else path


def main(argv: list[str]) -> int:
    if len(argv) < 3 or "-m" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    out = argv[0]
    hz = int(argv[argv.index("--hz") + 1]) if "--hz" in argv[: argv.index("-m")] else 997
    module, args = argv[argv.index("-m") + 1], argv[argv.index("-m") + 2 :]
    samples: Counter[str] = Counter()

    def tick(signum: int, frame: FrameType | None) -> None:
        samples[_stack(frame)] += 1

    def start(signum: int, frame: FrameType | None) -> None:
        samples.clear()
        signal.setitimer(signal.ITIMER_PROF, 1 / hz, 1 / hz)

    def stop(signum: int, frame: FrameType | None) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)

    sys.path[0] = os.getcwd()  # not this script's folder: the tree being measured
    sys.argv = [module, *args]
    signal.signal(signal.SIGPROF, tick)
    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        with open(out, "w") as f:
            f.writelines(f"{stack} {n}\n" for stack, n in samples.items())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
