-- drain: atomically read and delete up to ARGV[1] of the oldest messages, at most ARGV[2]
-- payload bytes (always one message, if any); deletes exactly what it returns. Writes
-- nothing for an unknown queue.
-- KEYS[1] slot state (string)  KEYS[2] queue meta (hash)  KEYS[3] queue messages (stream)
-- KEYS[4] slot statistics (hash)
-- ARGV[1] limit  ARGV[2] payload byte budget  ARGV[3] queue id
-- Returns {'ok', epoch, last_assigned_seq, entries, more (0|1)} | fence reply
local state_key, meta_key, msgs_key, stats_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local limit, budget, qid = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local f = fence(state_key)
if f then return f end
check_boot(meta_key)
local meta = redis.call('HMGET', meta_key, 'epoch', 'seq', 'bytes')
if not meta[1] then return {'ok', pending_epoch(stats_key, qid), 0, {}, 0} end
local held = tonumber(meta[3]) or 0
local len = redis.call('XLEN', msgs_key)
local entries = read_budget(msgs_key, '-', limit, budget, held, len)
if #entries > 0 then
  local lastseq = id_seq(entries[#entries][1])
  redis.call('XTRIM', msgs_key, 'MINID', (lastseq + 1) .. '-0')
  local removed = entry_bytes(entries)
  redis.call('HSET', meta_key, 'bytes', math.max(0, held - removed))
  slot_stats(stats_key, -#entries, -removed)
end
local more = 0
if len > #entries then more = 1 end
return {'ok', meta[1], tonumber(meta[2]) or 0, entries, more}
