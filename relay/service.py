"""Queue operations as the API sees them: routing, internal retries, long-poll waits, metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any, Protocol, TypeVar

from relay import metrics
from relay.bounded import Bounded
from relay.fleet.routing import Route, ShardRouter
from relay.retrying import OUTCOME_UNKNOWN, SHARD_FAILOVER, SLOT_FENCED, retrying
from relay.settings import Settings
from relay.storage.store import (
    EnqueueOutcome,
    EnqueueRequest,
    Message,
    ReadResult,
    ReplicationTimeout,
    SlotMigrating,
    SlotMoved,
    StatusResult,
    StoreFailover,
    StoreOutcomeUnknown,
    StoreRejected,
    StoreUnavailable,
    enqueue_outcome,
)
from relay.storage.wakeups import Stored, Waiter

T = TypeVar("T")

OnStored = Callable[[bytes, bytes, int, int], None]  # recipient, channel, seq, subscribers
OnWait = Callable[[bytes, bytes, int], None]  # recipient, channel, +1 a long-poll parks / -1 it leaves


class _Rerouted(Exception):
    """MOVED, and the reloaded map routes the queue elsewhere: retried at once."""


class Unavailable(Exception):
    """Answer 503 with Retry-After: the shard is down or the slot stayed fenced too long."""

    def __init__(self, reason: str, retry_after_s: int = 1, code: str = "unavailable") -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.code = code


def _failover_retryable(exc: StoreUnavailable, idempotent: bool) -> bool:
    """Whether a Sentinel-managed shard's failure may be retried on the next primary: always
    when nothing ran (refused, never sent); when it may have run, only for operations that
    are safe to repeat (reads, acks, enqueues carrying an Idempotency-Key)."""
    if isinstance(exc, ReplicationTimeout):
        return False  # it ran; the client decides (503 replication_timeout)
    return isinstance(exc, StoreFailover) or idempotent


class TooManyWaiters(Exception):
    pass


# Label children resolved once: .labels() per request was visible in profiles.
_ENQUEUED = metrics.MESSAGES.labels("enqueued")
_ENQUEUED_BYTES = metrics.BYTES.labels("enqueued")
_DUPLICATE = metrics.MESSAGES.labels("duplicate")
_WAITERS = metrics.WAITERS
_WAKEUP_SECONDS = metrics.WAKEUP_SECONDS
_DELIVERED = {op: (metrics.MESSAGES.labels(op), metrics.BYTES.labels(op)) for op in ("delivered", "drained")}


def now_ms() -> int:
    return int(time.time() * 1000)


class QueueService:
    def __init__(self, fleet: ShardRouter, settings: Settings) -> None:
        self.fleet = fleet
        self.settings = settings
        self.on_stored: OnStored | None = None
        self.on_wait: OnWait | None = None  # fleet-wide presence (relay/presence.py)
        self.closing = False
        self._waiters = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        # recipient -> last reconciliation (monotonic)
        self._reconciled: Bounded[bytes, float] = Bounded(4096)

    # -- plumbing ------------------------------------------------------------
    def call(
        self, recipient: bytes, channel: bytes, op: Callable[[Route], Awaitable[T]], idempotent: bool = True
    ) -> Awaitable[T]:
        """Run `op` on the queue's shard: `call_at` its route."""
        return self.call_at(self.fleet.route(recipient, channel), recipient, channel, op, idempotent)

    async def call_at(
        self,
        route: Route,
        recipient: bytes,
        channel: bytes,
        op: Callable[[Route], Awaitable[T]],
        idempotent: bool = True,
    ) -> T:
        """Run `op` on the queue's shard at `route`, retrying MOVED and fenced slots (and, on a
        Sentinel-managed shard, a failover) within the deadline, each retry routed afresh.
        `idempotent`: `op` may be repeated after a failure that left unknown whether it ran."""
        deadline = asyncio.get_running_loop().time() + self.settings.request_deadline_s
        try:
            return await op(route)
        except (SlotMoved, SlotMigrating, StoreUnavailable) as exc:
            return await self._retry(recipient, channel, op, route, deadline, exc, idempotent)

    async def _retry(
        self,
        recipient: bytes,
        channel: bytes,
        op: Callable[[Route], Awaitable[T]],
        route: Route,
        deadline: float,
        exc: Exception,
        idempotent: bool = True,
    ) -> T:
        """What `call` does once an attempt on `route` failed with `exc`: retry within
        `deadline` (relay/retrying.py: SLOT_FENCED, SHARD_FAILOVER) or answer 503."""
        first: list[Exception] = [exc]

        async def attempt() -> T:
            nonlocal route
            try:
                if first:
                    raise first.pop()  # `call`'s own attempt, decided on like every later one
                route = self.fleet.route(recipient, channel)
                return await op(route)
            except SlotMoved as moved:
                if await self.fleet.refresh():  # the new map routes elsewhere: go at once
                    raise _Rerouted from moved
                raise

        def worth(err: BaseException) -> bool:
            if isinstance(err, ReplicationTimeout):
                return False  # the write may be stored: the sender's Idempotency-Key decides
            if isinstance(err, StoreUnavailable):
                return route.store.follows_failover and _failover_retryable(err, idempotent)
            return isinstance(err, SlotMoved | SlotMigrating | _Rerouted)

        def wait(err: BaseException, retry: int) -> float:
            if isinstance(err, _Rerouted):
                return 0.0
            return (SHARD_FAILOVER if isinstance(err, StoreUnavailable) else SLOT_FENCED).wait_s(retry)

        def counted(err: BaseException, _: float) -> None:
            why = "failover" if isinstance(err, StoreUnavailable) else "migrating"
            metrics.RETRIES.labels("moved" if isinstance(err, SlotMoved | _Rerouted) else why).inc()

        try:
            return await retrying(SLOT_FENCED, worth, deadline=deadline, wait=wait, on_retry=counted)(attempt)
        except ReplicationTimeout as err:
            metrics.REDIS_ERRORS.labels(route.store.name, "replication_timeout").inc()
            raise Unavailable(
                "too few replicas confirmed the write; it may be stored, retry with the same Idempotency-Key",
                code="replication_timeout",
            ) from err
        except StoreUnavailable as err:
            metrics.REDIS_ERRORS.labels(route.store.name, "unavailable").inc()
            reason = "shard failing over" if worth(err) else "shard unavailable"
            raise Unavailable(reason) from err
        except (SlotMoved, _Rerouted):
            raise Unavailable("slot moved; shard map not yet updated") from None
        except SlotMigrating:
            raise Unavailable("slot is being migrated") from None

    async def _wait_for(
        self,
        recipient: bytes,
        channel: bytes,
        route: Route,
        wait_s: float,
        fetch: Callable[[Route], Awaitable[ReadResult]],
        read_at: tuple[int | None, int] | None = None,
        early: EarlyAnswer | None = None,
    ) -> ReadResult:
        """Long-poll on the queue at `route`: register, read, and only then wait (no
        lost-wakeup window).

        `read_at` (fromSeq, limit) of a read: a wakeup that carries the messages following
        the last read is answered from them, without reading them back (Waiter.take); with
        `early`, they are handed to it as the wakeup arrives (Waiter.expect), and this returns
        the same result once its task resumes."""
        if self._waiters >= self.settings.max_waiters:
            raise TooManyWaiters()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        self._waiters += 1
        _WAITERS.inc()
        parked = False
        try:
            while True:
                with route.hub.waiting(route.keys.wake) as waiter:
                    await waiter.ready(min(1.0, max(0.0, deadline - loop.time())))
                    while True:
                        waiter.forget()  # this read sees whatever woke us so far
                        result = await fetch(route)
                        remaining = deadline - loop.time()
                        if result.messages or remaining <= 0 or self.closing:
                            if result.messages and waiter.woken_at_ms is not None:
                                _WAKEUP_SECONDS.observe(max(0, now_ms() - waiter.woken_at_ms) / 1000)
                            return result
                        # counted once it waits, not for reads that answer at once, and only on a
                        # queue that exists (last_seq 0: no meta), so that polls of unknown queues
                        # leave Redis as they found it (tests/hostile/test_storage_attacks.py)
                        if not parked and result.last_seq > 0 and self.on_wait is not None:
                            parked = True
                            self.on_wait(recipient, channel, 1)
                        carried = await self._carried(waiter, result, deadline, read_at, early)
                        if carried is not None:
                            return carried
                        # a new shard map wakes every waiter (ShardRouter.reload): the queue
                        # may live elsewhere now, and its waiter must register there
                        moved = self.fleet.route(recipient, channel)
                        if moved.hub is not route.hub:
                            route = moved
                            break
        finally:
            self._waiters -= 1
            _WAITERS.dec()
            if parked and self.on_wait is not None:
                self.on_wait(recipient, channel, -1)

    async def _carried(
        self,
        waiter: Waiter,
        last: ReadResult,
        deadline: float,
        read_at: tuple[int | None, int] | None,
        early: EarlyAnswer | None = None,
    ) -> ReadResult | None:
        """Wait after the empty read `last`; the answer when wakeups carried the messages that
        follow it, None when the queue must be read again (woken otherwise, or timed out)."""
        loop = asyncio.get_running_loop()
        budget = self.settings.limits.max_response_bytes
        while True:
            if early is not None and read_at is not None:
                # the answerer itself, bound to the epoch: no Python frame between the waiter
                # and the answer
                answer = partial(early, last.epoch)
                waiter.expect(
                    answer, last.epoch, last.last_seq, read_at[0], read_at[1], budget, early.prepare
                )
            woken = await waiter.wait(deadline - loop.time())
            got: list[Message] | None
            if waiter.taken is not None:  # handed to `early` as the wakeup arrived
                got, waiter.taken = waiter.taken, None
            elif not woken or read_at is None or self.closing:
                return None
            else:
                got = waiter.take(last.epoch, last.last_seq, read_at[0], read_at[1], budget)
            if got is None:
                return None
            if got:
                if waiter.woken_at_ms is not None:
                    _WAKEUP_SECONDS.observe(max(0, now_ms() - waiter.woken_at_ms) / 1000)
                return ReadResult(got, last.epoch, got[-1].seq)
            # woken by nothing new (a notice, a message the read already saw): wait on

    # -- operations ------------------------------------------------------------
    def enqueue(self, req: EnqueueRequest, admitted: bool = False) -> asyncio.Future[EnqueueOutcome]:
        """Send an enqueue; the returned future (await it) gets its outcome.

        The bookkeeping of a stored message (metrics, `on_stored`) runs as Redis's reply
        is read, so it happens even when the awaiting handler was cancelled because its
        client left, without a task per request (a shielded task was ~9 % of enqueue CPU).
        Fenced or moved slots and a lost shard continue as `call` would, in a task. An
        attempt whose reply was lost (reply timeout, connection cut: Redis may have stored
        it) is resent with its token until Redis says what it did (_Enqueue.resolve), so a
        stored message is never answered 5xx and never stored twice by the relay.

        A non-default channel's message is first admitted by its recipient's home shard
        (the recipient-wide quotas, docs/design-decisions.md "Per-recipient quotas"): one more
        round trip, in a task of its own (its refund is owed even when the caller leaves);
        `admitted`: that round trip was made (the enqueue call follows it).
        The default channel's enqueue checks them itself, in its one call.

        One frame from here to the store's write (`ShardStore.enqueue_to`): on a wake's path
        each call between the socket and Redis runs from cold caches (docs/design-decisions.md
        "The wake at nchan parity")."""
        if req.channel and not admitted and self.settings.limits.recipient_limited:
            return asyncio.shield(self._spawn(self._admit_then_enqueue(req)))
        done: asyncio.Future[EnqueueOutcome] = asyncio.get_running_loop().create_future()
        ts = req.now_ms or now_ms()  # every attempt of this enqueue stores the same time
        route = self.fleet.route(req.recipient, req.channel)
        # the job (the reply's sink) is built once the enqueue is written: not in the wake's path
        route.store.enqueue_to(None, route.keys, req, ts, make_sink=partial(self._job, done, req, ts, route))
        if len(req.payload) <= CARRY_LOCAL_BYTES:
            # while Redis stores it, this process's live sockets on the queue ready their frames
            route.hub.prepare(route.keys.wake, ts, req)
        return done

    def admits_first(self, channel: bytes) -> bool:
        """Whether an enqueue to `channel` takes its recipient's admit round trip before its
        enqueue call: a caller that pipelines requests waits for its outcome before starting
        the next one (relay/http/fastpath.py), or a later enqueue would run first."""
        return bool(channel) and self._recipient_limited

    def _job(
        self, done: asyncio.Future[EnqueueOutcome], req: EnqueueRequest, ts: int, route: Route, token: bytes
    ) -> _Enqueue:
        """The first attempt of an enqueue, as its ReplySink (`enqueue`)."""
        sent_at = asyncio.get_running_loop().time()
        job = _Enqueue(self, done, req, ts, route, sent_at + self.settings.request_deadline_s, sent_at)
        job.token = token
        return job

    async def _admit_then_enqueue(self, req: EnqueueRequest) -> EnqueueOutcome:
        """Admit a non-default channel's message on its recipient's home shard, then enqueue it
        (refunded when the channel's shard refuses it; a failure may have stored it: no
        refund, the counters stay high until reconciled). A refusal for a held cap or the
        channel cap first reconciles the record with the queues (at most once a second per
        recipient and relay) and asks again: the counters may be high, never low."""
        ts = req.now_ms or now_ms()
        recipient = req.recipient
        verdict = await self._admit(req, ts)
        if verdict.kind == "full" and self._may_reconcile(recipient) and await self.reconcile(recipient):
            verdict = await self._admit(req, ts)
        if verdict.kind != "stored":
            self._stored(req, verdict)
            return verdict
        outcome = await self.enqueue(req._replace(now_ms=ts), admitted=True)
        if outcome.kind != "stored":
            await self._refund(recipient, 1, len(req.payload), ts)
        return outcome

    def _admit(self, req: EnqueueRequest, ts: int) -> Awaitable[EnqueueOutcome]:
        size = len(req.payload)
        return self.call(
            req.recipient, b"", lambda r: r.store.recipient_admit(req.recipient, req.channel, size, ts)
        )

    def _may_reconcile(self, recipient: bytes) -> bool:
        """At most one reconciliation a second per recipient from this relay (a blast at a full
        recipient must not turn each refusal into a status read of every channel)."""
        now = time.monotonic()
        last = self._reconciled.get(recipient)
        if last is not None and now - last < 1.0:
            return False
        self._reconciled.put(recipient, now)
        return True

    async def _refund(self, recipient: bytes, messages: int, size: int, admitted_ms: int = 0) -> None:
        """Give back to the recipient's record; a refund that fails leaves the counters high
        (refusing early until reconciled), so it never fails the request that made it."""
        ts = now_ms()
        try:
            await self.call(
                recipient,
                b"",
                lambda r: r.store.recipient_refund(recipient, messages, size, ts, admitted_ms),
                False,
            )
        except (Unavailable, StoreUnavailable, StoreRejected):
            metrics.REDIS_ERRORS.labels("home", "refund_lost").inc()

    async def channels(self, recipient: bytes) -> list[tuple[bytes, StatusResult]]:
        """The recipient's channels (the default one first) and what each holds; reconciles its
        record with them on the way. Creates no Redis state for an unknown recipient."""
        listed, admits, _ = await self.call(recipient, b"", lambda r: r.store.recipient_channels(recipient))
        chans = [b"", *listed]
        found = await asyncio.gather(*(self.status(recipient, ch) for ch in chans))
        if listed:
            await self._settle(recipient, admits, list(zip(listed, found[1:], strict=True)))
        return list(zip(chans, found, strict=True))

    async def reconcile(self, recipient: bytes) -> bool:
        """Replace the recipient's held counters by what its channels hold; True when applied."""
        listed, admits, _ = await self.call(recipient, b"", lambda r: r.store.recipient_channels(recipient))
        if not listed:
            return False
        found = await asyncio.gather(*(self.status(recipient, ch) for ch in listed))
        return await self._settle(recipient, admits, list(zip(listed, found, strict=True)))

    async def _settle(self, recipient: bytes, admits: int, found: list[tuple[bytes, StatusResult]]) -> bool:
        held = [(ch, st.count, st.bytes) for ch, st in found]
        # an admitted enqueue may still be on its way this long after its admit
        quiet_ms = int(1000 * (self.settings.request_deadline_s + self.settings.limits.write_timeout_s))
        ts = now_ms()
        return await self.call(
            recipient, b"", lambda r: r.store.recipient_settle(recipient, admits, ts, quiet_ms, held)
        )

    @property
    def _recipient_limited(self) -> bool:
        return self.settings.limits.recipient_limited

    def _stored(self, req: EnqueueRequest, outcome: EnqueueOutcome) -> None:
        """Metrics and hooks for an enqueue Redis has answered."""
        kind = outcome.kind
        if kind == "stored":
            _ENQUEUED.inc(1)
            _ENQUEUED_BYTES.inc(len(req.payload))
            if self.on_stored is not None:
                self.on_stored(req.recipient, req.channel, outcome.seq, outcome.subscribers)
        elif kind == "duplicate":
            _DUPLICATE.inc(1)
        elif kind == "rate_limited":
            if outcome.reason:
                metrics.quota_refused(_ENQUEUE_ROUTE, "recipient_rate")
            else:
                metrics.RATE_LIMITED.inc()
        elif kind == "full" and (reason := _QUOTA_REASON.get(outcome.reason)) is not None:
            metrics.quota_refused(_ENQUEUE_ROUTE, reason)

    async def read(
        self,
        recipient: bytes,
        channel: bytes,
        from_seq: int | None,
        limit: int,
        wait_s: float,
        early: EarlyAnswer | None = None,
    ) -> ReadResult:
        """Read, waiting up to `wait_s` for messages (routed once: the wait and each read).
        `early`: a long-poll's answer from the wakeup that carries its messages, made as the
        wakeup arrives, not a loop turn later when this returns (see `_wait_for`)."""

        def fetch(route: Route) -> Awaitable[ReadResult]:
            return self.call_at(route, recipient, channel, lambda r: r.store.read(r.keys, from_seq, limit))

        route = self.fleet.route(recipient, channel)
        result = await (
            self._wait_for(recipient, channel, route, wait_s, fetch, (from_seq, limit), early)
            if wait_s > 0
            else fetch(route)
        )
        _count("delivered", result)
        return result

    def count_delivered(self, result: ReadResult) -> None:
        """Metrics of messages delivered other than through `read` (live delivery from wakeups)."""
        _count("delivered", result)

    async def drain(self, recipient: bytes, channel: bytes, limit: int, wait_s: float) -> ReadResult:
        def fetch(route: Route) -> Awaitable[ReadResult]:
            # a drain that may have run must not be repeated: its messages are gone
            return self.call_at(route, recipient, channel, lambda r: r.store.drain(r.keys, limit), False)

        route = self.fleet.route(recipient, channel)
        result = await (
            self._wait_for(recipient, channel, route, wait_s, fetch) if wait_s > 0 else fetch(route)
        )
        if result.messages and channel and self._recipient_limited:
            await self._refund(
                recipient, len(result.messages), sum([len(m.payload) for m in result.messages])
            )
        _count("drained", result)
        return result

    async def ack(
        self, recipient: bytes, channel: bytes, up_to_seq: int | None, seqs: list[int] | None
    ) -> int:
        removed, size = await self.call(
            recipient, channel, lambda r: r.store.ack_sized(r.keys, up_to_seq, seqs)
        )
        if removed and channel and self._recipient_limited:
            await self._refund(recipient, removed, size)
        metrics.MESSAGES.labels("acked").inc(removed)
        return removed

    async def status(self, recipient: bytes, channel: bytes, above_seq: int | None = None) -> StatusResult:
        return await self.call(recipient, channel, lambda r: r.store.status(r.keys, above_seq))

    async def use_nonce(self, recipient: bytes, member: str, lifetime_ms: int) -> bool:
        """Record a signature nonce on the recipient's shard; False when replayed."""
        ts = now_ms()
        return await self.call(
            recipient, b"", lambda r: r.store.use_nonce(r.keys.slot, member, ts, lifetime_ms), False
        )

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)
        return task


