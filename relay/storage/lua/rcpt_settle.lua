-- rcpt_settle: read a recipient's record (its home slot, keys.slot_recipients), or replace its
-- held counters with what its channels' queues hold (the reconciliation: acks the relay could
-- not refund, retention trims and dropped queues leave the counters high, which only refuses
-- early; docs/design-decisions.md, "Per-recipient quotas").
-- KEYS[1] slot state (string)   KEYS[2] slot recipient records (hash)
-- ARGV[1] the recipient's field prefix "<b64 recipient>|"   ARGV[2] 'peek' | 'set'
-- 'set': ARGV[3] the admit count 'peek' answered before the queues were read   ARGV[4] now, ms
--        ARGV[5] quiet period, ms: no admit may be this recent (its enqueue may be on its way)
--        ARGV[6] rate window, ms
--        ARGV[7..] per channel read: channel (b64url), messages, payload bytes
-- Returns 'peek': {'ok', channels (space-separated b64url), admits, last admit ms}
--         'set': {'ok'} (applied; channels holding nothing are unregistered) | {'busy'}
--       | fence reply
local state_key, rcpt_key = KEYS[1], KEYS[2]
local r, mode = ARGV[1], ARGV[2]
local f = fence(state_key)
if f then return f end
if mode == 'peek' then
  local h = redis.call('HMGET', rcpt_key, r .. 'c', r .. 'g', r .. 't')
  return {'ok', h[1] or '', tonumber(h[2]) or 0, tonumber(h[3]) or 0}
end
local seen, now, quiet, window = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local h = redis.call('HMGET', rcpt_key, r .. 'g', r .. 't', r .. 'w')
if not h[1] then return {'ok'} end  -- no record (nothing to settle; none is created)
if tonumber(h[1]) ~= seen or now - (tonumber(h[2]) or 0) < quiet then return {'busy'} end
local chans, n, b = {}, 0, 0
for i = 7, #ARGV, 3 do
  local m = tonumber(ARGV[i + 1])
  if m > 0 then
    chans[#chans + 1] = ARGV[i]
    n = n + m
    b = b + tonumber(ARGV[i + 2])
  end
end
if #chans == 0 and ring_count(h[3], now, window) == 0 then
  redis.call('HDEL', rcpt_key, r .. 'c', r .. 'n', r .. 'b', r .. 'g', r .. 't', r .. 'w')
else
  redis.call('HSET', rcpt_key, r .. 'c', table.concat(chans, ' '), r .. 'n', string.format('%d', n),
    r .. 'b', string.format('%d', b))
end
return {'ok'}
