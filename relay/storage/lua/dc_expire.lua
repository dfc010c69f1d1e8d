-- dc_expire: the periodic sweep of the DIDComm records' idle expiry (relay/didcomm/sweep.py),
-- over a batch of slots: in each slot this shard owns, removes the records whose idle expiry
-- passed (dc_sweep: a connection with its keylist, a registration with its delivery lease), at
-- most `budget` in the whole call, so a slot holding a huge backlog is cleared over several
-- calls and Redis serves others between two. A migrating, importing or moved slot is skipped
-- (fence): its records are the copy's, swept where the slot ends up.
-- KEYS[3i-2] slot i's state (string)  KEYS[3i-1] its DIDComm records (hash)  KEYS[3i] their idle expiry (zset)
-- ARGV[1] now, ms  ARGV[2] budget: most records removed by this call
-- Returns {'ok', removed, resume, fenced}: resume 0 when every slot of the batch is done, else
-- the position (from 1) of the slot to call again from; fenced: slots skipped
local now, budget = tonumber(ARGV[1]), tonumber(ARGV[2])
local removed, fenced = 0, 0
for i = 1, #KEYS / 3 do
  if removed >= budget then return {'ok', removed, i, fenced} end
  local state_key, records_key, idle_key = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  if fence(state_key) then
    fenced = fenced + 1
  else
    removed = removed + dc_sweep(records_key, idle_key, now, budget - removed)
    if removed >= budget and redis.call('ZCOUNT', idle_key, '-inf', now) > 0 then
      return {'ok', removed, i, fenced}
    end
  end
end
return {'ok', removed, 0, fenced}
