"""Finding a Sentinel-managed shard's primary, and hearing when it changes, through redis-py.

A shard map entry may name a Sentinel service instead of one Redis (docs/api.md, "Shard map"; held
as a ``redis+sentinel://`` URL, see relay/fleet/sharding.py). Everything that opens
connections asks here where the primary is. Every Sentinel connection is a redis-py client
(``redis.asyncio.sentinel.Sentinel``'s, public API only):

- ``ask_primary``: SENTINEL MASTER, trying each Sentinel in turn (the one that answered last
  first); a primary whose flags say s_down or o_down is not taken (as redis-py's
  discover_master). One a Sentinel has no link to (``disconnected``), or one it is failing
  over right now (``failover_in_progress``: the node may be a deposed but live primary), is
  taken only when no Sentinel names another. ``survey_primary`` asks them all at once and
  counts who answered (status reports: the operator). Sentinels may lag a failover, so a
  connection also checks ROLE once open (callers do: the hot path, wakeups); a demoted
  primary is never written to.
- ``SentinelWatch``: one redis-py pub/sub connection per process, service and Sentinel,
  subscribed to ``+switch-master`` and the down/failover events (re-made when it drops).
  Every Sentinel's switch notice is passed on, not only the first: a connection made in
  between to a node a lagging Sentinel still named moves at the next notice. Listeners move
  what is not on the announced node (relay/storage/pipeline.py, wakeups.py). One watch per
  service, shared by the store and the wakeup hub.
- ``async_client`` / ``sync_client``: redis-py clients for the same URLs (migrator,
  maintenance, Spark): redis-py's Sentinel pool resolves on connect (the async one through
  ``ask_primary``; the blocking one with redis-py's own discovery, which checks the same
  down flags) and drops a connection that answers READONLY.
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
from redis.exceptions import RedisError, ResponseError

from relay.fleet.sharding import SentinelTarget, is_sentinel_url, parse_sentinel_url
from relay.retrying import SENTINEL_WATCH, retrying

log = logging.getLogger("relay.sentinel")

_ASK_TIMEOUT_S = 1.0  # per Sentinel: a dead one must not use up the caller's whole budget


class NoPrimary(ConnectionError):
    """No Sentinel named a primary for the service (all down, or mid-failover)."""


def _sentinel_kwargs(target: SentinelTarget, timeout: float | None) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "socket_timeout": timeout or _ASK_TIMEOUT_S,
        "socket_connect_timeout": _ASK_TIMEOUT_S,
    }
    if target.sentinel_password is not None:
        kw["password"] = target.sentinel_password
    return kw


def _manager(target: SentinelTarget, timeout: float | None = None) -> aiosentinel.Sentinel:
    """redis-py's Sentinel manager for `target` (one client per Sentinel, none connected yet)."""
    return aiosentinel.Sentinel(  # type: ignore[no-untyped-call]
        list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target, timeout)
    )


_last_good: dict[tuple[tuple[str, int], ...], int] = {}  # which Sentinel answered last, per set

# What one Sentinel says of the service: the primary's (host, port), whether its link to
# it is up (no `disconnected` flag) and whether it is failing it over now; None when it
# names no primary it sees up (down flags, not a master, or a service it does not know).
View = tuple[tuple[str, int], bool, bool] | None


async def _ask(sentinel: aioredis.Redis, service: str, timeout: float) -> View:
    """One Sentinel's view of `service`; RedisError (not ResponseError) / OSError /
    TimeoutError when it does not answer in time."""
    try:
        async with asyncio.timeout(timeout):
            state = await sentinel.sentinel_master(service)
    except ResponseError:
        return None  # an answer: it does not know the service
    return _view(state)


def _flag_set(state: object) -> set[str]:
    flags = state.get("flags") if isinstance(state, dict) else None
    if isinstance(flags, (set, frozenset)):
        return {str(f) for f in flags}
    return set(str(flags).split(",")) if flags else set()


def _view(state: object) -> View:
    if not isinstance(state, dict):
        return None
    flags = _flag_set(state)
    ip, port = state.get("ip"), state.get("port")
    if "master" not in flags or flags & {"s_down", "o_down"} or not ip or not isinstance(port, int):
        return None
    return (str(ip), port), "disconnected" not in flags, "failover_in_progress" in flags


_UNREACHABLE = (RedisError, OSError, TimeoutError)


