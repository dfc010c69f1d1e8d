-- dc_get: read fields of the slot's DIDComm records.
-- KEYS[1] slot state (string)  KEYS[2] slot DIDComm records (hash)
-- ARGV[1..] fields
-- Returns {'ok', value|false, ...} | fence reply (a moved slot's records are read where they went)
local state_key, records_key = KEYS[1], KEYS[2]
local fields = ARGV
local f = fence(state_key)
if f then return f end
if #fields == 0 then return {'ok'} end
local values = redis.call('HMGET', records_key, unpack(fields))
local out = {'ok'}
for i = 1, #values do out[i + 1] = values[i] end
return out
