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
local state_key, meta_key, msgs_key, idem_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local idemx_key, rate_key, index_key, stats_key = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local payload, now, ikey, digest, message_id = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local rate_limit, window = tonumber(ARGV[6]), tonumber(ARGV[7])
local cap_msgs, cap_bytes, idem_ms = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local qid, channel, token, resend = ARGV[11], ARGV[12], ARGV[13], ARGV[14]
local f = fence(state_key)
if f then return f end
if resend == '1' then
  -- the lost attempt ran with the same `now`: its rate-window entry "<seq>:<token>" is
  -- scored `now` and stays for the rate window, within which the relay resends
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', rate_key, now, now)) do
    local sep = string.find(member, ':', 1, true)
    if sep and string.sub(member, sep + 1) == token then
      return {'ok', tonumber(string.sub(member, 1, sep - 1)), 0}
    end
  end
end
-- The first write must be one Redis refuses at maxmemory (HSETNX is): Redis only
-- checks OOM before a script's first write, and a refused enqueue changes nothing.
if redis.call('HSETNX', meta_key, 'epoch', token) == 1 then
  -- a new queue keeps the epoch reads already answered for it; one still in the index
  -- lost its meta (its history), so it keeps the fresh token instead
  if redis.call('SISMEMBER', index_key, qid) == 0 then
    redis.call('HSET', meta_key, 'epoch', pending_epoch(stats_key, qid), 'created', now)
  else
    redis.call('HSET', meta_key, 'created', now)
  end
  redis.call('SADD', index_key, qid)
end
local stamp = check_boot(meta_key)
if ikey ~= '' then
  local prev = redis.call('HGET', idem_key, ikey)
  if prev then
    local sep = string.find(prev, ':', 1, true)
    local pseq = tonumber(string.sub(prev, 1, sep - 1))
    if digest == '*' or string.sub(prev, sep + 1) == digest then return {'dup', pseq} end
    return {'conflict', pseq}
  end
end
redis.call('ZREMRANGEBYSCORE', rate_key, '-inf', now - window)
if redis.call('ZCARD', rate_key) >= rate_limit then
  local oldest = redis.call('ZRANGE', rate_key, 0, 0, 'WITHSCORES')
  return {'rate', math.max(1, tonumber(oldest[2]) + window - now)}
end
local size = string.len(payload)
local meta = redis.call('HMGET', meta_key, 'seq', 'bytes')
local held = tonumber(meta[2]) or 0
if redis.call('XLEN', msgs_key) + 1 > cap_msgs then return {'full', 'messages'} end
if held + size > cap_bytes then return {'full', 'bytes'} end
local seq = (tonumber(meta[1]) or seq_floor()) + 1
redis.call('XADD', msgs_key, seq .. '-0', 'p', payload, 't', now, 'm', message_id, 'n', size)
redis.call('HSET', meta_key, 'seq', seq, 'bytes', held + size)
if stamp then redis.call('HSET', meta_key, 'r', stamp) end
redis.call('ZADD', rate_key, now, seq .. ':' .. token)
redis.call('PEXPIRE', rate_key, window)
if ikey ~= '' then
  redis.call('HSET', idem_key, ikey, seq .. ':' .. digest)
  redis.call('ZADD', idemx_key, now + idem_ms, ikey)
  -- expire a few old idempotency keys per write: bounded work, no background job
  local old = redis.call('ZRANGEBYSCORE', idemx_key, '-inf', now, 'LIMIT', 0, 8)
  if #old > 0 then
    redis.call('HDEL', idem_key, unpack(old))
    redis.call('ZREM', idemx_key, unpack(old))
  end
end
redis.call('SADD', index_key, qid)
slot_stats(stats_key, 1, size)
-- enqueues per minute, two windows, for the rebalance planner
local wstart = tonumber(redis.call('HGET', stats_key, 'wstart') or '0')
local minute = now - (now % 60000)
if minute ~= wstart then
  local cur = redis.call('HGET', stats_key, 'wcur') or '0'
  if minute - wstart ~= 60000 then cur = '0' end
  redis.call('HSET', stats_key, 'wstart', minute, 'wprev', cur, 'wcur', 0)
end
redis.call('HINCRBY', stats_key, 'wcur', 1)
redis.call('HINCRBY', stats_key, 'enq', 1)
local subs = redis.call('PUBLISH', channel, seq .. ':' .. now)
return {'ok', seq, subs}
