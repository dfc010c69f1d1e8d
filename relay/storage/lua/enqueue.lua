-- enqueue: store one message, atomically: fence, idempotency, rate limit, caps,
-- XADD, counters, slot index and statistics, wakeup PUBLISH.
-- KEYS[1] slot state (string)        KEYS[2] queue meta (hash)
-- KEYS[3] queue messages (stream)    KEYS[4] idempotency keys (hash)
-- KEYS[5] idempotency expiry (zset)  KEYS[6] rate-limit window (zset)
-- KEYS[7] slot queue index (set)     KEYS[8] slot statistics (hash)
-- ARGV[1] payload                    ARGV[2] now, ms since epoch
-- ARGV[3] idempotency key ('' = none)
-- ARGV[4] payload digest ('*' = a repeated key is a duplicate whatever the payload)
-- ARGV[5] messageId stored with the message ('' = none)
-- ARGV[6] rate limit: messages per window   ARGV[7] rate window, ms
-- ARGV[8] queue cap: messages        ARGV[9] queue cap: bytes
-- ARGV[10] idempotency retention, ms ARGV[11] queue id (slot index member)
-- ARGV[12] wakeup channel
-- ARGV[13] attempt token: unique per enqueue (kept across its resends); also the epoch
--          of a queue whose meta was lost while its index entry stayed
-- ARGV[14] '1' when this resends an attempt whose reply never came (its outcome is
--          unknown): if that attempt stored the message, answer its seq instead
-- Returns {'ok', seq, subscribers} | {'dup', seq} | {'conflict', seq}
--       | {'rate', retry_after_ms} | {'full', reason} | fence reply
local f = fence(KEYS[1])
if f then return f end
local now = tonumber(ARGV[2])
if ARGV[14] == '1' then
  -- the lost attempt ran with the same `now`: its rate-window entry "<seq>:<token>" is
  -- scored `now` and stays for the rate window, within which the relay resends
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[6], now, now)) do
    local sep = string.find(member, ':', 1, true)
    if sep and string.sub(member, sep + 1) == ARGV[13] then
      return {'ok', tonumber(string.sub(member, 1, sep - 1)), 0}
    end
  end
end
-- The first write must be one Redis refuses at maxmemory (HSETNX is): Redis only
-- checks OOM before a script's first write, and a refused enqueue changes nothing.
if redis.call('HSETNX', KEYS[2], 'epoch', ARGV[13]) == 1 then
  -- a new queue keeps the epoch reads already answered for it; one still in the index
  -- lost its meta (its history), so it keeps the fresh token instead
  if redis.call('SISMEMBER', KEYS[7], ARGV[11]) == 0 then
    redis.call('HSET', KEYS[2], 'epoch', pending_epoch(KEYS[8], ARGV[11]), 'created', now)
  else
    redis.call('HSET', KEYS[2], 'created', now)
  end
  redis.call('SADD', KEYS[7], ARGV[11])
end
local stamp = check_boot(KEYS[2])
local ikey = ARGV[3]
if ikey ~= '' then
  local prev = redis.call('HGET', KEYS[4], ikey)
  if prev then
    local sep = string.find(prev, ':', 1, true)
    local pseq = tonumber(string.sub(prev, 1, sep - 1))
    if ARGV[4] == '*' or string.sub(prev, sep + 1) == ARGV[4] then return {'dup', pseq} end
    return {'conflict', pseq}
  end
end
local window = tonumber(ARGV[7])
redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now - window)
if redis.call('ZCARD', KEYS[6]) >= tonumber(ARGV[6]) then
  local oldest = redis.call('ZRANGE', KEYS[6], 0, 0, 'WITHSCORES')
  return {'rate', math.max(1, tonumber(oldest[2]) + window - now)}
end
local size = string.len(ARGV[1])
local meta = redis.call('HMGET', KEYS[2], 'seq', 'bytes')
local held = tonumber(meta[2]) or 0
if redis.call('XLEN', KEYS[3]) + 1 > tonumber(ARGV[8]) then return {'full', 'messages'} end
if held + size > tonumber(ARGV[9]) then return {'full', 'bytes'} end
local seq = (tonumber(meta[1]) or seq_floor()) + 1
redis.call('XADD', KEYS[3], seq .. '-0', 'p', ARGV[1], 't', now, 'm', ARGV[5], 'n', size)
redis.call('HSET', KEYS[2], 'seq', seq, 'bytes', held + size)
if stamp then redis.call('HSET', KEYS[2], 'r', stamp) end
redis.call('ZADD', KEYS[6], now, seq .. ':' .. ARGV[13])
redis.call('PEXPIRE', KEYS[6], window)
if ikey ~= '' then
  redis.call('HSET', KEYS[4], ikey, seq .. ':' .. ARGV[4])
  redis.call('ZADD', KEYS[5], now + tonumber(ARGV[10]), ikey)
  -- expire a few old idempotency keys per write: bounded work, no background job
  local old = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now, 'LIMIT', 0, 8)
  if #old > 0 then
    redis.call('HDEL', KEYS[4], unpack(old))
    redis.call('ZREM', KEYS[5], unpack(old))
  end
end
redis.call('SADD', KEYS[7], ARGV[11])
slot_stats(KEYS[8], 1, size)
-- enqueues per minute, two windows, for the rebalance planner
local wstart = tonumber(redis.call('HGET', KEYS[8], 'wstart') or '0')
local minute = now - (now % 60000)
if minute ~= wstart then
  local cur = redis.call('HGET', KEYS[8], 'wcur') or '0'
  if minute - wstart ~= 60000 then cur = '0' end
  redis.call('HSET', KEYS[8], 'wstart', minute, 'wprev', cur, 'wcur', 0)
end
redis.call('HINCRBY', KEYS[8], 'wcur', 1)
redis.call('HINCRBY', KEYS[8], 'enq', 1)
local subs = redis.call('PUBLISH', ARGV[12], seq .. ':' .. now)
return {'ok', seq, subs}
