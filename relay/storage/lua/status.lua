-- status: O(1) summary of one queue. Writes nothing for an unknown queue.
-- KEYS[1] slot state (string)  KEYS[2] queue meta (hash)  KEYS[3] queue messages (stream)
-- KEYS[4] slot statistics (hash; read for an unknown queue's pending epoch)
-- ARGV[1] queue id
-- Returns {'ok', count, bytes, epoch, last_assigned_seq, oldest_ms|'', newest_ms|''} | fence reply
local state_key, meta_key, msgs_key, stats_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local qid = ARGV[1]
local f = fence(state_key)
if f then return f end
check_boot(meta_key)
local meta = redis.call('HMGET', meta_key, 'epoch', 'seq', 'bytes')
if not meta[1] then return {'ok', 0, 0, pending_epoch(stats_key, qid), 0, '', ''} end
local count = redis.call('XLEN', msgs_key)
local oldest, newest = '', ''
if count > 0 then
  local first = redis.call('XRANGE', msgs_key, '-', '+', 'COUNT', 1)
  local last = redis.call('XREVRANGE', msgs_key, '+', '-', 'COUNT', 1)
  oldest = entry_field(first[1], 't') or ''
  newest = entry_field(last[1], 't') or ''
end
return {'ok', count, tonumber(meta[3]) or 0, meta[1], tonumber(meta[2]) or 0, oldest, newest}
