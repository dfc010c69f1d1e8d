-- nonce: accept an auth nonce once within its lifetime.
-- KEYS[1] slot state (string)  KEYS[2] slot nonces (zset: member -> expiry ms)
-- ARGV[1] member ('<key>.<nonce>')  ARGV[2] now ms  ARGV[3] lifetime ms
-- Returns {'ok', 1} when the nonce was unused (and is now recorded), {'ok', 0}
-- when it was seen before, or the fence reply: a nonce recorded on a fenced
-- slot would be left behind by the migration and could be replayed.
local f = fence(KEYS[1])
if f then return f end
local now = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then return {'ok', 0} end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
return {'ok', 1}
