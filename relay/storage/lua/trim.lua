-- trim: retention for one queue, atomically: fence, drop the oldest messages that are
-- older than the cutoff or beyond the message cap, expire idempotency keys, fix the
-- queue's byte counter and the slot statistics, and delete the queue when it is empty
-- and idle. Idempotent: a second call with the same arguments changes nothing.
-- KEYS[1] slot state (string)        KEYS[2] queue meta (hash)
-- KEYS[3] queue messages (stream)    KEYS[4] idempotency keys (hash)
-- KEYS[5] idempotency expiry (zset)  KEYS[6] rate-limit window (zset)
-- KEYS[7] slot queue index (set)     KEYS[8] slot statistics (hash)
-- ARGV[1] now, ms since epoch
-- ARGV[2] age cutoff, ms: messages received before it are removed (0 = no age limit)
-- ARGV[3] max messages kept (-1 = no cap)
-- ARGV[4] idle period, ms: an empty queue with no enqueue for this long is deleted (-1 = never)
-- ARGV[5] queue id (slot index member)
-- ARGV[6] budget: at most this many messages / idempotency keys removed per call
-- Returns {'ok', removed, removed_bytes, deleted (0|1), more (0|1)} | fence reply
local f = fence(KEYS[1])
if f then return f end
local removed, bytes, deleted, more = trim_queue(KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8],
  tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6]))
return {'ok', removed, bytes, deleted, more}
