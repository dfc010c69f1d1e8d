"""relay/bounded.py: the caches' bound, oldest inserted out."""

from __future__ import annotations

import pytest

from relay.bounded import Bounded


def test_put_past_the_bound_drops_the_first_inserted_only() -> None:
    cache: Bounded[str, int] = Bounded(3)
    for i, key in enumerate("abcd"):
        cache.put(key, i)
    assert list(cache.items()) == [("b", 1), ("c", 2), ("d", 3)]
    assert cache.get("a") is None
    assert cache.get("b") == 1  # a hit does not renew: "b" is still the oldest
    cache.put("e", 4)
    assert list(cache) == ["c", "d", "e"]


def test_a_key_already_held_keeps_its_place_and_drops_nothing() -> None:
    cache: Bounded[str, int] = Bounded(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("a", 3)
    assert list(cache.items()) == [("a", 3), ("b", 2)]


def test_churn_keeps_the_size() -> None:
    cache: Bounded[int, int] = Bounded(100)
    for i in range(10_000):
        cache.put(i, i)
    assert len(cache) == 100
    assert list(cache) == list(range(9_900, 10_000))


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Bounded(0)