_ENQUEUE_ROUTE = "/v1/queues/{recipient}/messages"
# enqueue.lua's and rcpt_admit.lua's refusal reasons -> relayfleet_quota_refusals_total's
_QUOTA_REASON = {
    "channels": "recipient_channels",
    "recipient messages": "recipient_messages",
    "recipient bytes": "recipient_bytes",
    "reserve": "shard_reserve",
}


class EarlyAnswer(Protocol):
    """A long-poll's answer made from the messages a wakeup carried, as it arrives
    (QueueService.read): called with the queue's epoch and them (ascending seqs, the ones
    following the read before the wait), True when it answered (wrote) them; `prepare`
    (relay.storage.wakeups.Prepare) is told of an enqueue this process sent to the queue while
    Redis stores it. Both run inside a Redis reply's processing or an enqueue's: never raise."""

    def __call__(self, epoch: str, messages: list[Message], /) -> bool: ...

    def prepare(self, epoch: str, stored_ms: int, stored: Stored, /) -> None: ...


class _Enqueue:
    """One enqueue from sending to its outcome (see QueueService.enqueue); the
    pipeline hands it Redis's reply directly (it is the command's ReplySink)."""

    __slots__ = ("answered", "deadline", "outcome", "req", "route", "sent_at", "service", "token", "ts")

    token: bytes  # the first attempt's (RESP-encoded), reused by resends

    def __init__(
        self,
        service: QueueService,
        outcome: asyncio.Future[EnqueueOutcome],
        req: EnqueueRequest,
        ts: int,
        route: Route,
        deadline: float,
        sent_at: float,
    ) -> None:
        self.service = service
        self.outcome = outcome
        self.req = req
        self.ts = ts  # the stored time, the same in every attempt
        self.route = route  # of the first attempt; a retry routes afresh
        self.deadline = deadline
        self.sent_at = sent_at  # the loop's time
        self.answered = False

    # -- ReplySink: called by the pipeline once, with the reply or the failure --------
    def done(self) -> bool:
        return self.answered

    def set_result(self, reply: Any, /) -> None:
        self.answered = True
        try:
            outcome = enqueue_outcome(reply)
        except (SlotMoved, SlotMigrating) as exc:
            self.service._spawn(self.settle(self.retry(exc)))
            return
        except Exception as exc:  # handed to the caller, as an awaited call would raise it
            self.fail(exc)
            return
        if (
            outcome.epoch
            and len(self.req.payload) <= CARRY_LOCAL_BYTES
            and self.route.hub.carry(self.route.keys.wake, self.ts, outcome.epoch, outcome.seq, self.req)
        ):
            # handed to this process's waiters on the queue (they need not read it back), one
            # of which answers from its task: the sender's answer follows on the next loop turn
            asyncio.get_running_loop().call_soon(self.finish, outcome)
            return
        # (waiters that answered from the carried message wrote their answers already: the
        # sender's answer follows them at once, not a loop turn later behind their tasks)
        self.finish(outcome)

    def set_exception(self, exception: BaseException, /) -> None:
        self.answered = True
        if isinstance(exception, StoreOutcomeUnknown):
            self.service._spawn(self.settle(self.resolve()))
        elif isinstance(exception, StoreUnavailable):
            self.service._spawn(self.settle(self.retry(exception)))
        else:
            self.fail(exception)

    def finish(self, outcome: EnqueueOutcome) -> None:
        try:
            self.service._stored(self.req, outcome)
        except Exception as exc:
            self.fail(exc)
            return
        if not self.outcome.done():  # cancelled when the handler was
            self.outcome.set_result(outcome)

    def fail(self, exc: BaseException) -> None:
        if self.outcome.done():
            return
        if isinstance(exc, asyncio.CancelledError):
            self.outcome.cancel()
        else:
            self.outcome.set_exception(exc)

    def attempt(self, route: Route) -> Awaitable[EnqueueOutcome]:
        return route.store.enqueue(route.keys, self.req, self.ts, self.token)

    def resend(self, route: Route) -> Awaitable[EnqueueOutcome]:
        """The same attempt again (same time and token), asking Redis whether it stored it."""
        return route.store.enqueue(route.keys, self.req, self.ts, self.token, resend=True)

    async def settle(self, attempts: Awaitable[EnqueueOutcome]) -> None:
        """Finish with the outcome `attempts` gives, or fail with what it raises."""
        try:
            outcome = await attempts
        except BaseException as err:
            self.fail(err)
            if not isinstance(err, Exception):
                raise
            return
        self.finish(outcome)

    async def resolve(self) -> EnqueueOutcome:
        """The reply to a sent attempt was lost. Resend until Redis answers: with the
        message's seq if the lost attempt stored it, else by storing it now. Redis can tell
        only within the queue's rate window (enqueue.lua keeps "<seq>:<token>" there that
        long), so resends stop there (or at the request deadline); after that the outcome
        is unknown and the sender gets 503 (docs/reliability.md: use Idempotency-Key)."""
        window_s = self.service.settings.limits.rate_window_ms / 1000
        limit = min(self.deadline, self.sent_at + window_s - _RESOLVE_MARGIN_S)

        async def resend_now() -> EnqueueOutcome:
            route = self.service.fleet.route(self.req.recipient, self.req.channel)
            try:
                return await self.resend(route)
            except (SlotMoved, SlotMigrating) as exc:  # a migration copies the rate window too
                return await self.service._retry(
                    self.req.recipient, self.req.channel, self.resend, route, limit, exc
                )

        def counted(_: BaseException, __: float) -> None:
            metrics.RETRIES.labels("outcome_unknown").inc()

        try:
            return await retrying(OUTCOME_UNKNOWN, StoreUnavailable, deadline=limit, on_retry=counted)(
                resend_now
            )
        except StoreUnavailable:
            raise Unavailable("shard unavailable; the message may have been stored") from None

    def retry(self, exc: Exception) -> Awaitable[EnqueueOutcome]:
        # repeated after an unknown outcome only under an Idempotency-Key (no double store)
        return self.service._retry(
            self.req.recipient,
            self.req.channel,
            self.attempt,
            self.route,
            self.deadline,
            exc,
            bool(self.req.idempotency_key),
        )


# An enqueue hands its stored message to this process's waiters up to this size (larger
# ones they read back: a waiter that cannot use it would pin it until its next read).
CARRY_LOCAL_BYTES = 64 * 1024
_RESOLVE_MARGIN_S = 1.0  # clock skew between relays and Redis's view of the rate window


def _count(op: str, result: ReadResult) -> None:
    if result.messages:
        messages, size = _DELIVERED[op]
        messages.inc(len(result.messages))
        size.inc(sum([len(m.payload) for m in result.messages]))
