"""Running Lua scripts on the cold paths: the migrator (async) and the retention job (sync).

Both send pipelines of EVALSHA calls and must survive a Redis that lost its script cache
(a restart, a failover to a replica, SCRIPT FLUSH): the first NOSCRIPT reply loads the
scripts and repeats the batch once. Which calls are repeated is the caller's choice:

- ``redo="all"``: every call of the batch is safe to repeat (the migration's compare-and-set
  steps are), and a trailing ``WAIT`` must follow the repeated writes in the same pipeline.
- ``redo="missing"``: only the calls Redis refused run again; the others' replies stand
  (a retention call that ran carries counts a repeat would not report again).

Replies come back as the pipeline gave them, errors in place: the caller decides what an
error means. A script that cannot be loaded raises ScriptLoadFailed.

The relays' hot path does not use this module: relay/storage/pipeline.py writes EVALSHA as
raw RESP and reloads inside its batch loop, which this module's redis-py pipelines would slow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from relay.storage.scripts import Script

Redo = Literal["all", "missing"]
Command = Sequence[Any]


class ScriptLoadFailed(Exception):
    """SCRIPT LOAD failed after a NOSCRIPT reply; `cause` is the Redis or OS error, which the
    caller classifies as it would any other (a lost connection is retryable)."""

    def __init__(self, cause: RedisError | OSError) -> None:
        super().__init__(f"loading scripts failed: {type(cause).__name__}")
        self.cause = cause


def evalsha(script: Script, keys: Sequence[str], args: Sequence[Any] = ()) -> tuple[Any, ...]:
    """The EVALSHA command calling `script` (prelude + file, scripts.py) with these keys and args."""
    return ("EVALSHA", script.sha, len(keys), *keys, *args)


def _refused(replies: Sequence[Any]) -> list[int]:
    return [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]


def _merge(replies: list[Any], redone: list[int], again: Sequence[Any]) -> list[Any]:
    for i, r in zip(redone, again, strict=True):
        replies[i] = r
    return replies


def run(client: redis.Redis, commands: Sequence[Command], scripts: Sequence[Script], redo: Redo) -> list[Any]:
    """One pipelined round trip (two after a NOSCRIPT); `scripts` are the ones to (re)load."""
    replies = _send(client, commands)
    refused = _refused(replies)
    if not refused:
        return replies
    try:
        for script in scripts:
            client.script_load(script.source)
    except (RedisError, OSError) as exc:
        raise ScriptLoadFailed(exc) from exc
    if redo == "all":
        return _send(client, commands)
    return _merge(replies, refused, _send(client, [commands[i] for i in refused]))


def _send(client: redis.Redis, commands: Sequence[Command]) -> list[Any]:
    pipe: Any = client.pipeline(transaction=False)  # redis-py's Pipeline is partly untyped
    for cmd in commands:
        pipe.execute_command(*cmd)
    return list(pipe.execute(raise_on_error=False))


async def run_async(
    client: aioredis.Redis, commands: Sequence[Command], scripts: Sequence[Script], redo: Redo
) -> list[Any]:
    """`run` for asyncio clients."""
    replies = await _send_async(client, commands)
    refused = _refused(replies)
    if not refused:
        return replies
    try:
        for script in scripts:
            await client.script_load(script.source)
    except (RedisError, OSError) as exc:
        raise ScriptLoadFailed(exc) from exc
    if redo == "all":
        return await _send_async(client, commands)
    return _merge(replies, refused, await _send_async(client, [commands[i] for i in refused]))


async def _send_async(client: aioredis.Redis, commands: Sequence[Command]) -> list[Any]:
    pipe: Any = client.pipeline(transaction=False)  # redis.asyncio's Pipeline is partly untyped
    for cmd in commands:
        pipe.execute_command(*cmd)
    return list(await pipe.execute(raise_on_error=False))
