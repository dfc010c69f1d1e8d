-- nonce: accept an auth nonce once within its lifetime.
-- KEYS[1] slot nonces (zset: member -> expiry ms)
-- ARGV[1] member ('<key>.<nonce>')  ARGV[2] now ms  ARGV[3] lifetime ms
-- Returns 1 when the nonce is fresh (and records it), 0 when it was seen before.
local now = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
return 1
