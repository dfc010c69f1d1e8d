"""Every retry of the project, declared once: the named policies, and the one way to run them.

A loop that repeats a failed call (relay, client library, operator, tools) runs it through
`retrying` (asyncio) or `retrying_blocking` (a thread), both on tenacity
(docs/design-decisions.md, "One retry policy"). A policy here says how long to wait between
attempts and when to give up; the call site adds only what is its own: which of its errors
are worth another attempt (everything else, cancellation included, goes through at once), a
wait the server asked for (Retry-After), a deadline of its request, what to count or log.
When the policy gives up, the last error itself is raised (never tenacity's RetryError), so
each caller answers it as it did before.

A leaf: tenacity and the standard library only, so the client library may use it (import-linter
contract "client") and so may the operator, the Spark jobs and the tools.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tenacity import AsyncRetrying, RetryCallState, Retrying


@dataclass(frozen=True, slots=True)
class Policy:
    """Waits of `first_s`, times `factor` each retry, at most `cap_s`, plus a random share of
    `jitter_s` (so that clients told to back off together do not come back together); at most
    `attempts` attempts in all (None: until the caller's deadline, its stop, or cancellation)."""

    first_s: float
    cap_s: float
    attempts: int | None = None
    factor: float = 2.0
    jitter_s: float = 0.0

    def wait_s(self, retry: int) -> float:
        """The wait before retry number `retry` (1: before the second attempt)."""
        base = min(self.cap_s, self.first_s * self.factor ** (retry - 1))
        return base + random.uniform(0, self.jitter_s) if self.jitter_s else base


# -- the named policies: what each retries is said where it is used ------------------------------

# The relay's queue operations (relay/service.py), each within its request's deadline
# (Settings.request_deadline_s): a Sentinel shard failing over (~1-3 s) ...
SHARD_FAILOVER = Policy(first_s=0.005, cap_s=0.2)
# ... a slot fenced by a migration, or MOVED where the reloaded map shows no move yet ...
SLOT_FENCED = Policy(first_s=0.005, cap_s=0.1)
# ... an enqueue whose reply was lost, resent while Redis can still tell (its rate window).
OUTCOME_UNKNOWN = Policy(first_s=0.01, cap_s=0.25)
# A shard's wakeup subscriber connecting (relay/storage/wakeups.py): for as long as it runs.
WAKEUP_CONNECT = Policy(first_s=0.05, cap_s=2.0)
# A subscriber to one Sentinel's failover news (relay/storage/sentinel.py): until unwatched.
SENTINEL_WATCH = Policy(first_s=0.2, cap_s=0.2)
# The Kubernetes API (relay/kubeapi.py, both clients): the first try and five retries, ~6 s.
KUBE_API = Policy(first_s=0.2, cap_s=3.0, attempts=6, jitter_s=0.1)
# The shard-map ConfigMap watch of a relay (relay/fleet/configmap.py): until the relay stops.
CONFIGMAP_WATCH = Policy(first_s=0.5, cap_s=10.0)
# A shard-map write that lost a race to another writer (relay/fleet/contract.py): re-read and
# recompute; the writer says how many attempts. Jittered: two writers that collided and then
# waited alike collided again (two migrations publishing at once lost 8 times in a row in CI).
MAP_WRITE = Policy(first_s=0.05, cap_s=0.4, jitter_s=0.05)
# A migration whose shard failed over mid-run, started again (relay/fleet/migration/protocol.py).
MIGRATION_RESUME = Policy(first_s=0.5, cap_s=0.5)
# The push webhook (relay/push.py) and the device push providers (relay/devicepush: webhook,
# FCM, APNs): four attempts, about 1.5 s in all.
PUSH_WEBHOOK = Policy(first_s=0.2, cap_s=1.6, attempts=4, jitter_s=0.2)
# A request the relay answered 429/503 (relay/client.py): it waits what the relay asked.
RELAY_ASKED = Policy(first_s=1.0, cap_s=1.0)
# The operator's PING of a shard's external Redis (relayfleet_operator/shard_redis.py): three
# tries over ~1.5 s of waits before the shard is called Degraded (one late answer on a loaded
# node is not an outage: it flapped 100 shards Ready -> Degraded under load).
REDIS_PING = Policy(first_s=0.5, cap_s=1.0, attempts=3)
# A server coming up (relay/client.py wait_ready, the tools' local servers): polled until ready.
READY_POLL = Policy(first_s=0.01, cap_s=0.05)


RetryIf = type[BaseException] | tuple[type[BaseException], ...] | Callable[[BaseException], bool]
# (the error, the retry number: 1 before the second attempt) -> seconds to wait; for a wait the
# error decides (a server's Retry-After, a route already fixed); the default is the policy's
Wait = Callable[[BaseException, int], float]
# before each wait: (the error, the seconds about to be waited); counts and logs
OnRetry = Callable[[BaseException, float], None]


def _predicate(retry_if: RetryIf) -> Callable[[BaseException], bool]:
    if isinstance(retry_if, type | tuple):
        kinds = retry_if
        return lambda exc: isinstance(exc, kinds)
    return retry_if


def _error(state: RetryCallState) -> BaseException:
    assert state.outcome is not None
    exc = state.outcome.exception()
    assert exc is not None  # only failed attempts are retried
    return exc


def _common(
    policy: Policy,
    retry_if: RetryIf,
    attempts: int | None,
    wait: Wait | None,
    give_up: Callable[[float], bool] | None,
    on_retry: OnRetry | None,
) -> dict[str, Any]:
    worth = _predicate(retry_if)
    most = attempts if attempts is not None else policy.attempts
    waits = wait if wait is not None else lambda _, retry: policy.wait_s(retry)

    def retry(state: RetryCallState) -> bool:
        # a result is final; only an error the caller names is retried, never a cancellation
        # (nor KeyboardInterrupt, SystemExit: not an Exception), whatever the caller names
        outcome = state.outcome
        if outcome is None or not outcome.failed:
            return False
        exc = _error(state)
        return isinstance(exc, Exception) and worth(exc)

    def wait_s(state: RetryCallState) -> float:
        return max(0.0, waits(_error(state), state.attempt_number))

    def stop(state: RetryCallState) -> bool:
        if most is not None and state.attempt_number >= most:
            return True
        return give_up is not None and give_up(state.upcoming_sleep)

    def before_sleep(state: RetryCallState) -> None:
        if on_retry is not None:
            on_retry(_error(state), state.upcoming_sleep)

    return {"retry": retry, "wait": wait_s, "stop": stop, "before_sleep": before_sleep, "reraise": True}


def retrying(
    policy: Policy,
    retry_if: RetryIf,
    *,
    attempts: int | None = None,
    deadline: float | None = None,
    wait: Wait | None = None,
    on_retry: OnRetry | None = None,
) -> AsyncRetrying:
    """`await retrying(...)(fn, *args)` calls `fn` until it returns, raises an error `retry_if`
    does not name, or the policy gives up (then that last error is raised). `attempts`
    overrides the policy's; `deadline` (the running loop's clock) ends it before a wait that
    would pass it. A fresh object per call: one is not shared between concurrent calls."""
    loop = asyncio.get_running_loop()

    def give_up(sleep_s: float) -> bool:
        return deadline is not None and loop.time() + sleep_s > deadline

    ends = give_up if deadline is not None else None
    return AsyncRetrying(**_common(policy, retry_if, attempts, wait, ends, on_retry))


def retrying_blocking(
    policy: Policy,
    retry_if: RetryIf,
    *,
    attempts: int | None = None,
    deadline: float | None = None,
    wait: Wait | None = None,
    on_retry: OnRetry | None = None,
    stop: threading.Event | None = None,
) -> Retrying:
    """`retrying` for a thread: `deadline` on time.monotonic(); `stop`, when set, ends the
    waits at once and the retries with them (the last error is raised)."""

    def give_up(sleep_s: float) -> bool:
        if stop is not None and stop.is_set():
            return True
        return deadline is not None and time.monotonic() + sleep_s > deadline

    sleep: Callable[[float], Any] = time.sleep if stop is None else stop.wait
    return Retrying(sleep=sleep, **_common(policy, retry_if, attempts, wait, give_up, on_retry))
