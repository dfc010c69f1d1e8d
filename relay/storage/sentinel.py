"""Finding a Sentinel-managed shard's primary, and hearing when it changes.

A shard map entry may name a Sentinel service instead of one Redis (docs/api.md, "Shard map"; held
as a ``redis+sentinel://`` URL, see relay/fleet/sharding.py). Everything that opens
connections asks here where the primary is:

- ``ask_primary``: SENTINEL MASTER, trying each Sentinel in turn (the one that answered last
  first); a primary whose flags say s_down or o_down is not taken (as redis-py's
  discover_master), one a Sentinel has no link to (disconnected) only when none has.
  ``survey_primary`` asks them all at once and counts who answered (status reports: the
  operator). Sentinels may lag a failover, so a connection also checks ROLE once open
  (callers do: the hot path, wakeups); a demoted primary is never written to.
- ``SentinelWatch``: one connection per process and service subscribed to
  ``+switch-master`` on a Sentinel (re-made on the next Sentinel when it drops), so
  connections to the old primary are closed within a second of a failover instead
  of at their next error. One per service, shared by the store and the wakeup hub.
- ``async_client`` / ``sync_client``: redis-py clients for the same URLs (migrator,
  maintenance, Spark): redis-py's Sentinel pool resolves on connect (the async one through
  ``ask_primary``; the blocking one with redis-py's own discovery, which checks the same
  flags) and drops a connection that answers READONLY.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel

from relay.fleet.sharding import SentinelTarget, is_sentinel_url, parse_sentinel_url
from relay.storage.connection import RedisTarget, open_connection
from relay.storage.resp import Conn

log = logging.getLogger("relay.sentinel")

_ASK_TIMEOUT_S = 1.0  # per Sentinel: a dead one must not use up the caller's whole budget


class NoPrimary(ConnectionError):
    """No Sentinel named a primary for the service (all down, or mid-failover)."""


async def _sentinel_connection(target: SentinelTarget, host: str, port: int, timeout: float) -> Conn:
    """A connection to one Sentinel, logged in with the Sentinels' password (RedisConnectError
    when it is refused or unreachable)."""
    login = RedisTarget(host=host, port=port, password=target.sentinel_password)
    return Conn(*await open_connection(login, timeout))


_last_good: dict[tuple[tuple[str, int], ...], int] = {}  # which Sentinel answered last, per set


async def _ask(target: SentinelTarget, host: str, port: int, timeout: float) -> Any:
    """One Sentinel's SENTINEL MASTER reply for the service (a hiredis.ReplyError, e.g. for a
    service it does not know, is returned, not raised); OSError or TimeoutError when it does
    not answer in time."""
    conn: Conn | None = None
    try:
        async with asyncio.timeout(timeout):
            conn = await _sentinel_connection(target, host, port, timeout)
            return await conn.call("SENTINEL", "MASTER", target.service)
    finally:
        if conn is not None:
            conn.close()


def _state(reply: Any) -> dict[bytes, Any]:
    """A SENTINEL MASTER reply's field/value pairs ({} for an error reply)."""
    if not isinstance(reply, list):
        return {}
    return dict(zip(reply[::2], reply[1::2], strict=False))


# Flags under which a Sentinel's primary must not be used (as redis-py's discover_master
# checks them): held down, subjectively or by quorum.
_DOWN = frozenset((b"s_down", b"o_down"))


def _named(reply: Any) -> tuple[tuple[str, int], bool] | None:
    """The (host, port) of the primary a SENTINEL MASTER reply describes, unless its flags
    hold it down or call it no primary; with whether this Sentinel's link to it is up (no
    `disconnected` flag)."""
    state = _state(reply)
    flags = state.get(b"flags")
    ip, port = state.get(b"ip"), state.get(b"port")
    if not (isinstance(flags, bytes) and isinstance(ip, bytes) and isinstance(port, bytes)):
        return None
    names = set(flags.split(b","))
    if b"master" not in names or names & _DOWN or not port.isdigit():
        return None
    return (ip.decode(), int(port)), b"disconnected" not in names


