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
local cur = redis.call('GET', KEYS[1]) or ''
local ok = false
for i = 2, #ARGV do
  local a = ARGV[i]
  if string.sub(a, -1) == '*' then
    if cur ~= '' and string.sub(cur, 1, #a - 1) == string.sub(a, 1, -2) then ok = true end
  elseif cur == a then
    ok = true
  end
end
if not ok then return {0, cur} end
if ARGV[1] == '' then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[1])
end
return {1, cur}
