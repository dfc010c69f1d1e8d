"""Bad input, fuzzed with hypothesis: HTTP requests (raw bytes on a socket: request line,
paths, queries, headers, bodies), the Authorization header parser and the shard-map loader.

Properties: the relay never answers 5xx and never dies; a rejected request (4xx) leaves
every Redis key exactly as it was; the parsers raise only their own clear errors.
"""

from __future__ import annotations

import base64
import json
import math
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relayfleet_testing.localredis import LocalRedis

from relay.api.auth import parse_header
from relay.api.errors import ApiError
from relay.fleet.sharding import ShardMap, ShardMapError, loads_shard_map
from tests.support.faults import report, start_relay, stop_relay
from tests.support.fleet_harness import DEBIAN_REDIS, RelayProc

pytestmark = [pytest.mark.faults, pytest.mark.xdist_group("fuzz-inputs")]  # one relay per module

FUZZ = settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


RECIPIENT = _b64(bytes(range(32)))


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RelayProc, redis.Redis]]:
    workdir: Path = tmp_path_factory.mktemp("fuzz")
    server = LocalRedis(binary=DEBIAN_REDIS, dir=str(workdir / "redis")).start()
    relay = start_relay(workdir, server.url)
    client = redis.Redis.from_url(server.url)
    try:
        yield relay, client
    finally:
        client.close()
        stop_relay(relay)
        server.stop()


Snapshot = dict[bytes, tuple[bytes, float]]


def _snapshot(client: redis.Redis) -> Snapshot:
    """Each key's DUMP and the time (monotonic) before which it cannot expire: inf without a
    TTL. Earlier examples leave keys with TTLs (rate windows, idempotency records) that may
    run out between two snapshots on a slow machine, or between SCAN and DUMP (left out)."""
    out: Snapshot = {}
    for k in client.scan_iter(count=1000):
        asked = time.monotonic()
        pipe = client.pipeline(transaction=True)
        pipe.dump(k)
        pipe.pttl(k)
        value, ttl_ms = pipe.execute()
        if value is not None:
            out[k] = (value, asked + ttl_ms / 1000 if ttl_ms >= 0 else math.inf)
    return out


def _changes(before: Snapshot, after: Snapshot) -> dict[bytes, str]:
    """Keys added, changed or removed between two snapshots; a key whose TTL may have run out
    meanwhile is not counted as removed."""
    now = time.monotonic()
    out = {k: "added" for k in after.keys() - before.keys()}
    for k, (value, expires) in before.items():
        if k not in after:
            if expires > now:
                out[k] = "removed"
        elif after[k][0] != value:
            out[k] = "changed"
    return out


def _exchange(port: int, raw: bytes, timeout: float = 5.0, half_close: bool = False) -> int:
    """Send raw bytes, return the response status (0: closed without one).

    ``half_close`` ends the sending side, for garbage that may never complete a request;
    aiohttp takes that EOF as the client going away and drops a pending response."""
    with socket.create_connection(("127.0.0.1", port), timeout) as s:
        s.sendall(raw)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    line = data.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) >= 2 and line[0].startswith(b"HTTP/") and line[1].isdigit() else 0


_text = st.text(st.characters(codec="latin-1", exclude_characters="\r\n"), max_size=40)
_token = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=20)
_number = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.sampled_from(["", "nan", "inf", "-inf", "1e999", "0x10", "1_0", " 1", "\u0661", "0.5", "-0"]),
    _text,
)
_recipient = st.one_of(
    st.just(RECIPIENT),
    st.binary(max_size=40).map(_b64),
    _text.map(lambda t: t.replace("/", "").replace(" ", "%20") or "x"),
)
_tail = st.sampled_from(["messages", "ack", "drain", "status", "", "messages/1", "..", "%2e%2e"])
_query = st.dictionaries(
    st.sampled_from(["channel", "fromSeq", "limit", "wait", "x", ""]),
    st.one_of(_number, st.binary(max_size=80).map(_b64)),
    max_size=4,
)
_valid_query = st.dictionaries(
    st.sampled_from(["fromSeq", "limit", "channel"]),
    st.sampled_from(["0", "1", "5", "1000", "1001", "", _b64(b"c" * 8)]),
    max_size=2,
)
_path = st.one_of(
    st.builds(  # well-formed: these reach the handlers and Redis
        lambda t, q: (
            f"/v1/queues/{RECIPIENT}/{t}" + ("?" + "&".join(f"{k}={v}" for k, v in q.items()) if q else "")
        ),
        st.sampled_from(["messages", "ack", "drain", "status"]),
        _valid_query,
    ),
    st.builds(
        lambda r, t, q: (
            f"/v1/queues/{r}/{t}" + ("?" + "&".join(f"{k}={v}" for k, v in q.items()) if q else "")
        ),
        _recipient,
        _tail,
        _query,
    ),
    st.sampled_from(["/", "/v1", "/v1/queues", "//v1/queues//messages", "/readyz", "*"]),
    _text.map(lambda t: "/" + t),
)
_headers: st.SearchStrategy[dict[str, str]] = st.just({}) | st.dictionaries(
    st.sampled_from(
        ["Content-Type", "Idempotency-Key", "Authorization", "X-Inbox-ID", "Transfer-Encoding", "Expect"]
    )
    | _token,
    _text,
    max_size=5,
)
_body = st.one_of(
    st.binary(max_size=300),
    st.builds(
        lambda v: json.dumps({"upToSeq": v}).encode(),
        st.from_type(object).filter(lambda v: isinstance(v, (int, float, str, bool, type(None)))),
    ),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
        max_leaves=8,
    ).map(lambda v: json.dumps(v).encode()),
)


