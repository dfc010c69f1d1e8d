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
