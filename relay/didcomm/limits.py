"""How many new DIDComm connections one client may open: RELAY_DIDCOMM_MAX_CONNECTIONS_PER_CLIENT
an hour, counted in this relay process (a fleet of N relays behind a balancer admits up to N
times that; docs/protocols.md "Limits"). A connection costs Redis records until it expires, so
an anonymous client is held to a rate of them instead of being free to mint thousands."""

from __future__ import annotations

import math
import time
from collections.abc import Hashable

WINDOW_S = 3600.0
MAX_CLIENTS = 65_536  # clients tracked at once: past it, windows already over are forgotten first


class ConnectionBudget:
    def __init__(self, per_hour: int) -> None:
        self.per_hour = per_hour
        self._windows: dict[Hashable, tuple[float, int]] = {}  # client -> (window start, count)

    def admit(self, client: Hashable, now: float | None = None) -> float | None:
        """None when `client` may open one more connection (counted), else the seconds until it may."""
        if self.per_hour <= 0:
            return None
        t = time.monotonic() if now is None else now
        start, count = self._windows.get(client, (t, 0))
        if t - start >= WINDOW_S:
            start, count = t, 0
        if count >= self.per_hour:
            return max(1.0, math.ceil(start + WINDOW_S - t))
        if client not in self._windows and len(self._windows) >= MAX_CLIENTS:
            self._forget(t)
        self._windows[client] = (start, count + 1)
        return None

    def _forget(self, now: float) -> None:
        over = [c for c, (start, _) in self._windows.items() if now - start >= WINDOW_S]
        for c in over or list(self._windows)[: MAX_CLIENTS // 8]:  # else the oldest-inserted eighth
            del self._windows[c]
