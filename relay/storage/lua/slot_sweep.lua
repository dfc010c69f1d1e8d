-- slot_sweep: the load statistics of a batch of slots in one call (the relays' shard load
-- gauges, relay/shard_health.py; the Spark jobs and `relayfleet plan`, storage/maintenance.py).
-- Reads only.
-- KEYS[3i-2] slot i's state (string)  KEYS[3i-1] its statistics (hash)  KEYS[3i] its queue index (set)
-- ARGV[1] '' for each slot's row; else the current minute's start (ms) for the batch's totals
-- ARGV[2..] the statistics fields to read (maintenance.stat_fields, in its order)
-- Rows (ARGV[1] ''): flat, for each slot that has anything (a state, queues, or a field that is
-- neither absent nor '0'), in order: i (its position in the batch, from 1), state|nil, queues,
-- then the fields' values (nil when absent); uninterpreted (maintenance.slot_load does that). A
-- slot left out has a load of zero: an empty slot costs the caller nothing.
-- Totals (ARGV[1] a minute): {messages, bytes, queues, enqueues per minute, migrating} over the
-- batch, moved slots left out, each slot read as maintenance.slot_load reads it (the relays'
-- gauges need no row, and reading none costs the relay nothing per slot).
local totals_minute = tonumber(ARGV[1])
local fields = {unpack(ARGV, 2)}
local nfields = #fields
local MINUTE_MS = 60000
local call, num, max, sub = redis.call, tonumber, math.max, string.sub
local out = {}
local messages, bytes, queues_total, rate, migrating = 0, 0, 0, 0, 0
for i = 1, #KEYS / 3 do
  local state_key, stats_key, index_key = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local state = call('GET', state_key)
  if totals_minute then
    if not (state and sub(state, 1, 5) == 'moved') then
      if state == 'migrating' or state == 'importing' then migrating = migrating + 1 end
      local v = call('HMGET', stats_key, unpack(fields))
      -- msgs, bytes, this minute, the last; a former relay's wstart, wcur, wprev
      if v[1] or v[2] or v[3] or v[4] or v[5] then
        local current, previous = num(v[3]) or 0, num(v[4]) or 0
        local wstart = num(v[5])
        if wstart == totals_minute then
          current = max(current, num(v[6]) or 0)
          previous = max(previous, num(v[7]) or 0)
        elseif wstart == totals_minute - MINUTE_MS then
          previous = max(previous, num(v[6]) or 0)
        end
        messages = messages + max(0, num(v[1]) or 0)
        bytes = bytes + max(0, num(v[2]) or 0)
        rate = rate + max(current, previous)
      end
      queues_total = queues_total + call('SCARD', index_key)
    end
  else
    local values = call('HMGET', stats_key, unpack(fields))
    local queues = call('SCARD', index_key)
    local any = state or queues > 0
    for f = 1, nfields do
      if values[f] and values[f] ~= '0' then any = true end
    end
    if any then
      local n = #out
      out[n + 1], out[n + 2], out[n + 3] = i, state, queues
      for f = 1, nfields do out[n + 3 + f] = values[f] end
    end
  end
end
if totals_minute then return {messages, bytes, queues_total, rate, migrating} end
return out
