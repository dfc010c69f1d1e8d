"""What the DIDComm fuzzing modules share (tests/hostile/test_didcomm_fuzz.py, v1, and
test_didcomm2_fuzz.py, v2): the example budget, the per-input time bound and the JSON
strategies."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

__all__ = ["B58", "PARSE_S", "budget", "json_values", "scalars", "timed"]

PARSE_S = 0.5  # one parser call on one input, however hostile (a loaded 2-core machine)


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