SEEN: dict[int, int] = {}  # status class -> count, to show the fuzz reached the handlers


def _wait_free(path: str) -> str:
    # a valid `wait` would make a long-poll on an empty queue (fine, but slow for a fuzz run)
    return path.replace("wait=", "wait=x") if "wait=" in path else path


@FUZZ
@given(
    method=st.one_of(
        st.sampled_from(["GET", "POST"]),
        st.sampled_from(["GET", "POST"]),
        st.sampled_from(["PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]),
        _token,
    ),
    path=_path,
    headers=_headers,
    body=_body,
)
def test_fuzzed_http_requests_never_5xx_and_rejections_change_nothing(
    target: tuple[RelayProc, redis.Redis], method: str, path: str, headers: dict[str, str], body: bytes
) -> None:
    relay, client = target
    head = f"{method} {_wait_free(path)} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items() if k.lower() != "content-length")
    head += f"Content-Length: {len(body)}\r\n\r\n"
    before = _snapshot(client)
    status = _exchange(relay.port, head.encode("utf-8") + body)
    SEEN[status // 100] = SEEN.get(status // 100, 0) + 1
    assert relay.proc.poll() is None, "the relay died"
    assert status < 500, f"{status} for {method} {path!r}"
    assert status != 0, f"no response to {method} {path!r}"
    if 400 <= status < 500:
        assert not _changes(before, _snapshot(client)), f"rejected {method} {path!r} changed Redis"


def test_http_fuzz_reached_the_handlers() -> None:
    # runs after the fuzz above (file order): some requests must have been accepted (2xx)
    # and many rejected (4xx), or the generator only exercised the request-line parser
    if not SEEN:
        pytest.skip("the HTTP fuzz test did not run")
    assert SEEN.get(2, 0) > 0, SEEN
    assert SEEN.get(4, 0) > 0, SEEN
    report("fuzz-http", None, examples=sum(SEEN.values()), status_classes=dict(sorted(SEEN.items())))


@FUZZ
@given(raw=st.binary(max_size=600))
def test_raw_garbage_on_the_socket(target: tuple[RelayProc, redis.Redis], raw: bytes) -> None:
    relay, client = target
    before = _snapshot(client)
    status = _exchange(relay.port, raw, half_close=True)
    assert relay.proc.poll() is None
    assert status < 500
    assert not _changes(before, _snapshot(client))


_field = st.one_of(st.binary(max_size=70).map(_b64), _text)


@FUZZ
@given(
    value=st.one_of(
        st.none(),
        _text,
        st.builds(
            lambda scheme, parts, sep: scheme + " " + sep.join(f"{k}={v}" for k, v in parts),
            st.sampled_from(["Relay-Ed25519", "relay-ed25519", "Bearer", ""]),
            st.lists(st.tuples(st.sampled_from(["key", "ts", "nonce", "sig", "x", ""]), _field), max_size=6),
            st.sampled_from([",", ", ", ";", ",,"]),
        ),
    )
)
def test_authorization_header_parser_only_raises_401(value: str | None) -> None:
    try:
        creds = parse_header(value)
    except ApiError as exc:
        status = exc.status
    else:
        status = 200
    if status != 200:
        assert status == 401
        return
    assert len(creds.key) == 32
    assert len(creds.sig) == 64
    assert creds.ts.isdigit()


_json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=20,
)
_name = st.sampled_from(["a", "b", "", "ü"])
_map_doc = st.fixed_dictionaries(
    {},
    optional={
        "fleet": st.sampled_from(["f", ""]) | _json_value,
        "epoch": st.integers(-3, 2**64) | _json_value,
        "shards": st.dictionaries(
            _name,
            st.fixed_dictionaries(
                {
                    "redis": st.sampled_from(["redis://127.0.0.1:1/0", "", "http://x", "unix:///s"])
                    | _json_value
                }
            )
            | _json_value,
            max_size=3,
        )
        | _json_value,
        "slots": st.lists(
            st.one_of(
                st.just([0, 16383, "a"]),
                st.tuples(st.integers(-2, 16390), st.integers(-2, 16390), _name).map(list),
                st.lists(_json_value, max_size=4),
                _json_value,
            ),
            max_size=4,
        )
        | _json_value,
    },
)


@FUZZ
@given(text=st.one_of(st.binary(max_size=300), _text, _map_doc.map(json.dumps), _json_value.map(json.dumps)))
def test_shard_map_loader_only_raises_shard_map_error(text: str | bytes) -> None:
    try:
        shard_map: ShardMap | str = loads_shard_map(text)
    except ShardMapError as exc:
        shard_map = str(exc)  # a clear message, nothing else escapes
    assert shard_map
