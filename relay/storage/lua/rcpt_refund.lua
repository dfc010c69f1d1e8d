-- rcpt_refund: give back to a recipient's record (its home slot, keys.slot_recipients) what its
-- non-default channels no longer hold: an admitted message the channel's shard refused (then
-- its rate-ring entry goes too), or messages acked or drained. Never below 0; no record, no
-- write (a refund creates no state).
-- KEYS[1] slot state (string)   KEYS[2] slot recipient records (hash)
-- ARGV[1] the recipient's field prefix "<b64 recipient>|"
-- ARGV[2] messages   ARGV[3] payload bytes
-- ARGV[4] the admit's time, ms (0 = not an admit: no rate entry to remove)
-- ARGV[5] now, ms   ARGV[6] rate window, ms
-- Returns {'ok'} | fence reply
local state_key, rcpt_key = KEYS[1], KEYS[2]
local r = ARGV[1]
local msgs, size, admitted = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local now, window = tonumber(ARGV[5]), tonumber(ARGV[6])
local f = fence(state_key)
if f then return f end
local h = redis.call('HMGET', rcpt_key, r .. 'n', r .. 'b', r .. 'w')
if not h[1] and not h[2] then return {'ok'} end
redis.call('HSET', rcpt_key, r .. 'n', string.format('%d', math.max(0, (tonumber(h[1]) or 0) - msgs)),
  r .. 'b', string.format('%d', math.max(0, (tonumber(h[2]) or 0) - size)))
if admitted > 0 and h[3] then
  local ring = ring_add(h[3], now, window, admitted, -1)
  if ring then redis.call('HSET', rcpt_key, r .. 'w', ring) else redis.call('HDEL', rcpt_key, r .. 'w') end
end
return {'ok'}
