"""Coalesces concurrent script calls into Redis pipelines.

One awaited round trip per request caps a process near 9k req/s; sending every
call that arrived while the previous pipeline was in flight as one batch lifts
that ceiling (DESIGN §4, measured in docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from relay.storage.scripts import ALL, Script


class StoreUnavailable(Exception):
    """The shard's Redis did not answer; the caller answers 503 + Retry-After."""


class StoreRejected(Exception):
    """Redis refused the write (e.g. OOM under noeviction); the caller answers 507."""


_Item = tuple[Script, tuple[str, ...], tuple[bytes | str | int, ...], "asyncio.Future[Any]"]


class ScriptBatcher:
    def __init__(self, client: aioredis.Redis, max_inflight: int = 3, max_batch: int = 512) -> None:
        self._client = client
        self._max_inflight = max_inflight
        self._max_batch = max_batch
        self._pending: deque[_Item] = deque()
        self._inflight = 0
        self._scheduled = False

    async def load_scripts(self) -> None:
        for script in ALL:
            await self._client.script_load(script.source)

    def call(self, script: Script, keys: tuple[str, ...], args: tuple[bytes | str | int, ...]) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((script, keys, args, fut))
        self._kick()
        return fut

    def _kick(self) -> None:
        if not self._scheduled and self._inflight < self._max_inflight:
            self._scheduled = True
            # call_soon lets every request parsed in this loop iteration join the batch
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        while self._pending and self._inflight < self._max_inflight:
            n = min(len(self._pending), self._max_batch)
            batch = [self._pending.popleft() for _ in range(n)]
            self._inflight += 1
            asyncio.get_running_loop().create_task(self._run(batch))

    async def _run(self, batch: list[_Item]) -> None:
        try:
            await self._send(batch, reload_on_noscript=True)
        finally:
            self._inflight -= 1
            if self._pending:
                self._kick()

    async def _send(self, batch: list[_Item], reload_on_noscript: bool) -> None:
        try:
            pipe = self._client.pipeline(transaction=False)
            for script, keys, args, _ in batch:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            results = await pipe.execute(raise_on_error=False)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            _fail(batch, StoreUnavailable(type(exc).__name__))
            return
        except RedisError as exc:
            _fail(batch, StoreUnavailable(type(exc).__name__))
            return
        retry: list[_Item] = []
        for item, result in zip(batch, results, strict=True):
            fut = item[3]
            if fut.done():
                continue
            if isinstance(result, NoScriptError) and reload_on_noscript:
                retry.append(item)
            elif isinstance(result, RedisError):
                text = str(result)
                if "OOM" in text or "maxmemory" in text:
                    fut.set_exception(StoreRejected("out of memory"))
                else:
                    fut.set_exception(StoreUnavailable(text.split("\n", 1)[0][:200]))
            else:
                fut.set_result(result)
        if retry:
            # Redis lost its script cache (restart, SCRIPT FLUSH): load once, resend once.
            try:
                await self.load_scripts()
            except (RedisError, OSError) as exc:
                _fail(retry, StoreUnavailable(type(exc).__name__))
                return
            await self._send(retry, reload_on_noscript=False)


def _fail(batch: list[_Item], exc: Exception) -> None:
    for *_, fut in batch:
        if not fut.done():
            fut.set_exception(exc)
