-- trim: retention for one queue, atomically: fence, drop the oldest messages that are
-- older than the cutoff or beyond the message cap, expire idempotency keys, fix the
-- queue's byte counter and the slot statistics, and delete the queue when it is empty
-- and idle. Idempotent: a second call with the same arguments changes nothing.
-- KEYS[1] slot state (string)        KEYS[2] queue meta (hash)
-- KEYS[3] queue messages (stream)    KEYS[4] idempotency keys (hash)
-- KEYS[5] idempotency expiry (zset)  KEYS[6] rate-limit window (zset)
-- KEYS[7] slot queue index (set)     KEYS[8] slot statistics (hash)
-- ARGV[1] now, ms since epoch
-- ARGV[2] age cutoff, ms: messages received before it are removed (0 = no age limit)
-- ARGV[3] max messages kept (-1 = no cap)
-- ARGV[4] idle period, ms: an empty queue with no enqueue for this long is deleted (-1 = never)
-- ARGV[5] queue id (slot index member)
-- ARGV[6] budget: at most this many messages / idempotency keys removed per call
-- Returns {'ok', removed, removed_bytes, deleted (0|1), more (0|1)} | fence reply
local state_key, meta_key, msgs_key, idem_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local idemx_key, rate_key, index_key, stats_key = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local now, cutoff, cap, idle = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local qid, budget = ARGV[5], tonumber(ARGV[6])
local f = fence(state_key)
if f then return f end

-- An index entry whose queue has no keys left is stale: drop it.
if redis.call('EXISTS', meta_key, msgs_key, idem_key, idemx_key) == 0 then
  redis.call('SREM', index_key, qid)
  redis.call('HINCRBY', stats_key, 'qgen', 1)  -- its history is gone: never reuse its epoch
  return {'ok', 0, 0, 1, 0}
end

local meta = redis.call('HMGET', meta_key, 'seq', 'bytes', 'created', 'tseen')
local seq = tonumber(meta[1]) or 0
local held = tonumber(meta[2]) or 0
local len = redis.call('XLEN', msgs_key)

-- Messages leave oldest first, so the stream stays a contiguous run of seqs. Most
-- queues have nothing due: read one entry first, then growing chunks.
local over = 0
if cap >= 0 and len > cap then over = len - cap end
local removed, bytes, more = 0, 0, 0
local last_id, last_t = nil, nil
local from, want = '-', math.max(1, math.min(over, 64))
while removed < budget do
  local chunk = redis.call('XRANGE', msgs_key, from, '+', 'COUNT', math.min(want, budget - removed))
  if #chunk == 0 then break end
  local stop = false
  for _, e in ipairs(chunk) do
    local t, n = tonumber(entry_field(e, 't') or '0'), entry_size(e)
    if removed < over or t < cutoff then
      removed = removed + 1
      bytes = bytes + n
      last_id, last_t = e[1], t
      if removed >= budget then break end
    else
      stop = true
      break
    end
  end
  if stop then break end
  from = '(' .. chunk[#chunk][1]
  want = math.min(64, want * 4)
end
-- When every message went and the newest was the last one enqueued, its time is
-- the queue's last enqueue (used by the idle check below).
local last_enq = nil
if last_id then
  local lseq = id_seq(last_id)
  redis.call('XTRIM', msgs_key, 'MINID', (lseq + 1) .. '-0')
  len = len - removed
  if len == 0 and lseq == seq then last_enq = last_t end
  -- budget spent: the next entry may be due too; the caller calls again
  if removed >= budget and len > 0 then more = 1 end
end

-- Expired idempotency keys (enqueue only expires a few per write).
local left = budget - removed
if left > 0 then
  local old = redis.call('ZRANGEBYSCORE', idemx_key, '-inf', now, 'LIMIT', 0, left)
  if #old > 0 then
    redis.call('HDEL', idem_key, unpack(old))
    redis.call('ZREM', idemx_key, unpack(old))
    if #old == left then more = 1 end
  end
else
  more = 1
end

-- An empty stream holds no bytes: repair any drift in the counters here.
local fixed = held - bytes
if len == 0 and fixed ~= 0 then bytes = held; fixed = 0 end
if bytes ~= 0 or removed > 0 then
  redis.call('HSET', meta_key, 'bytes', math.max(0, fixed))
  slot_stats(stats_key, -removed, -bytes)
end

-- Idle check. The last enqueue time is known exactly when the newest message is
-- still held; otherwise meta 'tseen' = "<seq>:<ms>" says the enqueue of <seq> was at
-- or before <ms> (written when a trim empties the queue, or, if an ack emptied it,
-- the first time a trim sees it empty), so a queue is deleted only when provably
-- idle. A queue that never held a message counts from its creation.
local deleted = 0
if len == 0 and idle >= 0 then
  local since = last_enq
  if not since and seq == 0 then since = tonumber(meta[3]) or 0 end
  if not since and meta[4] then
    local sep = string.find(meta[4], ':', 1, true)
    if sep and tonumber(string.sub(meta[4], 1, sep - 1)) == seq then
      since = tonumber(string.sub(meta[4], sep + 1))
    end
  end
  local mark = nil
  if not since then
    since = now
    mark = seq .. ':' .. now
  elseif last_enq and meta[4] ~= seq .. ':' .. last_enq then
    mark = seq .. ':' .. last_enq  -- emptied here: later sweeps cannot see that time
  end
  if now - since >= idle and more == 0 and redis.call('ZCARD', idemx_key) == 0 then
    redis.call('DEL', meta_key, msgs_key, idem_key, idemx_key, rate_key)
    redis.call('SREM', index_key, qid)
    -- a queue created again under this name must not get the epoch it had (prelude pending_epoch)
    redis.call('HINCRBY', stats_key, 'qgen', 1)
    deleted = 1
  elseif mark then
    redis.call('HSET', meta_key, 'tseen', mark)
  end
end
return {'ok', removed, bytes, deleted, more}
