-- slot_sweep: the load statistics of a batch of slots in one call (the relays' shard load
-- gauges, relay/shard_health.py; the Spark jobs and `relayfleet plan`, storage/maintenance.py).
-- Reads only. Interprets nothing: maintenance.slot_load turns the fields into a load.
-- KEYS[3i-2] slot i's state (string)  KEYS[3i-1] its statistics (hash)  KEYS[3i] its queue index (set)
-- ARGV[1..] the statistics fields to read (maintenance.stat_fields)
-- Returns, flat, for each slot that has anything (a state, queues, or a field that is neither
-- absent nor '0'), in order: i (its position in the batch, from 1), state|nil, queues, then
-- the fields' values (nil when absent). A slot left out has a load of zero: an empty slot
-- costs the caller nothing.
local fields = ARGV
local nfields = #fields
local out = {}
for i = 1, #KEYS / 3 do
  local state_key, stats_key, index_key = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local state = redis.call('GET', state_key)
  local values = redis.call('HMGET', stats_key, unpack(fields))
  local queues = redis.call('SCARD', index_key)
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
return out
