-- ack: delete acknowledged messages; idempotent.
-- KEYS[1] slot state (string)  KEYS[2] queue meta (hash)  KEYS[3] queue messages (stream)
-- KEYS[4] slot statistics (hash)
-- ARGV[1] mode: 'upto' (ARGV[2] = highest seq to delete) or 'seqs' (ARGV[2..] = seqs)
-- Returns {'ok', removed} | fence reply
local f = fence(KEYS[1])
if f then return f end
check_boot(KEYS[2])
local removed, bytes = 0, 0
if ARGV[1] == 'upto' then
  local upto = tonumber(ARGV[2])
  if upto >= 1 then
    -- ids from the argument's digits: a Lua number prints as 1e+14 from 10^14 on
    local entries = redis.call('XRANGE', KEYS[3], '-', ARGV[2] .. '-0')
    if #entries > 0 then
      bytes = entry_bytes(entries)
      removed = #entries
      redis.call('XTRIM', KEYS[3], 'MINID', ARGV[2] .. '-1')  -- every id below N-1 is <= N-0
    end
  end
else
  for i = 2, #ARGV do
    local id = ARGV[i] .. '-0'
    local e = redis.call('XRANGE', KEYS[3], id, id)
    if #e > 0 then
      bytes = bytes + entry_bytes(e)
      removed = removed + redis.call('XDEL', KEYS[3], id)
    end
  end
end
if removed > 0 then
  local held = tonumber(redis.call('HGET', KEYS[2], 'bytes') or '0')
  redis.call('HSET', KEYS[2], 'bytes', math.max(0, held - bytes))
  slot_stats(KEYS[4], -removed, -bytes)
end
return {'ok', removed}
