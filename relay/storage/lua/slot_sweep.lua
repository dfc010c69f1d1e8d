-- slot_sweep: the load of a batch of slots in one call (the relays' shard load gauges,
-- relay/shard_health.py; the Spark jobs and `relayfleet plan`, storage/maintenance.py).
-- Reads only. The one place a slot's statistics are interpreted (beside enqueue.lua, which
-- writes them): both modes read each slot through slot_load below.
-- KEYS[3i-2] slot i's state (string)  KEYS[3i-1] its statistics (hash)  KEYS[3i] its queue index (set)
-- ARGV[1] mode: 'rows' | 'totals'     ARGV[2] now, ms since epoch
-- Anything else (another mode, another argument count, a key count not a multiple of 3) is
-- refused with an error naming the script: a caller out of step with this file fails loudly.
-- Rows: one {i, state|nil, queues, messages, bytes, enqueues per minute} for each slot holding
-- anything (a state, queues or a load), in batch order, i its position in the batch (from 1).
-- A slot left out has a load of zero: an empty slot costs the caller nothing.
-- Totals: {messages, bytes, queues, enqueues per minute, migrating slots} over the batch,
-- moved slots left out (the relays' gauges need no row, and reading none costs the relay
-- nothing per slot).
local mode, now = ARGV[1], tonumber(ARGV[2])
if #ARGV ~= 2 or (mode ~= 'rows' and mode ~= 'totals') or not now or #KEYS % 3 ~= 0 then
  return redis.error_reply('ERR slot_sweep: expected KEYS state, statistics, index per slot '
    .. 'and ARGV {rows|totals, now ms}')
end
local MINUTE_MS = 60000
local minute = now - now % MINUTE_MS
-- held messages and bytes; the enqueues of this minute and the last (enqueue.lua's
-- 'w<minute start ms>'); relays before 2026-11 counted minutes in wstart/wcur/wprev: still
-- read, so a fleet part-way through an upgrade reports the rate of both
local fields = {'msgs', 'bytes', string.format('w%d', minute), string.format('w%d', minute - MINUTE_MS),
  'wstart', 'wcur', 'wprev'}
local call, num, max, sub = redis.call, tonumber, math.max, string.sub

-- Messages, bytes and enqueues per minute of one slot. The current minute is partial, so
-- the last complete one is the measure; a burst that started this minute counts through max().
local function slot_load(stats_key)
  local v = call('HMGET', stats_key, unpack(fields))
  if not (v[1] or v[2] or v[3] or v[4] or v[5]) then return 0, 0, 0 end
  local current, previous = num(v[3]) or 0, num(v[4]) or 0
  local wstart = num(v[5])
  if wstart == minute then  -- the former counters: 'wcur' is this minute, 'wprev' the last
    current = max(current, num(v[6]) or 0)
    previous = max(previous, num(v[7]) or 0)
  elseif wstart == minute - MINUTE_MS then
    previous = max(previous, num(v[6]) or 0)
  end
  return max(0, num(v[1]) or 0), max(0, num(v[2]) or 0), max(current, previous)
end

local totals = mode == 'totals'
local out = {}
local messages, bytes, queues_total, rate, migrating = 0, 0, 0, 0, 0
for i = 1, #KEYS / 3 do
  local state_key, stats_key, index_key = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local state = call('GET', state_key)
  if totals then
    if not (state and sub(state, 1, 5) == 'moved') then
      if state == 'migrating' or state == 'importing' then migrating = migrating + 1 end
      local m, b, r = slot_load(stats_key)
      messages, bytes, rate = messages + m, bytes + b, rate + r
      queues_total = queues_total + call('SCARD', index_key)
    end
  else
    local m, b, r = slot_load(stats_key)
    local queues = call('SCARD', index_key)
    if state or queues > 0 or m > 0 or b > 0 or r > 0 then
      out[#out + 1] = {i, state, queues, m, b, r}
    end
  end
end
if totals then return {messages, bytes, queues_total, rate, migrating} end
return out
