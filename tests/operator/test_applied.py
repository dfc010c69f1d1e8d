"""The operator's record of what it last wrote (relayfleet_operator/applied.py): an unchanged
write is skipped until due, a changed one never is, a read showing drift forgets the entry."""

from __future__ import annotations

from relayfleet_operator.applied import ABSENT, JITTER, Written, digest, object_key


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def deployment(replicas: int, generation: int | None = None) -> dict[str, object]:
    meta: dict[str, object] = {"name": "relayfleet-a-relay", "namespace": "ns"}
    if generation is not None:
        meta["generation"] = generation
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": {"replicas": replicas}}


def test_digest_ignores_key_order_and_sees_every_value() -> None:
    assert digest({"a": 1, "b": [1, {"c": 2}]}) == digest({"b": [1, {"c": 2}], "a": 1})
    assert digest({"a": 1}) != digest({"a": 2})
    assert object_key(deployment(1)) == ("apps/v1", "Deployment", "ns", "relayfleet-a-relay")


def test_the_same_content_is_skipped_until_due_and_a_change_is_written_at_once() -> None:
    clock = Clock()
    written = Written(100.0, clock=clock, jitter=lambda: 1.0)  # due after (1 - JITTER) x 100 s
    key, one, two = object_key(deployment(1)), digest(deployment(1)), digest(deployment(2))
    assert not written.fresh(key, one)  # never written
    written.record(key, one, deployment(1, generation=3))
    assert written.fresh(key, one)
    assert not written.fresh(key, two)  # the spec changed: written at once
    clock.now += 100.0 * (1 - JITTER) - 1
    assert written.fresh(key, one)
    clock.now += 1
    assert not written.fresh(key, one)  # due: drift no read notices is corrected now


def test_jitter_spreads_entries_written_together() -> None:
    clock = Clock()
    draws = iter([0.0, 1.0])
    written = Written(100.0, clock=clock, jitter=lambda: next(draws))
    written.record("a", "x")
    written.record("b", "x")
    clock.now += 80.0
    assert written.fresh("a", "x")
    assert not written.fresh("b", "x")


def test_a_read_showing_drift_forgets_the_entry() -> None:
    clock = Clock()
    written = Written(100.0, clock=clock)
    key, content = object_key(deployment(1)), digest(deployment(1))
    written.record(key, content, deployment(1, generation=3))
    written.observed(key, deployment(1, generation=3))  # as written (status moves do not count)
    assert written.fresh(key, content)
    written.observed(key, deployment(7, generation=4))  # someone changed its spec
    assert not written.fresh(key, content)
    written.record(key, content, deployment(1, generation=5))
    written.observed(key, None)  # deleted
    assert not written.fresh(key, content)
    written.record("retired", ABSENT)
    written.observed("retired", None)  # "checked absent" stays
    assert written.fresh("retired", ABSENT)


def test_entries_past_due_are_dropped_as_new_ones_come() -> None:
    clock = Clock()
    written = Written(10.0, clock=clock)
    for i in range(63):
        written.record(("old", i), "x")
    clock.now += 11.0
    written.record("new", "x")  # the 64th: a prune
    assert len(written) == 1
    assert written.fresh("new", "x")
