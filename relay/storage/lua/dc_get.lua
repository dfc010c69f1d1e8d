-- dc_get: read fields of the slot's DIDComm records; a field whose record's idle expiry
-- passed reads as absent (dc_governor, dc_alive in the prelude).
-- KEYS[1] slot state (string)  KEYS[2] slot DIDComm records (hash)  KEYS[3] their idle expiry (zset)
-- ARGV[1] now, ms  ARGV[2] idle expiry, ms (scores a record written before expiry existed)
-- ARGV[3..] fields
-- Returns {'ok', value|false, ...} | fence reply (a moved slot's records are read where they went)
local state_key, records_key, idle_key = KEYS[1], KEYS[2], KEYS[3]
local now, idle = tonumber(ARGV[1]), tonumber(ARGV[2])
local first_field = 3  -- ARGV[3..] fields
local f = fence(state_key)
if f then return f end
local out = {'ok'}
for i = first_field, #ARGV do
  local field = ARGV[i]
  local value = redis.call('HGET', records_key, field)
  if value and not dc_alive(records_key, idle_key, dc_governor(field), now, idle) then value = false end
  out[#out + 1] = value
end
return out
