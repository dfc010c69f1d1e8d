-- dc_set: write and delete fields of the slot's DIDComm records in one step. Writing a
-- connection ('c:') starts its idle expiry afresh; deleting one ends it. Then sweeps up to
-- 16 expired records of the slot (dc_sweep).
-- KEYS[1] slot state (string)  KEYS[2] slot DIDComm records (hash)  KEYS[3] their idle expiry (zset)
-- ARGV[1] now, ms  ARGV[2] idle expiry, ms  ARGV[3] n, the number of field/value pairs to set
-- ARGV[4 .. 2n+3] the pairs  ARGV[2n+4 ..] fields to delete
-- Returns {'ok', records swept} | fence reply (a write on a fenced slot would be left behind by the copy)
local state_key, records_key, idle_key = KEYS[1], KEYS[2], KEYS[3]
local now, idle, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local first_pair = 4  -- ARGV[4 ..] pairs, then deletes
local f = fence(state_key)
if f then return f end
for i = first_pair, first_pair + 2 * n - 1, 2 do
  redis.call('HSET', records_key, ARGV[i], ARGV[i + 1])
  if string.sub(ARGV[i], 1, 2) == 'c:' then redis.call('ZADD', idle_key, now + idle, ARGV[i]) end
end
for i = first_pair + 2 * n, #ARGV do
  redis.call('HDEL', records_key, ARGV[i])
  redis.call('ZREM', idle_key, ARGV[i])
end
return {'ok', dc_sweep(records_key, idle_key, now, 16)}
