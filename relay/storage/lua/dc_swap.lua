-- dc_swap: compare-and-set one field of the slot's DIDComm records: write `new` only when the
-- field still holds `expected` ('' = absent, or its governing record expired: dc_governor,
-- dc_alive). Two relays taking the same Pickup delivery lease ('d:<key>') at once: one wins,
-- the other reads the winner's lease and starts after it (relay/didcomm/mediator_pickup.py).
-- KEYS[1] slot state (string)  KEYS[2] slot DIDComm records (hash)  KEYS[3] their idle expiry (zset)
-- ARGV[1] now, ms  ARGV[2] idle expiry, ms  ARGV[3] field  ARGV[4] expected  ARGV[5] new
-- Returns {'ok', 1 written | 0 the field holds something else} | fence reply
local state_key, records_key, idle_key = KEYS[1], KEYS[2], KEYS[3]
local now, idle, field, expected, new = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local f = fence(state_key)
if f then return f end
local current = redis.call('HGET', records_key, field)
if current and not dc_alive(records_key, idle_key, dc_governor(field), now, idle) then current = false end
if (current or '') ~= expected then return {'ok', 0} end
redis.call('HSET', records_key, field, new)
return {'ok', 1}
