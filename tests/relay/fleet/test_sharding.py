"""Slot function and shard map (docs/api.md, "Shard map"): CRC16 vector, Redis Cluster agreement,
validation errors, O(log n) lookup, map edits."""

from __future__ import annotations

import ast
import itertools
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from relayfleet_testing.localredis import free_port

from relay.fleet.sharding import (
    SLOT_COUNT,
    ShardMap,
    ShardMapError,
    SlotRange,
    crc16,
    even_split,
    loads_shard_map,
    parse_shard_map,
    parse_slot_spec,
    slot_of,
)

URLS = {"a": "redis://10.0.0.5:6379/0", "b": "redis://10.0.0.6:6379/0"}


def _doc(**over: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "fleet": "default",
        "epoch": 7,
        "shards": {"a": {"redis": URLS["a"]}, "b": {"redis": URLS["b"]}},
        "slots": [[0, 8191, "a"], [8192, 16383, "b"]],
    }
    doc.update(over)
    return doc


def test_crc16_test_vector() -> None:
    assert crc16(b"123456789") == 0x31C3
    assert crc16(b"") == 0


def test_slot_of_is_crc16_of_recipient_then_channel_mod_16384() -> None:
    recipient, channel = bytes(range(32)), b"chan"
    assert slot_of(recipient, channel) == crc16(recipient + channel) % SLOT_COUNT
    assert slot_of(recipient) == crc16(recipient) % SLOT_COUNT
    # the values Redis Cluster's CLUSTER KEYSLOT gives for these keys
    assert [slot_of(k) for k in (b"foo", b"bar", b"hello")] == [12182, 5061, 866]


@pytest.fixture(scope="module")
def cluster_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[socket.socket]:
    """A real redis-server in cluster mode, only to ask it CLUSTER KEYSLOT."""
    workdir: Path = tmp_path_factory.mktemp("cluster")
    port = free_port()
    proc = subprocess.Popen(
        ["/usr/bin/redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
         "--cluster-port", str(free_port()), "--cluster-config-file", str(workdir / "nodes.conf"),
         "--dir", str(workdir), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                sock = socket.create_connection(("127.0.0.1", port), 1)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        with sock:
            yield sock
    finally:
        proc.terminate()
        proc.wait(10)


def _keyslot(sock: socket.socket, key: bytes) -> int:
    sock.sendall(b"*3\r\n$7\r\nCLUSTER\r\n$7\r\nKEYSLOT\r\n$%d\r\n%s\r\n" % (len(key), key))
    reply = b""
    while not reply.endswith(b"\r\n"):
        reply += sock.recv(64)
    assert reply.startswith(b":"), reply
    return int(reply[1:-2])


@settings(max_examples=200, deadline=None)
@given(recipient=st.binary(min_size=32, max_size=32), channel=st.binary(max_size=64))
def test_slot_of_agrees_with_redis_cluster(
    cluster_redis: socket.socket, recipient: bytes, channel: bytes
) -> None:
    key = recipient + channel
    if b"{" in key:  # Redis would hash only a {tag}; our keys have no tag semantics
        return
    assert slot_of(recipient, channel) == _keyslot(cluster_redis, key)


def test_parse_valid_map_and_lookup() -> None:
    m = parse_shard_map(_doc())
    assert m.epoch == 7
    assert m.shards == URLS
    assert m.shard_for_slot(0) == "a"
    assert m.shard_for_slot(8191) == "a"
    assert m.shard_for_slot(8192) == "b"
    assert m.shard_for_slot(16383) == "b"
    assert m.slot_counts() == {"a": 8192, "b": 8192}
    assert loads_shard_map(m.dumps()) == m
    # ranges may come in any order
    assert parse_shard_map(_doc(slots=[[8192, 16383, "b"], [0, 8191, "a"]])) == m


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (_doc(slots=[[0, 8000, "a"], [8192, 16383, "b"]]), "slots 8001-8191 are not covered"),
        (_doc(slots=[[0, 8191, "a"], [8000, 16383, "b"]]), "slot 8000 is covered more than once"),
        (_doc(slots=[[0, 8191, "a"], [8192, 16000, "b"]]), "slots 16001-16383 are not covered"),
        (_doc(slots=[[1, 8191, "a"], [8192, 16383, "b"]]), "slots 0-0 are not covered"),
        (_doc(slots=[[0, 8191, "a"], [8192, 16384, "b"]]), "range 8192-16384 must satisfy"),
        (_doc(slots=[[0, 8191, "a"], [9000, 8192, "b"]]), "range 9000-8192 must satisfy"),
        (_doc(slots=[[0, 8191, "a"], [8192, 16383, "c"]]), "slots[1] names unknown shard 'c'"),
        (_doc(slots=[[0, 16383]]), "slots[0] must be [start, end, shard]"),
        (_doc(slots=[[0, "16383", "a"]]), "slots[0][1] must be an integer"),
        (_doc(slots=[[True, 16383, "a"]]), "slots[0][0] must be an integer"),
        (_doc(slots=[]), "'slots' must be a non-empty list"),
        (_doc(epoch=-1), "'epoch' must be >= 0"),
        (_doc(epoch="7"), "'epoch' must be an integer"),
        (_doc(fleet=""), "'fleet' must be a non-empty string"),
        (_doc(shards={}), "'shards' must be a non-empty object"),
        (_doc(shards={"a": {"url": "x"}}), "shard 'a' needs a 'redis' URL string"),
        (_doc(shards={"a": {"redis": "http://x"}}), "unsupported redis URL scheme"),
        ([1, 2], "shard map must be a JSON object"),
    ],
)
def test_validation_errors_are_clear(doc: object, message: str) -> None:
    with pytest.raises(ShardMapError) as err:
        parse_shard_map(doc)
    assert message in str(err.value)


