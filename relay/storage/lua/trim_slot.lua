-- trim_slot: retention for the queues of one slot, a page of its queue index per call: each
-- queue trimmed exactly as trim.lua trims it (trim_queue), so a sweep costs Redis one call per
-- page of a slot instead of one per queue, and its client no work per queue.
-- The queues' own keys are not declared: they are built here from the slot's key prefix and
-- the suffixes relay/storage/keys.py passes, all under the slot's hash tag (as the declared
-- keys), on a shard that is one standalone Redis (keys.py).
-- KEYS[1] slot state (string)   KEYS[2] slot queue index (set)   KEYS[3] slot statistics (hash)
-- ARGV[1..4] now, age cutoff, max messages kept, idle period: as trim.lua's ARGV[1..4]
-- ARGV[5] budget: at most this many messages / idempotency keys removed per call, all queues
-- ARGV[6] SSCAN cursor of the index ('0' to start)   ARGV[7] SSCAN COUNT (queues per call)
-- ARGV[8] the prefix of the slot's queue keys ("<slot tag>:q:"), ARGV[9..13] the suffixes of
--         a queue's meta, msgs, idem, idemx and rate keys
-- Returns {'ok', next cursor ('0': the index is done), queues trimmed, removed, removed_bytes,
--          deleted, {queue ids left with work: call trim.lua on each}} | fence reply
local state_key, index_key, stats_key = KEYS[1], KEYS[2], KEYS[3]
local now, cutoff, cap, idle = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local budget = tonumber(ARGV[5])
local f = fence(state_key)
if f then return f end
local page = redis.call('SSCAN', index_key, ARGV[6], 'COUNT', ARGV[7])
local prefix = ARGV[8]
local queues, removed, bytes, deleted, again = 0, 0, 0, 0, {}
for _, qid in ipairs(page[2]) do
  local left = budget - removed
  if left <= 0 then
    again[#again + 1] = qid
  else
    local base = prefix .. qid .. ':'
    local r, b, d, more = trim_queue(base .. ARGV[9], base .. ARGV[10], base .. ARGV[11], base .. ARGV[12],
      base .. ARGV[13], index_key, stats_key, now, cutoff, cap, idle, qid, left)
    queues = queues + 1
    removed, bytes, deleted = removed + r, bytes + b, deleted + d
    if more == 1 then again[#again + 1] = qid end
  end
end
return {'ok', page[1], queues, removed, bytes, deleted, again}
