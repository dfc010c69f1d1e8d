-- status: O(1) summary of one queue.
-- KEYS[1] slot state (string)  KEYS[2] queue meta (hash)  KEYS[3] queue messages (stream)
-- KEYS[4] slot queue index (set)
-- ARGV[1] queue id  ARGV[2] epoch to use if the queue is new  ARGV[3] now ms
-- Returns {'ok', count, bytes, epoch, last_assigned_seq, oldest_ms|'', newest_ms|''} | fence reply
local f = fence(KEYS[1])
if f then return f end
check_boot(KEYS[2])
ensure_epoch(KEYS[2], KEYS[4], ARGV[1], ARGV[2], ARGV[3])
local meta = redis.call('HMGET', KEYS[2], 'epoch', 'seq', 'bytes')
local count = redis.call('XLEN', KEYS[3])
local oldest, newest = '', ''
if count > 0 then
  local first = redis.call('XRANGE', KEYS[3], '-', '+', 'COUNT', 1)
  local last = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)
  for _, pair in ipairs({{first, 'o'}, {last, 'n'}}) do
    local fields = pair[1][1][2]
    for i = 1, #fields, 2 do
      if fields[i] == 't' then
        if pair[2] == 'o' then oldest = fields[i + 1] else newest = fields[i + 1] end
      end
    end
  end
end
return {'ok', count, tonumber(meta[3]) or 0, meta[1] or '', tonumber(meta[2]) or 0, oldest, newest}
