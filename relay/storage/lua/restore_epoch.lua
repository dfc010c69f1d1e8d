-- restore_epoch: after a shard was restored from a backup, everything its queues got after
-- the backup's point is lost. Each queue gets a new epoch (clients can tell) and its seq
-- counter jumps past anything that could have been handed out since the backup, so no seq
-- is ever given twice and a stale ack deletes nothing new. The run stamp 'r' is removed:
-- the queue's next write stamps it for the running Redis without a second jump.
-- KEYS[i]  queue meta (hash) of each queue of one slot
-- ARGV[1]  restore id (seeds the new epochs)   ARGV[2] seq jump
-- Returns the number of queues changed.
local meta_keys = KEYS
local restore_id, jump = ARGV[1], tonumber(ARGV[2])
local changed = 0
for _, meta_key in ipairs(meta_keys) do
  if redis.call('EXISTS', meta_key) == 1 then
    local seq = tonumber(redis.call('HGET', meta_key, 'seq') or '0') + jump
    local epoch = string.sub(redis.sha1hex(restore_id .. meta_key), 1, 16)
    redis.call('HSET', meta_key, 'epoch', epoch, 'seq', seq)
    redis.call('HDEL', meta_key, 'r')
    changed = changed + 1
  end
end
return changed
