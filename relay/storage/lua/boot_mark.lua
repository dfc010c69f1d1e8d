-- boot_mark: record the running Redis process in the shard's boot mark, once per run
-- (relay/storage/boot.py; the prelude's check_boot reads it). Run without the prelude.
-- The start instant, from Redis's uptime, is there for people reading the key; the
-- scripts compare only run ids.
-- KEYS[1] the shard's boot mark (string "<run>:<start ms>[:w]", keys.SHARD_BOOT; <run> is
--         the run_id, on a 'w' shard followed by 12 hex digits of the replication ID)
-- ARGV[1] 'w' when the shard's writes are WAIT-confirmed (minReplicas), else ''
-- Returns the mark now held.
local boot_key = KEYS[1]
local waited = ARGV[1] == 'w'
local info = redis.call('INFO', 'server')
-- minReplicas shards ('w'): the run is the process and its replication history. A node
-- deposed by a failover (its data replaced by a full sync) and promoted again keeps its
-- run_id but has a new replid, and what it acknowledged before may be gone: a new run.
local run_id = string.match(info, 'run_id:(%x+)')
if waited then
  local replid = string.match(redis.call('INFO', 'replication'), 'master_replid:(%x+)') or ''
  run_id = run_id .. string.sub(replid, 1, 12)
end
local cur = redis.call('GET', boot_key)
local same_mode = (string.sub(cur or '', -2) == ':w') == waited
if cur and string.sub(cur, 1, #run_id + 1) == run_id .. ':' and same_mode then return cur end
local up = tonumber(string.match(info, 'uptime_in_seconds:(%d+)'))
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local mark = run_id .. ':' .. (now - up * 1000)
if waited then mark = mark .. ':w' end
redis.call('SET', boot_key, mark)
return mark
