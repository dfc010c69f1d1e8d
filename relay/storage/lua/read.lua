-- read: non-destructive read of up to ARGV[2] messages with seq >= ARGV[1].
-- KEYS[1] slot state (string)  KEYS[2] queue meta (hash)  KEYS[3] queue messages (stream)
-- KEYS[4] slot queue index (set)
-- ARGV[1] first seq ('' = the oldest held)  ARGV[2] limit
-- ARGV[3] queue id  ARGV[4] epoch to use if the queue is new  ARGV[5] now ms
-- Returns {'ok', epoch, last_assigned_seq, entries} | fence reply
local f = fence(KEYS[1])
if f then return f end
check_boot(KEYS[2])
local epoch = ensure_epoch(KEYS[2], KEYS[4], ARGV[3], ARGV[4], ARGV[5])
local meta = {epoch, redis.call('HGET', KEYS[2], 'seq')}
local from = '-'
if ARGV[1] ~= '' then from = ARGV[1] .. '-0' end
local entries = redis.call('XRANGE', KEYS[3], from, '+', 'COUNT', tonumber(ARGV[2]))
return {'ok', meta[1] or '', tonumber(meta[2]) or 0, entries}
