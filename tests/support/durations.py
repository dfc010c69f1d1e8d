"""The suite's measured test durations (tests/durations.json) and the split of a group by them.

Not a plugin: tests/conftest.py splits groups with it, tests/support/xdist_groups.py orders
the work units and refreshes the file (`--store-durations`).
"""

from __future__ import annotations

import json
from pathlib import Path

DURATIONS = Path(__file__).resolve().parents[1] / "durations.json"
#: a test's seconds when the file does not name it (it took under STORED_FROM)
DEFAULT_SECONDS = 0.3
#: the file keeps the tests that took at least this long (setup, call and teardown)
STORED_FROM = 1.0


def load_durations() -> dict[str, float]:
    """Node id -> seconds from tests/durations.json ({} if it is missing or unreadable)."""
    try:
        data = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def split_group(nodeids: list[str], parts: int, seconds: dict[str, float]) -> dict[str, int]:
    """Node id -> part (0..parts-1): longest test first into the part with the fewest seconds so
    far (the same answer on every worker, which all collect the same tests)."""
    load = [0.0] * parts
    out = {}
    for nodeid in sorted(nodeids, key=lambda n: (-seconds.get(n, DEFAULT_SECONDS), n)):
        part = min(range(parts), key=lambda i: (load[i], i))
        out[nodeid] = part
        load[part] += seconds.get(nodeid, DEFAULT_SECONDS)
    return out
