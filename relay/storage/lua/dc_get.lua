-- dc_get: read fields of the slot's DIDComm records.
-- KEYS[1] slot state (string)  KEYS[2] slot DIDComm records (hash)
-- ARGV[1..] fields
-- Returns {'ok', value|false, ...} | fence reply (a moved slot's records are read where they went)
local f = fence(KEYS[1])
if f then return f end
if #ARGV == 0 then return {'ok'} end
local values = redis.call('HMGET', KEYS[2], unpack(ARGV))
local out = {'ok'}
for i = 1, #values do out[i + 1] = values[i] end
return out
