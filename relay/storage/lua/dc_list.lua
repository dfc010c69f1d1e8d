-- dc_list: add members to / remove members from a space-separated set field ('r:<conn>').
-- KEYS[1] slot state (string)  KEYS[2] slot DIDComm records (hash)  KEYS[3] their idle
-- expiry (zset; not read here: a keylist expires with its connection, dc_set/dc_sweep)
-- ARGV[1] field  ARGV[2] 'add' | 'remove'  ARGV[3] most members the field may hold
-- ARGV[4..] members (no spaces)
-- Returns {'ok', members now held} | {'full', members now held} (nothing added) | fence reply
local state_key, records_key = KEYS[1], KEYS[2]
local field, action, cap = ARGV[1], ARGV[2], tonumber(ARGV[3])
local first_member = 4  -- ARGV[4..] members
local f = fence(state_key)
if f then return f end
local cur = redis.call('HGET', records_key, field) or ''
local held, order = {}, {}
for m in string.gmatch(cur, '%S+') do
  if not held[m] then held[m] = true; order[#order + 1] = m end
end
local before = #order
local count = before
for i = first_member, #ARGV do
  local m = ARGV[i]
  if action == 'add' and not held[m] then
    held[m] = true; order[#order + 1] = m; count = count + 1
  elseif action == 'remove' and held[m] then
    held[m] = false; count = count - 1
  end
end
if action == 'add' and count > cap then return {'full', before} end
local keep = {}
for _, m in ipairs(order) do
  if held[m] then keep[#keep + 1] = m end
end
if #keep == 0 then
  redis.call('HDEL', records_key, field)
else
  redis.call('HSET', records_key, field, table.concat(keep, ' '))
end
return {'ok', #keep}
