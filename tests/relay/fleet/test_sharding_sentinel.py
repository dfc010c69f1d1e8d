"""Shard map entries that name a Sentinel-managed primary (docs/api.md, "Shard map"): parsed, validated,
held as one URL string per shard (so credentials, operator edits, migration and Spark
pass them like any URL), and written back as the entry they came from."""

from __future__ import annotations

import json

import pytest

from relay.fleet.sharding import (
    SentinelTarget,
    ShardMapError,
    is_sentinel_url,
    loads_shard_map,
    min_replicas_of,
    parse_sentinel_url,
    parse_shard_map,
    shard_entry,
)

ENTRY = {
    "sentinels": ["10.0.0.7:26379", "10.0.0.8:26379", "[fd00::9]:26379"],
    "service": "shard-a",
    "password": "p@ss:w/rd?",
    "minReplicas": 1,
}


def _doc(a: object) -> dict[str, object]:
    return {
        "fleet": "default",
        "epoch": 3,
        "shards": {"a": a, "b": {"redis": "redis://10.0.0.6:6379/0"}},
        "slots": [[0, 8191, "a"], [8192, 16383, "b"]],
    }


def test_sentinel_entry_parses_and_round_trips() -> None:
    m = parse_shard_map(_doc(ENTRY))
    url = m.shards["a"]
    assert is_sentinel_url(url)
    assert not is_sentinel_url(m.shards["b"])
    t = parse_sentinel_url(url)
    assert t.sentinels == (("10.0.0.7", 26379), ("10.0.0.8", 26379), ("fd00::9", 26379))
    assert (t.service, t.password, t.min_replicas, t.db, t.username) == ("shard-a", "p@ss:w/rd?", 1, 0, None)
    assert m.to_json()["shards"]["a"] == ENTRY
    assert loads_shard_map(m.dumps()) == m
    assert min_replicas_of(url) == 1
    assert min_replicas_of(m.shards["b"]) == 0
    assert "p@ss" not in t.redacted()


def test_every_field_survives_the_url_form() -> None:
    t = SentinelTarget((("h", 1),), "svc", "pw", "user", 2, 2, "sentinel%pw +")
    assert parse_sentinel_url(t.url()) == t
    assert shard_entry(t.url()) == {
        "sentinels": ["h:1"],
        "service": "svc",
        "password": "pw",
        "username": "user",
        "db": 2,
        "minReplicas": 2,
        "sentinelPassword": "sentinel%pw +",
    }
    # the URL form is accepted where a 'redis' URL goes (a credentials file holds one)
    assert parse_shard_map(_doc({"redis": t.url()})).shards["a"] == t.url()


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"sentinels": [], "service": "s"}, "non-empty list"),
        ({"sentinels": ["h"], "service": "s"}, "must be host:port"),
        ({"sentinels": ["h:0"], "service": "s"}, "must be host:port"),
        ({"sentinels": ["h:1"]}, "'service'"),
        ({"sentinels": ["h:1"], "service": "a/b"}, "'service'"),
        ({"sentinels": ["h:1"], "service": "s", "minReplicas": -1}, "minReplicas"),
        ({"sentinels": ["h:1"], "service": "s", "minReplicas": True}, "minReplicas"),
        ({"sentinels": ["h:1"], "service": "s", "password": ""}, "'password'"),
        ({"sentinels": ["h:1"], "service": "s", "replicas": 2}, "unknown field"),
        ({"redis": "redis+sentinel://h:1/s?x=1"}, "unknown parameter"),
        ({"redis": "redis+sentinel://h:1/s?minReplicas=a"}, "whole number"),
    ],
)
def test_bad_sentinel_entries_are_clear_errors(entry: object, message: str) -> None:
    with pytest.raises(ShardMapError, match=message) as err:
        parse_shard_map(_doc(entry))
    assert "shard 'a'" in str(err.value)


def test_map_json_is_the_contract_shape() -> None:
    m = parse_shard_map(_doc(ENTRY))
    doc = json.loads(m.dumps())
    assert set(doc["shards"]["a"]) == {"sentinels", "service", "password", "minReplicas"}