async def ask_primary(target: SentinelTarget, timeout: float = _ASK_TIMEOUT_S) -> tuple[str, int]:
    """(host, port) of the service's primary as a Sentinel names it; NoPrimary when none does
    (or each that does holds it down). The Sentinels are asked in turn, the one that answered
    last first: the first answer wins (the hot path wants it fast; a connection checks ROLE
    afterwards anyway). A primary named by a Sentinel whose link to it is `disconnected` is
    taken only when no Sentinel sees it connected: right after a switch every Sentinel
    reports the new primary so for 0.5-1.5 s (measured here), and refusing it then would
    add that to every failover."""
    sentinels = target.sentinels
    start = _last_good.get(sentinels, 0)
    reasons: list[str] = []
    unlinked: tuple[str, int] | None = None
    for i in range(len(sentinels)):
        idx = (start + i) % len(sentinels)
        host, port = sentinels[idx]
        try:
            named = _named(await _ask(target, host, port, timeout))
        except (OSError, TimeoutError) as exc:
            reasons.append(f"{host}:{port} {type(exc).__name__}")
            continue
        if named is None:
            reasons.append(f"{host}:{port} knows no primary it sees up")
        elif named[1]:
            _last_good[sentinels] = idx
            return named[0]
        else:
            unlinked = unlinked or named[0]
    if unlinked is not None:
        return unlinked
    raise NoPrimary(f"no Sentinel named a primary for {target.service}: {'; '.join(reasons)}")


async def survey_primary(
    target: SentinelTarget, timeout: float = _ASK_TIMEOUT_S
) -> tuple[tuple[str, int] | None, int]:
    """Every Sentinel asked at once: (the primary most of them name, or None; how many
    answered at all). For status reports (the operator's status.redis), where how many
    Sentinels are reachable matters and a lagging one must not decide the primary."""
    replies = await asyncio.gather(
        *(_ask(target, host, port, timeout) for host, port in target.sentinels), return_exceptions=True
    )
    named: list[tuple[str, int]] = []
    answered = 0
    for reply in replies:
        if isinstance(reply, (OSError, TimeoutError)):
            continue
        if isinstance(reply, BaseException):
            raise reply
        answered += 1  # an error reply (a service it does not know) is an answer too
        primary = _named(reply)
        if primary is not None:
            named.append(primary[0])
    if not named:
        return None, answered
    return collections.Counter(named).most_common(1)[0][0], answered


def role_is_primary(reply: object) -> bool:
    """Whether a ROLE reply says 'master' (a replica or a Sentinel must not be written to)."""
    return isinstance(reply, list) and bool(reply) and reply[0] == b"master"


# -- hearing about failovers ----------------------------------------------------------

Listener = Callable[[str, int], None]