def test_bad_json_is_a_clear_error() -> None:
    with pytest.raises(ShardMapError, match="not valid JSON"):
        loads_shard_map("{nope")
    with pytest.raises(ShardMapError, match="not valid JSON"):
        loads_shard_map(b"\xff\xfe")


def test_lookup_is_logarithmic() -> None:
    """16384 one-slot ranges cost a small factor more per lookup than 2 ranges (memory, and
    14 bisection steps instead of 1); a linear scan would cost thousands of times more."""
    few = parse_shard_map(_doc())
    owner = ["a" if (s * 7919) % 3 else "b" for s in range(SLOT_COUNT)]
    many_doc = _doc(slots=[[s, s, owner[s]] for s in range(SLOT_COUNT)])
    many = parse_shard_map(many_doc)
    assert len(many.ranges) == SLOT_COUNT
    assert all(many.shard_for_slot(s) == owner[s] for s in range(SLOT_COUNT))
    slots = [(s * 104729) % SLOT_COUNT for s in range(50_000)]

    def cost(m: ShardMap) -> float:
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for s in slots:
                m.shard_for_slot(s)
            best = min(best, time.perf_counter() - t)
        return best

    assert cost(many) < 40 * cost(few)


def test_lookup_rejects_slots_out_of_range() -> None:
    m = parse_shard_map(_doc())
    for bad in (-1, SLOT_COUNT):
        with pytest.raises(ValueError, match="outside"):
            m.shard_for_slot(bad)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, SLOT_COUNT - 1), unique=True, max_size=40), st.data())
def test_lookup_matches_a_linear_scan(cuts: list[int], data: st.DataObject) -> None:
    bounds = [0, *sorted(cuts), SLOT_COUNT]
    names = ["a", "b"]
    slots = [(lo, hi - 1, data.draw(st.sampled_from(names))) for lo, hi in itertools.pairwise(bounds)]
    m = parse_shard_map(_doc(slots=[list(r) for r in slots]))
    for s in data.draw(st.lists(st.integers(0, SLOT_COUNT - 1), min_size=1, max_size=50)):
        expected = next(r[2] for r in slots if r[0] <= s <= r[1])
        assert m.shard_for_slot(s) == expected


def test_with_slots_moves_only_those_slots_and_bumps_the_epoch() -> None:
    m = parse_shard_map(_doc())
    moved = m.with_slots([5, 6, 7, 100], "b")
    assert moved.epoch == m.epoch + 1
    assert [moved.shard_for_slot(s) for s in (4, 5, 6, 7, 8, 99, 100, 101)] == [
        "a",
        "b",
        "b",
        "b",
        "a",
        "a",
        "b",
        "a",
    ]
    assert moved.slot_counts() == {"a": 8188, "b": 8196}
    # adjacent ranges of one shard are merged, so the map stays small
    back = moved.with_slots([5, 6, 7, 100], "a")
    assert back.ranges == m.ranges
    with pytest.raises(ShardMapError, match="unknown shard 'zz'"):
        m.with_slots([1], "zz")
    # a round trip through JSON keeps it exactly
    assert loads_shard_map(json.dumps(moved.to_json())) == moved


def test_even_split_covers_everything_near_equally() -> None:
    for n in (1, 2, 3, 7, 64):
        shards = {f"s{i}": f"redis://h{i}:6379/0" for i in range(n)}
        m = even_split("f", shards)
        counts = m.slot_counts()
        assert sum(counts.values()) == SLOT_COUNT
        assert max(counts.values()) - min(counts.values()) <= 1
        assert parse_shard_map(m.to_json()) == m
    with pytest.raises(ShardMapError, match="at least one shard"):
        even_split("f", {})


def test_slot_spec() -> None:
    assert parse_slot_spec("3") == [3]
    assert parse_slot_spec("3-5") == [3, 4, 5]
    assert parse_slot_spec("10-11, 1") == [1, 10, 11]
    assert parse_slot_spec("0-16383") == list(range(SLOT_COUNT))
    for bad, message in (
        ("5-3", "A <= B"),
        ("x", "expected A-B"),
        ("0-16384", "within 0-16383"),
        ("-1", "A-B"),
    ):
        with pytest.raises(ShardMapError, match=message):
            parse_slot_spec(bad)


def test_slot_range_size() -> None:
    assert SlotRange(0, 0, "a").size == 1
    assert SlotRange(10, 19, "a").size == 10


def test_module_is_stdlib_only() -> None:
    """The operator and the Spark jobs import it: nothing outside the standard library."""
    import relay.fleet.sharding as mod

    assert mod.__file__ is not None
    tree = ast.parse(Path(mod.__file__).read_text(encoding="utf-8"))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
