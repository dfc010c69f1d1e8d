-- dc_claim: take or give back one registered key for a connection ('k:<key>' -> owner).
-- KEYS[1] slot state (string)  KEYS[2] slot DIDComm records (hash)
-- ARGV[1] field  ARGV[2] owner (the connection)  ARGV[3] 'add' | 'remove'
-- Returns {'ok', 1} done (or already so), {'ok', 0} owned by another connection (add) or
-- not ours (remove), | fence reply
local state_key, records_key = KEYS[1], KEYS[2]
local field, owner, action = ARGV[1], ARGV[2], ARGV[3]
local f = fence(state_key)
if f then return f end
local cur = redis.call('HGET', records_key, field)
if action == 'add' then
  if cur and cur ~= owner then return {'ok', 0} end
  if not cur then redis.call('HSET', records_key, field, owner) end
  return {'ok', 1}
end
if cur == owner then
  redis.call('HDEL', records_key, field)
  return {'ok', 1}
end
if not cur then return {'ok', 1} end
return {'ok', 0}
