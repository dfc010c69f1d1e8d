-- read: non-destructive read of up to ARGV[2] messages with seq >= ARGV[1], at most
-- ARGV[3] payload bytes (always one message, if any). Writes nothing for an unknown queue.
-- KEYS[1] slot state (string)  KEYS[2] queue meta (hash)  KEYS[3] queue messages (stream)
-- KEYS[4] slot statistics (hash; read for an unknown queue's pending epoch)
-- ARGV[1] first seq ('' = the oldest held)  ARGV[2] limit  ARGV[3] payload byte budget
-- ARGV[4] queue id
-- Returns {'ok', epoch, last_assigned_seq, entries} | fence reply
local state_key, meta_key, msgs_key, stats_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local first, limit, budget, qid = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local f = fence(state_key)
if f then return f end
check_boot(meta_key)
local meta = redis.call('HMGET', meta_key, 'epoch', 'seq', 'bytes')
if not meta[1] then return {'ok', pending_epoch(stats_key, qid), 0, {}} end
local from = '-'
if first ~= '' then from = first .. '-0' end
local held = tonumber(meta[3]) or 0
local entries = read_budget(msgs_key, from, limit, budget, held, redis.call('XLEN', msgs_key))
return {'ok', meta[1], tonumber(meta[2]) or 0, entries}
