-- presence: the fleet-wide presence leases of one slot's queues (keys.slot_presence,
-- relay/presence.py). Fields: 'l|<qid>' a live socket's lease "<expiry ms> <token>", 'p|<qid>'
-- a waiting long-poll's "<expiry ms>". Every write sets the key's own expiry to at least its
-- newest lease's, so the key leaves Redis by itself once nobody refreshes a lease in it.
-- KEYS[1] slot state (string)  KEYS[2] the slot's presence hash; for 'renew', a pair per slot
-- ARGV[1] op, ARGV[2] now ms, then per op:
--  'take'  ttl ms, qid, token, wake channel: the queue's live lease becomes `token`'s, and
--          the notice 'n:t<token>' goes out on the channel (in Redis's order with the write)
--          -> {'ok', ms the previous holder's lease had left (0: none), its token | ''}
--  'drop'  qid, token, wake channel: the live lease is deleted if it is still `token`'s;
--          'n:r<token>' goes out (its holder stopped writing to its socket) -> {'ok', 1|0}
--  'renew' ttl ms, sweep (1: drop expired fields), then per slot (KEYS in pairs, in order): n,
--          m, n x (qid, token) live leases, m qids of waiting polls. A live lease another token
--          holds is left alone. Every slot of the relay's on this shard in one call (a call per
--          slot cost Redis and the relay a script call per waiter: relay/presence.py)
--          -> per slot {'ok', qid, ...} those lost, or its fence reply (nothing written there)
--  'get'   qid -> {'ok', live 1|0, online 1|0}
-- Returns the fence reply when this shard does not own the slot (nothing written).
local op, now = ARGV[1], tonumber(ARGV[2])

local function lease(value)
  if not value then return 0, '' end
  local exp, token = string.match(value, '^(%d+) ?(.*)$')
  return tonumber(exp or '0'), token or ''
end

local function keep(key, ttl)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
end

if op == 'renew' then
  local ttl, sweep = tonumber(ARGV[3]), ARGV[4]
  local until_ms = now + ttl
  local replies = {}
  local i = 5
  for s = 1, #KEYS, 2 do
    local key = KEYS[s + 1]
    local n, m = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
    i = i + 2
    local f = fence(KEYS[s])
    if f then
      replies[#replies + 1] = f
    else
      local lost = {'ok'}
      for j = i, i + 2 * n - 1, 2 do
        local field, token = 'l|' .. ARGV[j], ARGV[j + 1]
        local exp, held = lease(redis.call('HGET', key, field))
        if held == token or held == '' or exp <= now then
          redis.call('HSET', key, field, until_ms .. ' ' .. token)
        else
          lost[#lost + 1] = ARGV[j]
        end
      end
      for j = i + 2 * n, i + 2 * n + m - 1 do
        local field = 'p|' .. ARGV[j]
        if lease(redis.call('HGET', key, field)) < until_ms then redis.call('HSET', key, field, until_ms) end
      end
      if sweep == '1' then
        local all = redis.call('HGETALL', key)
        for j = 1, #all, 2 do
          if lease(all[j + 1]) <= now then redis.call('HDEL', key, all[j]) end
        end
      end
      if redis.call('EXISTS', key) == 1 then keep(key, ttl) end
      replies[#replies + 1] = lost
    end
    i = i + 2 * n + m
  end
  return replies
end

local state_key, key = KEYS[1], KEYS[2]
local f = fence(state_key)
if f then return f end

if op == 'get' then
  local v = redis.call('HMGET', key, 'l|' .. ARGV[3], 'p|' .. ARGV[3])
  local live = lease(v[1]) > now and 1 or 0
  local online = (live == 1 or lease(v[2]) > now) and 1 or 0
  return {'ok', live, online}
end

if op == 'take' then
  local ttl, field, token = tonumber(ARGV[3]), 'l|' .. ARGV[4], ARGV[5]
  local exp, held = lease(redis.call('HGET', key, field))
  local left, prev = 0, ''
  if held ~= token and exp > now then left, prev = exp - now, held end
  redis.call('HSET', key, field, (now + ttl) .. ' ' .. token)
  keep(key, ttl)
  redis.call('PUBLISH', ARGV[6], 'n:t' .. token)
  return {'ok', left, prev}
end

if op == 'drop' then
  local field, token = 'l|' .. ARGV[3], ARGV[4]
  local _, held = lease(redis.call('HGET', key, field))
  local gone = 0
  if held == token then gone = redis.call('HDEL', key, field) end
  redis.call('PUBLISH', ARGV[5], 'n:r' .. token)
  return {'ok', gone}
end

return redis.error_reply('presence: unknown op')
