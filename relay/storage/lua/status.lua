-- status: O(1) summary of one queue (but see ARGV[2]). Writes nothing for an unknown queue.
-- KEYS[1] slot state (string)  KEYS[2] queue meta (hash)  KEYS[3] queue messages (stream)
-- KEYS[4] slot statistics (hash; read for an unknown queue's pending epoch)
-- ARGV[1] queue id  ARGV[2] (optional) a seq: also count the messages above it
-- Returns {'ok', count, bytes, epoch, last_assigned_seq, oldest_ms|'', newest_ms|'', above} | fence
-- reply; `above` = count without ARGV[2]. The DIDComm mediator's delivery lease covers every seq up
-- to its cursor: what waits is what is above it. O(1) unless messages sit on both sides of the
-- cursor; then the ones at or below it (handed out, not yet acknowledged) are counted, at most
-- ABOVE_SCAN of them (past that the count errs towards waiting).
local state_key, meta_key, msgs_key, stats_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local qid, cursor = ARGV[1], ARGV[2] or ''
local ABOVE_SCAN = 1000
local f = fence(state_key)
if f then return f end
check_boot(meta_key)
local meta = redis.call('HMGET', meta_key, 'epoch', 'seq', 'bytes')
if not meta[1] then return {'ok', 0, 0, pending_epoch(stats_key, qid), 0, '', '', 0} end
local count = redis.call('XLEN', msgs_key)
local oldest, newest, above = '', '', count
if count > 0 then
  local first = redis.call('XRANGE', msgs_key, '-', '+', 'COUNT', 1)
  local last = redis.call('XREVRANGE', msgs_key, '+', '-', 'COUNT', 1)
  oldest = entry_field(first[1], 't') or ''
  newest = entry_field(last[1], 't') or ''
  if cursor ~= '' then
    local c = tonumber(cursor)
    if id_seq(last[1][1]) <= c then
      above = 0
    elseif id_seq(first[1][1]) <= c then
      -- ids from the argument's digits (a Lua number prints as 1e+14 from 10^14 on)
      above = count - #redis.call('XRANGE', msgs_key, '-', cursor .. '-0', 'COUNT', ABOVE_SCAN)
    end
  end
end
return {'ok', count, tonumber(meta[3]) or 0, meta[1], tonumber(meta[2]) or 0, oldest, newest, above}
