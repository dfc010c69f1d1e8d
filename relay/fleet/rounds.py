"""Periodic rounds over the fleet (shard health, the shard reserve, the DIDComm record sweep):
one loop that a bad round never ends."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("relay.rounds")


async def every(
    interval_s: float, tick: Callable[[], Awaitable[None]], what: str, wait_first: bool = False
) -> None:
    """Run `tick` every `interval_s` until cancelled; a round that raises is logged by its
    exception class (never its text: it may carry a key) and the next one runs."""
    if wait_first:
        await asyncio.sleep(interval_s)
    while True:
        try:
            await tick()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bad round must never end the loop
            log.warning("%s round failed: %s", what, type(exc).__name__)
        await asyncio.sleep(interval_s)
