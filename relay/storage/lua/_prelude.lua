-- Shared prelude, prepended to every script by relay/storage/scripts.py.
-- fence(state_key): nil when this shard owns the slot; otherwise the reply to
-- return at once: {'moved', shard, epoch} or {'migrating'} (retryable).
local function fence(state_key)
  local st = redis.call('GET', state_key)
  if not st then return nil end
  if st == 'migrating' or st == 'importing' then return {'migrating'} end
  local shard, epoch = string.match(st, '^moved (%S+) (%d+)$')
  if shard then return {'moved', shard, epoch} end
  return {'migrating'}
end

-- Sum of payload sizes of XRANGE-style entries (field 'n' holds the size).
local function entry_bytes(entries)
  local total = 0
  for _, e in ipairs(entries) do
    local f = e[2]
    for i = 1, #f, 2 do
      if f[i] == 'n' then total = total + tonumber(f[i + 1]) end
    end
  end
  return total
end

-- Keep the per-slot load statistics the Spark jobs read without touching payloads.
local function slot_stats(stats_key, dmsgs, dbytes)
  if dmsgs ~= 0 then redis.call('HINCRBY', stats_key, 'msgs', dmsgs) end
  if dbytes ~= 0 then redis.call('HINCRBY', stats_key, 'bytes', dbytes) end
end

-- A queue gets its epoch the first time anyone touches it, so every answer
-- carries one; a lost or reset history shows up as a different epoch.
local function ensure_epoch(meta_key, index_key, qid, epoch, now)
  local cur = redis.call('HGET', meta_key, 'epoch')
  if cur then return cur end
  redis.call('HSET', meta_key, 'epoch', epoch, 'created', now)
  redis.call('SADD', index_key, qid)
  return epoch
end

-- Lost-tail detection. With appendfsync everysec a machine crash can lose the last
-- second of writes, seq counter included; the relay then records this Redis run in
-- 'rf:boot' ("<run_id>:<start ms>", see relay/storage/boot.py) before any script
-- runs on it. Every enqueue stamps the queue with the run that wrote it ('r'). A
-- queue last written by an earlier run may have lost writes: it gets a new epoch, and
-- its seq counter jumps past anything that could have been handed out and lost, so no
-- seq is ever reused and a stale ack deletes nothing new. Run ids, not clocks: a queue
-- copied in by a migration is re-stamped for this run (lua/import_stamp.lua).
-- Undeclared key: fine on a standalone shard (a Redis Cluster shard needs another way).
local SEQ_JUMP = 1000000
local function boot_run()
  local boot = redis.call('GET', 'rf:boot')
  if not boot then return nil end
  return string.match(boot, '^([^:]+):')
end
-- Returns the run a write must stamp on the queue (nil when the stamp is already there or
-- no boot is recorded), so a writer reads rf:boot and the stamp once.
local function check_boot(meta_key)
  local run = boot_run()
  if not run then return nil end
  local r = redis.call('HGET', meta_key, 'r')
  if r == run then return nil end
  if not r then return run end
  local seq = tonumber(redis.call('HGET', meta_key, 'seq') or '0') + SEQ_JUMP
  local epoch = string.sub(redis.sha1hex(run .. meta_key), 1, 16)
  redis.call('HSET', meta_key, 'epoch', epoch, 'seq', seq, 'r', run)
  return nil
end
