"""What the DIDComm fuzzing modules share (tests/hostile/test_didcomm_fuzz.py, v1, and
test_didcomm2_fuzz.py, v2): the example budget, the per-input time bound, the JSON
strategies and the poster that holds each answer of the relay to the suite's properties."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import requests
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

__all__ = ["B58", "PARSE_S", "REQUEST_S", "Poster", "budget", "json_values", "scalars", "timed"]

PARSE_S = 0.5  # one parser call on one input, however hostile (a loaded 2-core machine)
REQUEST_S = 3.0  # one message through the relay


def budget(examples: int) -> settings:
    """`examples` per property, or RELAY_FUZZ_EXAMPLES when set; the same examples every
    run (derandomize) and no example database written anywhere."""
    wanted = int(os.environ.get("RELAY_FUZZ_EXAMPLES", "0")) or examples
    return settings(
        max_examples=wanted,
        derandomize=True,
        database=None,
        deadline=None,  # timed below, per input, with a bound that holds on a loaded machine
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def timed(call: Callable[[], Any], bound: float = PARSE_S) -> Any:
    started = time.perf_counter()
    try:
        return call()
    finally:
        elapsed = time.perf_counter() - started
        assert elapsed < bound, f"{elapsed:.3f} s for one input"


B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)


class Poster:
    """Posts fuzzed bodies to a relay's DIDComm endpoint, one connection for all, and holds each
    answer to the suite's properties: within REQUEST_S, below 500, a refusal in JSON without a
    traceback. `statuses` counts the answers by status."""

    def __init__(self, url: str, content_type: str) -> None:
        self.url = url
        self.content_type = content_type
        self.session = requests.Session()
        self.statuses: dict[int, int] = {}

    def __call__(self, body: bytes, content_type: str | None = None) -> None:
        started = time.perf_counter()
        resp = self.session.post(
            self.url, data=body, headers={"Content-Type": content_type or self.content_type}
        )
        assert time.perf_counter() - started < REQUEST_S
        self.statuses[resp.status_code] = self.statuses.get(resp.status_code, 0) + 1
        assert resp.status_code < 500, resp.text[:300]
        if resp.status_code >= 400:
            assert resp.headers["Content-Type"].startswith("application/json")
            assert "Traceback" not in resp.text

    def sorted_statuses(self) -> dict[int, int]:
        return dict(sorted(self.statuses.items()))
