-- Shared prelude: relay/storage/scripts.py puts before each script the definitions it uses
-- (one name per column-0 `local`, its body indented, closed by a column-0 `end`).
-- fence(state_key): nil when this shard owns the slot; otherwise the reply to
-- return at once: {'moved', shard, epoch} or {'migrating'} (retryable).
-- A script that read the state with other keys passes it as `st` (false when absent): an
-- argument, not a second function, as Redis runs this prelude, closures and all, per call.
local function fence(state_key, st)
  if st == nil then st = redis.call('GET', state_key) end
  if not st then return nil end
  if st == 'migrating' or st == 'importing' then return {'migrating'} end
  local shard, epoch = string.match(st, '^moved (%S+) (%d+)$')
  if shard then return {'moved', shard, epoch} end
  return {'migrating'}
end

-- One field of an XRANGE-style entry {id, {field, value, ...}} (nil when absent). Stream
-- fields: p payload, t received ms, m messageId, n payload size (keys.py QueueKeys.msgs).
local function entry_field(e, name)
  local f = e[2]
  for i = 1, #f, 2 do
    if f[i] == name then return f[i + 1] end
  end
  return nil
end

-- Payload size of one XRANGE-style entry (field 'n').
local function entry_size(e)
  return tonumber(entry_field(e, 'n') or '0')
end

-- Sum of payload sizes of XRANGE-style entries.
local function entry_bytes(entries)
  local total = 0
  for _, e in ipairs(entries) do total = total + entry_size(e) end
  return total
end

-- The seq of a stream id "<seq>-0".
local function id_seq(id)
  return tonumber(string.sub(id, 1, string.find(id, '-', 1, true) - 1))
end