class SentinelWatch:
    """Calls every listener with the new primary's (host, port) on ``+switch-master``, and
    knows whether some Sentinel currently holds the primary down (``suspect``).

    One subscriber per Sentinel (not one for the set): ``+sdown``/``+odown`` are published
    only by the Sentinels that see them, and the relay must hear the first one. A write
    confirmed by WAIT while a Sentinel holds the primary down may be on a replica that is
    about to follow a newly promoted primary (and drop it), so minReplicas writes are not
    answered as confirmed while ``suspect`` (relay/storage/pipeline.py)."""

    def __init__(self, target: SentinelTarget) -> None:
        self.target = target
        self.listeners: list[Listener] = []
        self._down: set[int] = set()  # Sentinels (by index) that hold the primary down now
        self._failing: set[int] = set()  # Sentinels (by index) running a failover of it now
        self._last: tuple[str, int] | None = None  # the last primary announced
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def suspect(self) -> bool:
        return bool(self._down or self._failing)

    def start(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._run(i)) for i in range(len(self.target.sentinels))]

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _notify(self, idx: int, host: str, port: int) -> None:
        # this Sentinel now watches the new primary (the others' state goes by their own news)
        self._down.discard(idx)
        self._failing.discard(idx)
        if self._last == (host, port):
            return  # every Sentinel announces the same switch
        self._last = (host, port)
        log.warning("Sentinel service %s failed over; new primary %s:%d", self.target.service, host, port)
        for listener in list(self.listeners):
            try:
                listener(host, port)
            except Exception:  # one listener's bug must not stop the others hearing it
                log.exception("failover listener failed")

    async def _run(self, idx: int) -> None:
        host, port = self.target.sentinels[idx]
        while True:
            conn: Conn | None = None
            try:
                conn = await _sentinel_connection(self.target, host, port, _ASK_TIMEOUT_S)
                # what this Sentinel thinks now (the events only tell changes)
                state = await conn.call("SENTINEL", "MASTER", self.target.service, idle=_ASK_TIMEOUT_S)
                down, failing = _flags(state)
                self._set_down(idx, down)
                (self._failing.add if failing else self._failing.discard)(idx)
                conn.send("SUBSCRIBE", *_EVENTS)
                while True:
                    try:
                        data = await conn.read(5.0)
                    except TimeoutError:
                        conn.send("PING")  # a dead Sentinel shows as no answer
                        data = await conn.read(2.0)
                    if not data:
                        raise ConnectionError("closed by the Sentinel")
                    for msg in conn.received(data):
                        self._dispatch(idx, msg)
            except (OSError, TimeoutError):
                # an unreachable Sentinel's view is unknown: not held against the primary
                self._set_down(idx, False)
                self._failing.discard(idx)
                await asyncio.sleep(0.2)
            finally:
                if conn is not None:
                    conn.close()

    def _set_down(self, idx: int, down: bool) -> None:
        if down and idx not in self._down:
            log.warning("a Sentinel holds the primary of %s down: writes wait", self.target.service)
        (self._down.add if down else self._down.discard)(idx)

    def _dispatch(self, idx: int, msg: object) -> None:
        # ["message", "+switch-master", "<name> <old-ip> <old-port> <new-ip> <new-port>"]
        # ["message", "+sdown", "master <name> <ip> <port>"] (also -sdown, +odown, -odown)
        if not (isinstance(msg, list) and len(msg) == 3 and msg[0] == b"message"):
            return
        event = msg[1]
        fields = msg[2].decode(errors="replace").split()
        if event == b"+switch-master":
            if len(fields) == 5 and fields[0] == self.target.service and fields[4].isdigit():
                self._notify(idx, fields[3], int(fields[4]))
        elif len(fields) >= 2 and fields[0] == "master" and fields[1] == self.target.service:
            if event in _DOWN_EVENTS:
                self._set_down(idx, event in (b"+sdown", b"+odown"))
            elif event == b"+try-failover":
                # a primary back from a stall clears its sdown while the failover goes on:
                # the fence holds until the failover ends (switch-master) or is abandoned
                self._failing.add(idx)
            else:
                self._failing.discard(idx)


_DOWN_EVENTS = (b"+sdown", b"-sdown", b"+odown", b"-odown")
# the failover's end without a switch: every -failover-abort-* and the timeout
_EVENTS = (
    "+switch-master",
    *(e.decode() for e in _DOWN_EVENTS),
    "+try-failover",
    "+failover-end",
    "+failover-end-for-timeout",
    "-failover-abort-not-elected",
    "-failover-abort-no-good-slave",
    "-failover-abort-slave-timeout",
)


def _flags(reply: object) -> tuple[bool, bool]:
    """(held down, failover in progress) from a SENTINEL MASTER reply's flags."""
    flags = _state(reply).get(b"flags", b"")
    if not isinstance(flags, bytes):
        return False, False
    return b"s_down" in flags or b"o_down" in flags, b"failover_in_progress" in flags


@functools.lru_cache(maxsize=256)
def _watch_key(url: str) -> str:
    return parse_sentinel_url(url).url()


def suspected(url: str) -> bool:
    """Whether a Sentinel watched for `url`'s service holds its primary down now."""
    entry = _watches.get(_watch_key(url))
    return entry is not None and entry[0].suspect


_watches: dict[str, tuple[SentinelWatch, int]] = {}


