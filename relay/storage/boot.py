"""Recording each Redis run in the shard, so the scripts can tell a lost AOF tail.

With ``appendfsync everysec`` a machine crash can lose the last second of writes,
seq counters included; the queue would then hand out acknowledged seqs again under
the same epoch. On every new connection (a restarted Redis always means one), before
it loads the scripts, the relay records the current run as ``<run_id>:<start ms>`` in
``rf:boot``, once per run (on a minReplicas shard a run is the process's run_id and its
replication ID, which a node gets new whenever it is promoted), so no script runs on a
new run before the mark. The
scripts give a queue last written by an earlier run a new epoch and jump its seq
counter (see lua/_prelude.lua, check_boot). Under ``appendfsync always``
nothing acknowledged can be lost, so the key is removed and the check is off.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from relay.storage import keys as K
from relay.storage import scripts


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def mark_boot(client: aioredis.Redis, waited: bool = False) -> None:
    """Record the current Redis run (or remove the mark under appendfsync always).

    `waited`: the shard's writes are answered only after WAIT confirmed replicas hold
    them (minReplicas). A new run there is mostly a failover to a replica that holds every
    acknowledged write: queues keep their epoch, but their seq counters still jump, since
    a write the old primary ran without confirming it may have been read and then lost.
    """
    try:
        conf = await client.config_get("appendfsync")
        policy = next((_text(v) for k, v in conf.items() if _text(k) == "appendfsync"), "")
    except ResponseError:
        policy = ""  # CONFIG refused (managed Redis): assume a tail can be lost
    if policy == "always":
        await client.delete(K.SHARD_BOOT)
        return
    await client.eval(scripts.BOOT_MARK.source, 1, K.SHARD_BOOT, "w" if waited else "")


# For `relayfleet restore`, which runs the mark through a replication stream (relay/backup/restoring.py).
MARK_SCRIPT = scripts.BOOT_MARK.source
