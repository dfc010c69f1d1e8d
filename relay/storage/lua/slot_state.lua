-- slot_state: compare-and-set one slot's state, the step of the migration protocol
-- that fences, flips or rolls back a slot. Refusing an unexpected prior state makes
-- every step safe to repeat after a crash and keeps a confused caller from undoing
-- someone else's step.
-- KEYS[1] slot state (string: absent = owned; 'migrating', 'importing', 'moved <shard> <epoch>')
-- ARGV[1] new state ('' = delete the key: owned)
-- ARGV[2..] states allowed before the change: an exact value, '' for absent, or a
--           prefix ending in '*' (e.g. 'moved b *')
-- Returns {1, prior} when the state is now ARGV[1]; {0, prior} when the prior state was
-- not allowed and nothing changed. prior is '' when the key was absent.
local state_key = KEYS[1]
local new = ARGV[1]  -- ARGV[2..] the allowed prior states
local cur = redis.call('GET', state_key) or ''
local ok = state_allowed(cur, ARGV, 2)
if not ok then return {0, cur} end
if new == '' then
  redis.call('DEL', state_key)
else
  redis.call('SET', state_key, new)
end
return {1, cur}
