-- slot_drop: delete some of a slot's keys, only while the slot's state allows it (a
-- source after its flip, a target before its copy), so a late or confused migrator can
-- never delete data that the shard is serving. The state key itself is never deleted.
-- KEYS[1] slot state (string)   KEYS[2..] keys of the same slot to delete
-- ARGV[1..] states that allow the delete: an exact value, '' for absent, or a prefix
--           ending in '*' (e.g. 'moved b *')
-- Returns {1, keys deleted} | {0, prior state ('' = absent)} when refused
local state_key = KEYS[1]
local first_drop = 2  -- KEYS[2..]; ARGV[1..] the allowed states
local cur = redis.call('GET', state_key) or ''
local ok = state_allowed(cur, ARGV, 1)
if not ok then return {0, cur} end
local n = 0
for i = first_drop, #KEYS do
  n = n + redis.call('UNLINK', KEYS[i])
end
return {1, n}
