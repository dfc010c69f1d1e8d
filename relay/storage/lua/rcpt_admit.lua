-- rcpt_admit: admit one message to a recipient's non-default channel, run in the recipient's
-- home slot (the slot of its default channel; docs/design-decisions.md, "Per-recipient
-- quotas"): register the channel under the cap, check the held caps (its default queue plus
-- what its other channels were admitted and not refunded) and the rate across its channels,
-- then count the message as held and in the rate ring. The relay enqueues it on the channel's
-- shard next, and refunds (rcpt_refund.lua) when that refuses it.
-- KEYS[1] slot state (string)             KEYS[2] slot recipient records (hash)
-- KEYS[3] default queue meta (hash)       KEYS[4] default queue messages (stream)
-- KEYS[5] default queue rate window (zset; with the meta's 'w': lua/_prelude.lua inline_rate)
-- ARGV[1] the recipient's field prefix "<b64 recipient>|"   ARGV[2] channel (b64url)
-- ARGV[3] payload bytes   ARGV[4] now, ms
-- ARGV[5] channel cap   ARGV[6] messages cap   ARGV[7] bytes cap   ARGV[8] rate, per window
--         (0 = none, each)
-- ARGV[9] rate window, ms
-- Returns {'ok', admits so far} | {'rrate', retry_after_ms}
--       | {'full', 'channels' | 'recipient messages' | 'recipient bytes'} | fence reply
local state_key, rcpt_key, meta_key, msgs_key, rate_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local r, channel, now_s = ARGV[1], ARGV[2], ARGV[4]
local size, now = tonumber(ARGV[3]), tonumber(now_s)
local max_channels, max_msgs, max_bytes = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local rate, window = tonumber(ARGV[8]), tonumber(ARGV[9])
local f = fence(state_key)
if f then return f end
local h = redis.call('HMGET', rcpt_key, r .. 'c', r .. 'n', r .. 'b', r .. 'w')
local chans = h[1] or ''
local listed = string.find(' ' .. chans .. ' ', ' ' .. channel .. ' ', 1, true)
if not listed and max_channels > 0 then
  local count = 0
  for _ in string.gmatch(chans, '%S+') do count = count + 1 end
  if count >= max_channels then return {'full', 'channels'} end
end
local n, b = tonumber(h[2]) or 0, tonumber(h[3]) or 0
if max_msgs > 0 and redis.call('XLEN', msgs_key) + n + 1 > max_msgs then
  return {'full', 'recipient messages'}
end
if max_bytes > 0 and tonumber(redis.call('HGET', meta_key, 'bytes') or '0') + b + size > max_bytes then
  return {'full', 'recipient bytes'}
end
local ring = h[4]
if rate > 0 then
  -- the default queue's window plus the ring of the other channels (as enqueue.lua counts)
  local others, leaves = ring_count(ring, now, window)
  -- (its window: the sorted set, and the meta's field 'w' while it holds one enqueue)
  local _, _, wt = inline_rate(redis.call('HGET', meta_key, 'w'), now, window)
  local from = '(' .. string.format('%d', now - window)
  if others + redis.call('ZCOUNT', rate_key, from, '+inf') + (wt and 1 or 0) >= rate then
    local first = redis.call('ZRANGEBYSCORE', rate_key, from, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    local oldest = first[2] and tonumber(first[2])
    if wt and (not oldest or wt < oldest) then oldest = wt end
    if oldest then
      local mine = oldest + window - now
      if leaves == 0 or mine < leaves then leaves = mine end
    end
    return {'rrate', math.max(1, leaves)}
  end
  ring = ring_add(ring, now, window, now, 1)
end
if not listed then
  if chans == '' then chans = channel else chans = chans .. ' ' .. channel end
end
local admits = redis.call('HINCRBY', rcpt_key, r .. 'g', 1)
redis.call('HSET', rcpt_key, r .. 'c', chans, r .. 'n', string.format('%d', n + 1),
  r .. 'b', string.format('%d', b + size), r .. 't', now_s)
if ring then redis.call('HSET', rcpt_key, r .. 'w', ring) end
return {'ok', admits}
