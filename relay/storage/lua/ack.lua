-- ack: delete acknowledged messages; idempotent.
-- KEYS[1] slot state (string)  KEYS[2] queue meta (hash)  KEYS[3] queue messages (stream)
-- KEYS[4] slot statistics (hash)
-- ARGV[1] mode: 'upto' (ARGV[2] = highest seq to delete) or 'seqs' (ARGV[2..] = seqs)
-- Returns {'ok', removed, removed payload bytes} | fence reply
local state_key, meta_key, msgs_key, stats_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local mode, upto = ARGV[1], ARGV[2]  -- upto: the highest seq's digits ('upto' mode)
local f = fence(state_key)
if f then return f end
check_boot(meta_key)
local removed, bytes = 0, 0
if mode == 'upto' then
  if tonumber(upto) >= 1 then
    -- ids from the argument's digits: a Lua number prints as 1e+14 from 10^14 on
    local entries = redis.call('XRANGE', msgs_key, '-', upto .. '-0')
    if #entries > 0 then
      bytes = entry_bytes(entries)
      removed = #entries
      redis.call('XTRIM', msgs_key, 'MINID', upto .. '-1')  -- every id below N-1 is <= N-0
    end
  end
else
  for i = 2, #ARGV do  -- 'seqs' mode: ARGV[2..]
    local id = ARGV[i] .. '-0'
    local e = redis.call('XRANGE', msgs_key, id, id)
    if #e > 0 then
      bytes = bytes + entry_bytes(e)
      removed = removed + redis.call('XDEL', msgs_key, id)
    end
  end
end
if removed > 0 then
  local held = tonumber(redis.call('HGET', meta_key, 'bytes') or '0')
  redis.call('HSET', meta_key, 'bytes', math.max(0, held - bytes))
  slot_stats(stats_key, -removed, -bytes)
end
return {'ok', removed, bytes}