async def ask_primary(target: SentinelTarget, timeout: float = _ASK_TIMEOUT_S) -> tuple[str, int]:
    """(host, port) of the service's primary as a Sentinel names it; NoPrimary when none does
    (or each that does holds it down). The Sentinels are asked in turn, the one that answered
    last first: the first plain answer wins (the hot path wants it fast; a connection checks
    ROLE afterwards anyway). A primary named by a Sentinel whose link to it is `disconnected`
    is taken only when no Sentinel sees it connected: right after a switch every Sentinel
    reports the new primary so for 0.5-1.5 s (measured here), and refusing it then would
    add that to every failover. One a Sentinel is failing over (`failover_in_progress`) is
    taken only when no Sentinel names another node: after a spurious failover the old
    primary is live, answers ROLE master, and is about to be demoted."""
    sentinels = target.sentinels
    start = _last_good.get(sentinels, 0)
    reasons: list[str] = []
    unlinked: list[tuple[str, int]] = []
    failing: list[tuple[str, int]] = []
    manager = _manager(target, timeout)
    try:
        for i in range(len(sentinels)):
            idx = (start + i) % len(sentinels)
            host, port = sentinels[idx]
            try:
                view = await _ask(manager.sentinels[idx], target.service, timeout)
            except _UNREACHABLE as exc:
                reasons.append(f"{host}:{port} {type(exc).__name__}")
                continue
            if view is None:
                reasons.append(f"{host}:{port} knows no primary it sees up")
            elif view[2]:
                failing.append(view[0])
            elif view[1]:
                _last_good[sentinels] = idx
                return view[0]
            else:
                unlinked.append(view[0])
    finally:
        await manager.aclose()
    others = [node for node in unlinked if node not in failing]
    if others or unlinked or failing:
        return (others or unlinked or failing)[0]
    raise NoPrimary(f"no Sentinel named a primary for {target.service}: {'; '.join(reasons)}")


async def survey_primary(
    target: SentinelTarget, timeout: float = _ASK_TIMEOUT_S
) -> tuple[tuple[str, int] | None, int]:
    """Every Sentinel asked at once: (the primary most of them name, or None; how many
    answered at all). For status reports (the operator's status.redis), where how many
    Sentinels are reachable matters and a lagging one must not decide the primary."""
    manager = _manager(target, timeout)
    try:
        views = await asyncio.gather(
            *(_ask(s, target.service, timeout) for s in manager.sentinels), return_exceptions=True
        )
    finally:
        await manager.aclose()
    named: list[tuple[str, int]] = []
    answered = 0
    for view in views:
        if isinstance(view, _UNREACHABLE):
            continue
        if isinstance(view, BaseException):
            raise view
        answered += 1  # naming no primary (a service it does not know) is an answer too
        if view is not None:
            named.append(view[0])
    if not named:
        return None, answered
    return collections.Counter(named).most_common(1)[0][0], answered


def role_is_primary(reply: object) -> bool:
    """Whether a ROLE reply says 'master' (a replica or a Sentinel must not be written to)."""
    return isinstance(reply, list) and bool(reply) and reply[0] == b"master"


# -- hearing about failovers ----------------------------------------------------------

Listener = Callable[[str, int], None]


