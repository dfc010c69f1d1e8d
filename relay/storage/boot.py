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

# Set once per Redis run (the scripts compare run ids; the start instant, from Redis's
# uptime, is there for people reading the key).
_MARK = """
local info = redis.call('INFO', 'server')
-- minReplicas shards ('w'): the run is the process and its replication history. A node
-- deposed by a failover (its data replaced by a full sync) and promoted again keeps its
-- run_id but has a new replid, and what it acknowledged before may be gone: a new run.
local run_id = string.match(info, 'run_id:(%x+)')
if ARGV[1] == 'w' then
  local replid = string.match(redis.call('INFO', 'replication'), 'master_replid:(%x+)') or ''
  run_id = run_id .. string.sub(replid, 1, 12)
end
local cur = redis.call('GET', KEYS[1])
local same_mode = (string.sub(cur or '', -2) == ':w') == (ARGV[1] == 'w')
if cur and string.sub(cur, 1, #run_id + 1) == run_id .. ':' and same_mode then return cur end
local up = tonumber(string.match(info, 'uptime_in_seconds:(%d+)'))
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local v = run_id .. ':' .. (now - up * 1000)
if ARGV[1] == 'w' then v = v .. ':w' end
redis.call('SET', KEYS[1], v)
return v
"""


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
    await client.eval(_MARK, 1, K.SHARD_BOOT, "w" if waited else "")


# For `relayfleet restore`, which runs the mark through a replication stream (relay/backup.py).
MARK_SCRIPT = _MARK
