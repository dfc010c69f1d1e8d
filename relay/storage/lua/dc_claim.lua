-- dc_claim: take, refresh or give back one registered key for a connection ('k:<key>' -> owner).
-- A take (or a refresh by its owner) starts the registration's idle expiry afresh; a key
-- another connection holds is taken only once that registration expired, or when `proven`
-- (the key is the taker's own authcrypt key). Then sweeps up to 16 expired records (dc_sweep).
-- KEYS[1] slot state (string)  KEYS[2] slot DIDComm records (hash)  KEYS[3] their idle expiry (zset)
-- ARGV[1] field  ARGV[2] owner (the connection)  ARGV[3] 'add' | 'remove'  ARGV[4] now, ms
-- ARGV[5] idle expiry, ms  ARGV[6] '1' proven, else '0'
-- Returns {'ok', 1, previous owner or ''} done (or already so), {'ok', 0, ''} held by another
-- connection (add) or not ours (remove) | fence reply
local state_key, records_key, idle_key = KEYS[1], KEYS[2], KEYS[3]
local field, owner, action = ARGV[1], ARGV[2], ARGV[3]
local now, idle, proven = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6] == '1'
local f = fence(state_key)
if f then return f end
local lease = 'd:' .. string.sub(field, 3)
local cur = redis.call('HGET', records_key, field)
if action == 'add' then
  local previous = ''
  if cur and cur ~= owner then
    if dc_alive(records_key, idle_key, field, now, idle) and not proven then return {'ok', 0, ''} end
    previous = cur
    redis.call('HDEL', records_key, lease)  -- a new holder starts without the old one's lease
  end
  redis.call('HSET', records_key, field, owner)
  redis.call('ZADD', idle_key, now + idle, field)
  dc_sweep(records_key, idle_key, now, 16)
  return {'ok', 1, previous}
end
if cur == owner then
  redis.call('HDEL', records_key, field, lease)
  redis.call('ZREM', idle_key, field)
  return {'ok', 1, ''}
end
if not cur then return {'ok', 1, ''} end
return {'ok', 0, ''}
