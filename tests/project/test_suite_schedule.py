"""The suite's schedule (tests/support/durations.py): a group split by measured seconds, and the
durations file it reads."""

from __future__ import annotations

import json

from tests.support.durations import DEFAULT_SECONDS, DURATIONS, STORED_FROM, split_group


def test_split_balances_the_seconds_longest_first() -> None:
    seconds = {"a": 300.0, "b": 200.0, "c": 120.0, "d": 90.0, "e": 60.0, "f": 30.0}
    part = split_group(list(seconds), 2, seconds)
    totals = [sum(s for n, s in seconds.items() if part[n] == i) for i in range(2)]
    assert sorted(totals) == [390.0, 410.0]  # a+d against b+c+e+f
    assert part["a"] != part["b"]


def test_split_is_the_same_whatever_the_collection_order() -> None:
    seconds = {f"t{i}": float(i % 7) for i in range(40)}
    names = list(seconds)
    once = split_group(names, 3, seconds)
    assert split_group(list(reversed(names)), 3, seconds) == once
    assert set(once.values()) == {0, 1, 2}


def test_unmeasured_tests_count_alike_and_spread_evenly() -> None:
    part = split_group([f"t{i}" for i in range(10)], 2, {})
    assert sorted(list(part.values()).count(i) for i in range(2)) == [5, 5]
    assert DEFAULT_SECONDS < STORED_FROM  # an unmeasured test is a short one


def test_the_durations_file_names_tests_with_their_seconds() -> None:
    data = json.loads(DURATIONS.read_text())
    assert data, "tests/durations.json is empty: make test PYTEST_ARGS=--store-durations"
    for nodeid, seconds in data.items():
        assert nodeid.startswith("tests/"), nodeid
        assert "::" in nodeid, nodeid
        assert isinstance(seconds, float | int), (nodeid, seconds)
        assert seconds >= STORED_FROM, (nodeid, seconds)
