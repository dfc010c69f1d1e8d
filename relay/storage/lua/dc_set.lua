-- dc_set: write and delete fields of the slot's DIDComm records in one step.
-- KEYS[1] slot state (string)  KEYS[2] slot DIDComm records (hash)
-- ARGV[1] n, the number of field/value pairs to set  ARGV[2 .. 2n+1] the pairs
-- ARGV[2n+2 ..] fields to delete
-- Returns {'ok'} | fence reply (a write on a fenced slot would be left behind by the copy)
local state_key, records_key = KEYS[1], KEYS[2]
local n = tonumber(ARGV[1])
local f = fence(state_key)
if f then return f end
if n > 0 then redis.call('HSET', records_key, unpack(ARGV, 2, 2 * n + 1)) end
if #ARGV > 2 * n + 1 then redis.call('HDEL', records_key, unpack(ARGV, 2 * n + 2)) end
return {'ok'}