-- Whether a slot state `cur` ('' = absent) is one of allowed[first..]: an exact value, ''
-- for absent, or a prefix ending in '*' (e.g. 'moved b *'). The migration protocol's
-- compare step (slot_state.lua, slot_drop.lua).
local function state_allowed(cur, allowed, first)
  for i = first, #allowed do
    local a = allowed[i]
    if string.sub(a, -1) == '*' then
      if cur ~= '' and string.sub(cur, 1, #a - 1) == string.sub(a, 1, -2) then return true end
    elseif cur == a then
      return true
    end
  end
  return false
end

-- Up to `limit` entries from stream id `from` whose payloads total at most `budget`
-- bytes, and always at least one (the response budget, docs/api.md). A queue holding no
-- more than the budget (`held` bytes in `len` messages; most queues) is one XRANGE;
-- otherwise the stream is read in chunks sized by an estimate of the next sizes (the
-- queue's mean payload, or the largest seen in this read if bigger), and reading stops
-- when the rest of the budget is below that estimate: a payload is only known once
-- Redis has copied it, and a huge entry fetched just to be dropped doubled the cost of
-- a read of big messages. So an answer may carry less than the budget allows (the
-- client continues from nextSeq), never more.
local function read_budget(msgs_key, from, limit, budget, held, len)
  if held <= budget then
    return redis.call('XRANGE', msgs_key, from, '+', 'COUNT', limit)
  end
  local out, total = {}, 0
  local mean = math.max(1, math.floor(held / math.max(1, len)))
  while #out < limit do
    if #out > 0 and budget - total < mean then break end
    local want = math.max(1, math.min(limit - #out, 64, math.floor((budget - total) / mean)))
    local chunk = redis.call('XRANGE', msgs_key, from, '+', 'COUNT', want)
    if #chunk == 0 then break end
    for _, e in ipairs(chunk) do
      local n = entry_size(e)
      if #out > 0 and total + n > budget then return out end
      out[#out + 1] = e
      total = total + n
      if n > mean then mean = n end
      if #out >= limit then return out end
    end
    from = '(' .. chunk[#chunk][1]
  end
  return out
end

-- Keep the per-slot load statistics the Spark jobs read without touching payloads.
local function slot_stats(stats_key, dmsgs, dbytes)
  if dmsgs ~= 0 then redis.call('HINCRBY', stats_key, 'msgs', dmsgs) end
  if dbytes ~= 0 then redis.call('HINCRBY', stats_key, 'bytes', dbytes) end
end


-- Lost-tail detection. With appendfsync everysec a machine crash can lose the last
-- second of writes, seq counter included; the relay then records this Redis run in
-- 'rf:boot' ("<run_id>:<start ms>", see relay/storage/boot.py) before any script
-- runs on it. Every enqueue stamps the queue with the run that wrote it ('r'). A
-- queue last written by an earlier run may have lost writes: it gets a new epoch, and
-- its seq counter jumps past anything that could have been handed out and lost, so no
-- seq is ever reused and a stale ack deletes nothing new. Run ids, not clocks: a queue
-- copied in by a migration is re-stamped for this run (lua/import_stamp.lua).
-- Undeclared keys, on purpose: 'rf:boot' (keys.SHARD_BOOT) and 'rf:seq-floor'
-- (keys.SHARD_SEQ_FLOOR) describe the whole Redis process (its run, its restore), not one
-- slot, so they carry no hash tag. A shard is one standalone Redis (primary + replicas),
-- where a script may read any key; declaring them as KEYS would change nothing there and
-- would not make them Cluster-safe either (a key outside the script's hash tag is a
-- CROSSSLOT error whether declared or not), while adding two keys to every hot-path
-- EVALSHA. A shard that is itself a Redis Cluster would need one mark per hash tag.
local SEQ_JUMP = 1000000
-- A mark ending ':w' is a shard whose writes were WAIT-confirmed (minReplicas): a new run
-- there (a failover) lost nothing acknowledged, so the epoch stays; the seq still jumps.
-- (`boot`: the mark when the caller read it with other keys, false when absent)
local function boot_run(boot)
  if boot == nil then boot = redis.call('GET', 'rf:boot') end
  if not boot then return nil end
  return string.match(boot, '^([^:]+):'), string.sub(boot, -2) == ':w'
end
-- The new epoch of a queue whose last writer was an earlier run that may have lost writes.
local function lost_tail_epoch(run, meta_key)
  return string.sub(redis.sha1hex(run .. meta_key), 1, 16)
end
-- Returns the run a write must stamp on the queue (nil when the stamp is already there or
-- no boot is recorded), so a writer reads rf:boot and the stamp once.
local function check_boot(meta_key)
  local run, waited = boot_run()
  if not run then return nil end
  local r = redis.call('HGET', meta_key, 'r')
  if r == run then return nil end
  if not r then return run end
  local seq = tonumber(redis.call('HGET', meta_key, 'seq') or '0') + SEQ_JUMP
  if waited then
    redis.call('HSET', meta_key, 'seq', seq, 'r', run)
  else
    redis.call('HSET', meta_key, 'epoch', lost_tail_epoch(run, meta_key), 'seq', seq, 'r', run)
  end
  return nil
end

-- Where a new queue's seqs start. A shard restored from a backup (relayfleet restore,
-- relay/backup/restoring.py) may have handed out seqs, after the backup's point, on queues the backup
-- does not hold; the restore sets 'rf:seq-floor' above anything that could have been handed
-- out, so a queue created afterwards never repeats one. Undeclared key, like 'rf:boot' (above).
-- `floor`: the key's value (false when absent), which enqueue.lua reads with other keys.
local function seq_floor(floor)
  return tonumber(floor or '0') or 0
end

-- The epoch of a queue that has no keys (docs/api.md: reads, status and inbox reads of
-- a queue that does not exist create no Redis state). Every read answers the same
-- value and the first enqueue stores it, so a client sees no change when the queue
-- appears. It changes with the Redis run (a replaced Redis) and with the slot's 'qgen'
-- (bumped by trim.lua whenever it deletes a queue), so a queue deleted and created
-- again never repeats an epoch its earlier life used.
local function epoch_of(run, gen, qid)
  return string.sub(redis.sha1hex((run or '') .. ':' .. (gen or '0') .. ':' .. qid), 1, 16)
end
local function pending_epoch(stats_key, qid)
  return epoch_of(boot_run(), redis.call('HGET', stats_key, 'qgen'), qid)
end

-- A queue's rate window while it holds one enqueue (enqueue.lua; docs/memory.md): the meta
-- field 'w' = "<ms>:<seq>:<attempt token>", the entry its sorted set (keys.QueueKeys.rate)
-- would hold ("<seq>:<token>" scored <ms>), without that key's ~190 B. Returns the entry's time
-- (the caller's string), its sorted-set member, and its time as a number when that is inside
-- the window (now - window, now] (nil otherwise). Nothing for no field.
local function inline_rate(w, now, window)
  if not w then return nil end
  local sep = string.find(w, ':', 1, true)
  if not sep then return nil end
  local at = string.sub(w, 1, sep - 1)
  local t = tonumber(at)
  if t and t > now - window then return at, string.sub(w, sep + 1), t end
  return at, string.sub(w, sep + 1), nil
end

-- The seq a rate-window member "<seq>:<token>" records, when it is attempt `token`'s.
local function attempt_seq(member, token)
  local sep = string.find(member, ':', 1, true)
  if sep and string.sub(member, sep + 1) == token then return tonumber(string.sub(member, 1, sep - 1)) end
  return nil
end

-- A recipient's rate ring (keys.slot_recipients, field '<r>|w'): the admits of its non-default
-- channels per bucket of a tenth of the rate window, "<bucket>:<count>" pairs separated by
-- ','. A bucket counts while any part of it is inside the window, so the count may include up
-- to one bucket's admits from just before the window: it refuses early, never late.
-- Returns the count and the ms until the oldest counted bucket leaves the window (0: none).
local function ring_count(w, now, window)
  if not w then return 0, 0 end
  local width = math.max(1, math.ceil(window / 10))
  local total, leaves = 0, 0
  for b, c in string.gmatch(w, '(%d+):(%d+)') do
    local gone = (tonumber(b) + 1) * width + window - now  -- ms until this bucket leaves
    if gone > 0 then
      total = total + tonumber(c)
      if leaves == 0 or gone < leaves then leaves = gone end
    end
  end
  return total, leaves
end

-- The ring `w` with `delta` added to the bucket of time `t`, buckets out of the window dropped
-- (a bucket never goes below 0). nil when nothing is left.
local function ring_add(w, now, window, t, delta)
  local width = math.max(1, math.ceil(window / 10))
  local at = math.floor(t / width)
  local parts, found = {}, false
  for b, c in string.gmatch(w or '', '(%d+):(%d+)') do
    local bn, cn = tonumber(b), tonumber(c)
    if bn == at then cn, found = math.max(0, cn + delta), true end
    if (bn + 1) * width + window - now > 0 and cn > 0 then
      parts[#parts + 1] = string.format('%d:%d', bn, cn)
    end
  end
  if not found and delta > 0 and (at + 1) * width + window - now > 0 then
    parts[#parts + 1] = string.format('%d:%d', at, delta)
  end
  if #parts == 0 then return nil end
  return table.concat(parts, ',')
end

-- The DIDComm records' idle expiry (dc_*.lua, relay/didcomm/records.py): each 'c:<agent>' (a
-- connection) and 'k:<key>' (a registration) has a member of that name in the slot's idle
-- sorted set, scored with the ms it expires at. The member deciding a field: 'r:' (a
-- connection's keylist), 'n:' (its DIDComm v2 recipient DIDs), 'p:' (its push devices) and
-- 'w:' (its push window) follow its 'c:', 'd:' (a key's delivery lease) its 'k:'.
local function dc_governor(field)
  local kind = string.sub(field, 1, 2)
  if kind == 'r:' or kind == 'n:' or kind == 'p:' or kind == 'w:' then return 'c:' .. string.sub(field, 3) end
  if kind == 'd:' then return 'k:' .. string.sub(field, 3) end
  return field
end

-- Whether the record `member` governs is alive at `now`. A record written before idle
-- expiry existed has no score: it gets one now (`idle` ms from now) instead of never expiring.
local function dc_alive(records_key, idle_key, member, now, idle)
  if redis.call('HEXISTS', records_key, member) == 0 then return false end
  local score = redis.call('ZSCORE', idle_key, member)
  if not score then
    redis.call('ZADD', idle_key, now + idle, member)
    return true
  end
  return tonumber(score) > now
end

-- Remove up to `n` records whose idle expiry passed (a connection with its keylist, push
-- devices and push window, a registration with its delivery lease); bounded, so no write pays for a backlog.
local function dc_sweep(records_key, idle_key, now, n)
  local gone = redis.call('ZRANGEBYSCORE', idle_key, '-inf', now, 'LIMIT', 0, n)
  for _, m in ipairs(gone) do
    local id = string.sub(m, 3)
    if string.sub(m, 1, 2) == 'c:' then
      redis.call('HDEL', records_key, m, 'r:' .. id, 'n:' .. id, 'p:' .. id, 'w:' .. id)
    else
      redis.call('HDEL', records_key, m, 'd:' .. id)
    end
  end
  if #gone > 0 then redis.call('ZREM', idle_key, unpack(gone)) end
  return #gone
end

-- Retention for one queue (trim.lua; trim_slot.lua for each queue of a slot), after the caller's
-- fence check: drop the oldest messages older than `cutoff` or beyond `cap`, expire
-- idempotency keys, fix the byte counter and slot statistics, delete the queue when empty and
-- idle. At most `budget` messages or idempotency keys go per call. Returns removed, removed
-- bytes, deleted (0|1), more (0|1: budget spent, call again).
local function trim_queue(meta_key, msgs_key, idem_key, idemx_key, rate_key, index_key, stats_key, now, cutoff, cap, idle, qid, budget)
  -- An index entry whose queue has no keys left is stale: drop it.
  if redis.call('EXISTS', meta_key, msgs_key, idem_key, idemx_key) == 0 then
    redis.call('SREM', index_key, qid)
    redis.call('HINCRBY', stats_key, 'qgen', 1)  -- its history is gone: never reuse its epoch
    return 0, 0, 1, 0
  end
  local meta = redis.call('HMGET', meta_key, 'seq', 'bytes', 'created', 'tseen')
  local seq = tonumber(meta[1]) or 0
  local held = tonumber(meta[2]) or 0
  local len = redis.call('XLEN', msgs_key)
  -- Messages leave oldest first, so the stream stays a contiguous run of seqs. Most
  -- queues have nothing due: read one entry first, then growing chunks.
  local over = 0
  if cap >= 0 and len > cap then over = len - cap end
  local removed, bytes, more = 0, 0, 0
  local last_id, last_t = nil, nil
  local from, want = '-', math.max(1, math.min(over, 64))
  while removed < budget do
    local chunk = redis.call('XRANGE', msgs_key, from, '+', 'COUNT', math.min(want, budget - removed))
    if #chunk == 0 then break end
    local stop = false
    for _, e in ipairs(chunk) do
      local t, n = tonumber(entry_field(e, 't') or '0'), entry_size(e)
      if removed < over or t < cutoff then
        removed = removed + 1
        bytes = bytes + n
        last_id, last_t = e[1], t
        if removed >= budget then break end
      else
        stop = true
        break
      end
    end
    if stop then break end
    from = '(' .. chunk[#chunk][1]
    want = math.min(64, want * 4)
  end
  -- When every message went and the newest was the last one enqueued, its time is
  -- the queue's last enqueue (used by the idle check below).
  local last_enq = nil
  if last_id then
    local lseq = id_seq(last_id)
    redis.call('XTRIM', msgs_key, 'MINID', (lseq + 1) .. '-0')
    len = len - removed
    if len == 0 and lseq == seq then last_enq = last_t end
    -- budget spent: the next entry may be due too; the caller calls again
    if removed >= budget and len > 0 then more = 1 end
  end
  -- Expired idempotency keys (enqueue only expires a few per write).
  local left = budget - removed
  if left > 0 then
    local old = redis.call('ZRANGEBYSCORE', idemx_key, '-inf', now, 'LIMIT', 0, left)
    if #old > 0 then
      redis.call('HDEL', idem_key, unpack(old))
      redis.call('ZREM', idemx_key, unpack(old))
      if #old == left then more = 1 end
    end
  else
    more = 1
  end
  -- An empty stream holds no bytes: repair any drift in the counters here.
  local fixed = held - bytes
  if len == 0 and fixed ~= 0 then bytes = held; fixed = 0 end
  if bytes ~= 0 or removed > 0 then
    redis.call('HSET', meta_key, 'bytes', math.max(0, fixed))
    slot_stats(stats_key, -removed, -bytes)
  end
  -- Idle check. The last enqueue time is known exactly when the newest message is
  -- still held; otherwise meta 'tseen' = "<seq>:<ms>" says the enqueue of <seq> was at
  -- or before <ms> (written when a trim empties the queue, or, if an ack emptied it,
  -- the first time a trim sees it empty), so a queue is deleted only when provably
  -- idle. A queue that never held a message counts from its creation.
  local deleted = 0
  if len == 0 and idle >= 0 then
    local since = last_enq
    if not since and seq == 0 then since = tonumber(meta[3]) or 0 end
    if not since and meta[4] then
      local sep = string.find(meta[4], ':', 1, true)
      if sep and tonumber(string.sub(meta[4], 1, sep - 1)) == seq then
        since = tonumber(string.sub(meta[4], sep + 1))
      end
    end
    local mark = nil
    if not since then
      since = now
      mark = seq .. ':' .. now
    elseif last_enq and meta[4] ~= seq .. ':' .. last_enq then
      mark = seq .. ':' .. last_enq  -- emptied here: later sweeps cannot see that time
    end
    if now - since >= idle and more == 0 and redis.call('ZCARD', idemx_key) == 0 then
      redis.call('DEL', meta_key, msgs_key, idem_key, idemx_key, rate_key)
      redis.call('SREM', index_key, qid)
      -- a queue created again under this name must not get the epoch it had (prelude pending_epoch)
      redis.call('HINCRBY', stats_key, 'qgen', 1)
      deleted = 1
    elseif mark then
      redis.call('HSET', meta_key, 'tseen', mark)
    end
  end
  return removed, bytes, deleted, more
end
