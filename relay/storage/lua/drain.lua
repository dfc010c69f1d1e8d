-- drain: atomically read and delete up to ARGV[1] of the oldest messages.
-- KEYS[1] slot state (string)  KEYS[2] queue meta (hash)  KEYS[3] queue messages (stream)
-- KEYS[4] slot statistics (hash)  KEYS[5] slot queue index (set)
-- ARGV[1] limit  ARGV[2] queue id  ARGV[3] epoch to use if the queue is new  ARGV[4] now ms
-- Returns {'ok', epoch, last_assigned_seq, entries, more (0|1)} | fence reply
local f = fence(KEYS[1])
if f then return f end
check_boot(KEYS[2])
ensure_epoch(KEYS[2], KEYS[5], ARGV[2], ARGV[3], ARGV[4])
local meta = redis.call('HMGET', KEYS[2], 'epoch', 'seq', 'bytes')
local entries = redis.call('XRANGE', KEYS[3], '-', '+', 'COUNT', tonumber(ARGV[1]))
if #entries > 0 then
  local last = entries[#entries][1]
  local lastseq = tonumber(string.sub(last, 1, string.find(last, '-', 1, true) - 1))
  redis.call('XTRIM', KEYS[3], 'MINID', (lastseq + 1) .. '-0')
  local removed = entry_bytes(entries)
  redis.call('HSET', KEYS[2], 'bytes', math.max(0, (tonumber(meta[3]) or 0) - removed))
  slot_stats(KEYS[4], -#entries, -removed)
end
local more = 0
if redis.call('XLEN', KEYS[3]) > 0 then more = 1 end
return {'ok', meta[1] or '', tonumber(meta[2]) or 0, entries, more}
