-- dc_stamp: a connection's push window ('w:<conn>', the ms its last notification went out):
-- taken, and stamped `now`, only when that is at least `interval` ms ago, so a fleet sends a
-- connection's devices at most one notification per interval whichever relay saw the burst.
-- The field lives and expires with its connection ('c:', dc_governor / dc_sweep).
-- KEYS[1] slot state (string)  KEYS[2] slot DIDComm records (hash)  KEYS[3] their idle expiry (zset)
-- ARGV[1] now, ms  ARGV[2] interval, ms  ARGV[3] field
-- Returns {'ok', 1 taken | 0 within the interval} | fence reply
local state_key, records_key = KEYS[1], KEYS[2]
local now, interval, field = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local f = fence(state_key)
if f then return f end
local last = tonumber(redis.call('HGET', records_key, field) or '') or 0
if last <= now and now - last < interval then return {'ok', 0} end
redis.call('HSET', records_key, field, now)
return {'ok', 1}
