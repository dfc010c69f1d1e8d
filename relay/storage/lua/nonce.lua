-- nonce: accept an auth nonce once within its lifetime.
-- KEYS[1] slot state (string)  KEYS[2] slot nonces (zset: member -> expiry ms)
-- ARGV[1] member ('<key>.<nonce>')  ARGV[2] now ms  ARGV[3] lifetime ms
-- Returns {'ok', 1} when the nonce was unused (and is now recorded), {'ok', 0}
-- when it was seen before, or the fence reply: a nonce recorded on a fenced
-- slot would be left behind by the migration and could be replayed.
local state_key, nonces_key = KEYS[1], KEYS[2]
local member, now, lifetime = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local f = fence(state_key)
if f then return f end
redis.call('ZREMRANGEBYSCORE', nonces_key, '-inf', now)
if redis.call('ZSCORE', nonces_key, member) then return {'ok', 0} end
redis.call('ZADD', nonces_key, now + lifetime, member)
return {'ok', 1}
