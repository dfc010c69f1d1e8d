"""Run a list of slot moves with bounded concurrency, stopping cleanly when asked.

What a move does (migrate, publish the map, record progress) is the caller's `run_one`;
this module only decides which moves run when: at most `concurrency` at once, none started
after a stop request or a failure, every started move awaited before returning (a move
is never abandoned half-way by the executor itself).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Sequence


class Outcome(enum.StrEnum):
    DONE = "done"
    STOPPED = "stopped"


class MoveFailed(Exception):
    """A move failed; `index` says which, the cause is chained."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


async def run_moves(
    indexes: Sequence[int],
    run_one: Callable[[int], Awaitable[None]],
    *,
    concurrency: int = 1,
    should_stop: Callable[[], Awaitable[bool]] | None = None,
) -> Outcome:
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    pending = list(indexes)
    running: dict[asyncio.Task[None], int] = {}
    failure: MoveFailed | None = None
    stopped = False
    try:
        while pending or running:
            while pending and len(running) < concurrency and failure is None and not stopped:
                if should_stop is not None and await should_stop():
                    stopped = True
                    break
                index = pending.pop(0)
                running[asyncio.ensure_future(run_one(index))] = index
            if not running:
                break
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = running.pop(task)
                exc = task.exception()
                if exc is not None and failure is None:
                    failure = MoveFailed(index, str(exc) or type(exc).__name__)
                    failure.__cause__ = exc
            if failure is not None or stopped:
                pending.clear()
    finally:
        # Cancellation (operator shutdown): let the moves in flight see it; they resume later.
        for task in running:
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
    if failure is not None:
        raise failure
    return Outcome.STOPPED if stopped else Outcome.DONE