def watch(url: str, listener: Listener) -> Callable[[], None]:
    """Subscribe `listener` to failovers of the service `url` names; returns the unsubscribe.
    One connection per Sentinel of the service and process, however many listeners."""
    target = parse_sentinel_url(url)
    key = target.url()
    w, n = _watches.get(key, (None, 0))
    if w is None:
        w = SentinelWatch(target)
        w.start()
    _watches[key] = (w, n + 1)
    w.listeners.append(listener)

    def unsubscribe() -> None:
        assert w is not None
        with contextlib.suppress(ValueError):
            w.listeners.remove(listener)
        _, count = _watches.get(key, (w, 1))
        if count <= 1:
            _watches.pop(key, None)
            for task in w._tasks:
                task.cancel()
            w._tasks = []
        else:
            _watches[key] = (w, count - 1)

    return unsubscribe


# -- redis-py clients for the same URLs ------------------------------------------------


def _sentinel_kwargs(target: SentinelTarget, timeout: float | None) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "socket_timeout": timeout or _ASK_TIMEOUT_S,
        "socket_connect_timeout": _ASK_TIMEOUT_S,
    }
    if target.sentinel_password is not None:
        kw["password"] = target.sentinel_password
    return kw


def _node_kwargs(target: SentinelTarget, kwargs: dict[str, Any]) -> dict[str, Any]:
    kw = dict(kwargs)
    kw.pop("max_connections", None)  # pool sizing is the Sentinel pool's own
    kw.pop("single_connection_client", None)
    kw.update(db=target.db, password=target.password, username=target.username)
    return kw


class _SentinelBackedClient(aioredis.Redis):
    """A Sentinel service's primary client that also closes its connections to the
    Sentinels (redis-py leaves them open: a ResourceWarning per short-lived client)."""

    sentinel_clients: list[aioredis.Redis]

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        for sentinel in getattr(self, "sentinel_clients", ()):
            await sentinel.aclose()


class _Sentinels(aiosentinel.Sentinel):
    """redis-py's Sentinel manager, finding the primary with `ask_primary`: the redis-py
    clients and the hand-written connections take the same node for the primary."""

    target: SentinelTarget

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        try:
            return await ask_primary(self.target)
        except NoPrimary as exc:
            raise redis.sentinel.MasterNotFoundError(str(exc)) from None


def async_client(url: str, **kwargs: Any) -> aioredis.Redis:
    """A redis-py asyncio client for a redis:// URL or a Sentinel service's primary."""
    if not is_sentinel_url(url):
        return aioredis.Redis.from_url(url, **kwargs)
    target = parse_sentinel_url(url)
    manager = _Sentinels(  # type: ignore[no-untyped-call]
        list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target, kwargs.get("socket_timeout"))
    )
    manager.target = target
    client: _SentinelBackedClient = manager.master_for(
        target.service, redis_class=_SentinelBackedClient, **_node_kwargs(target, kwargs)
    )
    client.sentinel_clients = list(manager.sentinels)
    return client


def sync_client(url: str, **kwargs: Any) -> redis.Redis:
    """The blocking twin of `async_client` (Spark tasks, maintenance)."""
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **kwargs)
    target = parse_sentinel_url(url)
    manager = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
        list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target, kwargs.get("socket_timeout"))
    )
    client: redis.Redis = manager.master_for(  # type: ignore[no-untyped-call]
        target.service, **_node_kwargs(target, kwargs)
    )
    return client


def redacted(url: str) -> str:
    """Where a URL points, for errors and logs: never its password."""
    if is_sentinel_url(url):
        return parse_sentinel_url(url).redacted()
    return url.rsplit("@", 1)[-1]


async def primary_url(url: str, timeout: float = _ASK_TIMEOUT_S) -> str:
    """`url` itself, or for a Sentinel URL the redis:// URL of the primary a Sentinel names
    now (with the data nodes' credentials and database). NoPrimary when none does."""
    if not is_sentinel_url(url):
        return url
    target = parse_sentinel_url(url)
    host, port = await ask_primary(target, timeout)
    auth = ""
    if target.password is not None:
        user = quote(target.username, safe="") if target.username else ""
        auth = f"{user}:{quote(target.password, safe='')}@"
    host_part = f"[{host}]" if ":" in host else host
    return f"redis://{auth}{host_part}:{port}/{target.db}"