class SentinelWatch:
    """Calls every listener with the new primary's (host, port) on each Sentinel's
    ``+switch-master``, and knows whether some Sentinel currently holds the primary down
    or is failing it over (``suspect``).

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
        self._last: tuple[str, int] | None = None  # the last primary announced (for the log)
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def suspect(self) -> bool:
        return bool(self._down or self._failing)

    def start(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._run(i)) for i in range(len(self.target.sentinels))]

    def cancel(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()

    async def stop(self) -> None:
        tasks = list(self._tasks)
        self.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _notify(self, idx: int, host: str, port: int) -> None:
        # this Sentinel now watches the new primary (the others' state goes by their own news)
        self._down.discard(idx)
        self._failing.discard(idx)
        if self._last != (host, port):
            self._last = (host, port)
            log.warning("Sentinel service %s failed over; new primary %s:%d", self.target.service, host, port)
        # every Sentinel's notice, not only the first: a connection opened since then on a
        # node another Sentinel still named is moved now (listeners leave the announced one)
        for listener in list(self.listeners):
            try:
                listener(host, port)
            except Exception:  # one listener's bug must not stop the others hearing it
                log.exception("failover listener failed")

    async def _run(self, idx: int) -> None:
        """Follow Sentinel `idx` for as long as the watch runs, connecting again when it drops."""

        def unknown(_exc: BaseException, _wait_s: float) -> None:
            # an unreachable Sentinel's view is unknown: not held against the primary
            self._set_down(idx, False)
            self._failing.discard(idx)

        follow = retrying(SENTINEL_WATCH, _UNREACHABLE, on_retry=unknown)
        await follow(self._follow, idx)

    async def _follow(self, idx: int) -> None:
        """One session with Sentinel `idx`: its view now, then its news until it drops."""
        host, port = self.target.sentinels[idx]
        kw = _sentinel_kwargs(self.target, None)
        kw["socket_timeout"] = None  # a subscriber waits for news; its liveness is the PING below
        client = aioredis.Redis(host=host, port=port, **kw)
        try:
            # what this Sentinel thinks now (the events only tell changes)
            try:
                async with asyncio.timeout(_ASK_TIMEOUT_S):
                    state = await client.sentinel_master(self.target.service)
            except ResponseError:
                state = None  # a service it does not know (yet)
            down, failing = _flags(state)
            self._set_down(idx, down)
            (self._failing.add if failing else self._failing.discard)(idx)
            async with client.pubsub() as pubsub:
                async with asyncio.timeout(_ASK_TIMEOUT_S):
                    await pubsub.subscribe(*_EVENTS)
                while True:
                    msg = await pubsub.get_message(timeout=5.0)
                    if msg is None:
                        await pubsub.ping()  # a dead Sentinel shows as no answer
                        msg = await pubsub.get_message(timeout=2.0)
                        if msg is None:
                            raise TimeoutError("the Sentinel did not answer PING")
                    self._dispatch(idx, msg)
        finally:
            await client.aclose()

    def _set_down(self, idx: int, down: bool) -> None:
        if down and idx not in self._down:
            log.warning("a Sentinel holds the primary of %s down: writes wait", self.target.service)
        (self._down.add if down else self._down.discard)(idx)

    def _dispatch(self, idx: int, msg: dict[str, Any]) -> None:
        # {"type": "message", "channel": b"+switch-master",
        #  "data": b"<name> <old-ip> <old-port> <new-ip> <new-port>"}
        # {"type": "message", "channel": b"+sdown", "data": b"master <name> <ip> <port>"} (-sdown, ...)
        event, data = msg.get("channel"), msg.get("data")
        if msg.get("type") != "message" or not isinstance(data, bytes):
            return
        fields = data.decode(errors="replace").split()
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


def _flags(state: object) -> tuple[bool, bool]:
    """(held down, failover in progress) from a SENTINEL MASTER reply's flags."""
    flags = _flag_set(state)
    return bool(flags & {"s_down", "o_down"}), "failover_in_progress" in flags


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
    watcher = w

    def unsubscribe() -> None:
        with contextlib.suppress(ValueError):
            watcher.listeners.remove(listener)
        _, count = _watches.get(key, (watcher, 1))
        if count <= 1:
            _watches.pop(key, None)
            watcher.cancel()
        else:
            _watches[key] = (watcher, count - 1)

    return unsubscribe


# -- redis-py clients for the same URLs ------------------------------------------------


def _node_kwargs(target: SentinelTarget, kwargs: dict[str, Any]) -> dict[str, Any]:
    kw = dict(kwargs)
    kw.pop("max_connections", None)  # pool sizing is the Sentinel pool's own
    kw.pop("single_connection_client", None)
    kw.update(db=target.db, password=target.password, username=target.username)
    return kw


class _SentinelBackedClient(aioredis.Redis):
    """A Sentinel service's primary client that also closes its Sentinel manager's clients
    (redis-py leaves them to the caller: a ResourceWarning per short-lived client)."""

    sentinel_manager: aiosentinel.Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.sentinel_manager is not None:
            await self.sentinel_manager.aclose()


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
    client.sentinel_manager = manager
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
    return node_url(target, host, port)


def node_url(target: SentinelTarget, host: str, port: int) -> str:
    """The redis:// URL of one node of `target`'s service (its data nodes' credentials and
    database)."""
    auth = ""
    if target.password is not None:
        user = quote(target.username, safe="") if target.username else ""
        auth = f"{user}:{quote(target.password, safe='')}@"
    host_part = f"[{host}]" if ":" in host else host
    return f"redis://{auth}{host_part}:{port}/{target.db}"
