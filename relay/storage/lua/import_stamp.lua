-- import_stamp: mark a queue just copied in by a migration as written on this Redis run.
-- The lost-tail check (prelude check_boot) treats a queue stamped by another Redis run
-- as possibly truncated; a migrated queue carries the source's run id, so without this
-- stamp a healthy queue would get a new epoch on its new shard. With no run recorded
-- here yet, the stamp is removed: the queue's next write stamps it.
-- KEYS[1] queue meta (hash)
-- Returns 1 when stamped, 0 when the queue has no meta here.
local meta_key = KEYS[1]
if redis.call('EXISTS', meta_key) == 0 then return 0 end
local run = boot_run()
if run then redis.call('HSET', meta_key, 'r', run) else redis.call('HDEL', meta_key, 'r') end
return 1
