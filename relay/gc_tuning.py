"""How the relay process's cyclic garbage collector runs (docs/design-decisions.md, "Fewer,
larger young garbage-collector passes").

A relay holding thousands of idle waiters is a large heap of long-lived objects that a
young-generation pass never frees; what a wake allocates is mostly freed by reference
counting. CPython's default (a young pass every 700 net allocations) then runs a pass
inside every sixtieth WebSocket wake or so, and a wake that carries one is late by the
pass. Fewer, larger young passes touch far fewer wakes; the objects that exist once the
relay has started (modules, classes, functions: ~50,000) are frozen out of every later
pass, full ones included.
"""

from __future__ import annotations

import gc


def tune(young_threshold: int) -> None:
    """For the relay's own process only (never in a library caller's or a test's): freeze
    what start-up made, then run young passes every `young_threshold` net allocations."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young_threshold, middle, old)
