-- enqueue: store messages, each one atomically: fence, idempotency, rate limit, caps,
-- XADD, counters, slot index and statistics, wakeup PUBLISH. One call carries every
-- enqueue a relay sent this shard in one loop tick (relay/storage/store.py), in order,
-- each with its own reply; a call of one is the single enqueue. Per call, not per
-- message: each slot state is read once ('rf:boot' and 'rf:seq-floor' in one MGET with
-- the first), each slot's statistics are incremented once, and each wakeup channel
-- someone subscribes to is published once, after every write (one PUBSUB NUMSUB asks for
-- all of them: relays SUBSCRIBE on the primary, never PSUBSCRIBE, so a channel it counts
-- no subscriber for has nobody to wake).
-- Fixed arguments:
-- ARGV[1] rate limit: messages per window   ARGV[2] rate window, ms
-- ARGV[3] queue cap: messages        ARGV[4] queue cap: bytes
-- ARGV[5] idempotency retention, ms
-- ARGV[6] recipient cap: messages held across its channels (0 = none)
-- ARGV[7] recipient cap: payload bytes held across its channels (0 = none)
-- ARGV[8] recipient rate: messages per window across its channels (0 = none)
-- ARGV[9] shard reserve: refuse a message that takes its queue past this many payload bytes
--         (0 = the shard is not in its reserve; relay/shard_health.py sets it)
-- Per item i, 9 keys from k = 9 * (i - 1) and 9 arguments from a = 9 + 9 * (i - 1):
-- KEYS[k+1] slot state (string)        KEYS[k+2] queue meta (hash)
-- KEYS[k+3] queue messages (stream)    KEYS[k+4] idempotency keys (hash)
-- KEYS[k+5] idempotency expiry (zset)  KEYS[k+6] rate-limit window (zset; a window of one
--           enqueue is the meta's field 'w' instead: lua/_prelude.lua inline_rate)
-- KEYS[k+7] slot queue index (set)     KEYS[k+8] slot statistics (hash)
-- KEYS[k+9] slot recipient records (hash; read for a default-channel item, whose slot is its
--           recipient's home: keys.slot_recipients)
-- ARGV[a+1] payload                    ARGV[a+2] now, ms since epoch
-- ARGV[a+3] idempotency key ('' = none)
-- ARGV[a+4] payload digest ('*' = a repeated key is a duplicate whatever the payload)
-- ARGV[a+5] messageId stored with the message ('' = none)
-- ARGV[a+6] queue id (slot index member)  ARGV[a+7] wakeup channel
-- ARGV[a+8] attempt token: unique per enqueue (kept across its resends); also the epoch
--           of a queue whose meta was lost while its index entry stayed
-- ARGV[a+9] '1' when this resends an attempt whose reply never came (its outcome is
--           unknown): if that attempt stored the message, answer its seq instead
-- Returns one reply per item: {'ok', seq, subscribers, epoch} | {'dup', seq} | {'conflict', seq}
--       | {'rate', retry_after_ms} | {'rrate', retry_after_ms} (the recipient's rate)
--       | {'full', reason} (reason: 'messages', 'bytes', 'recipient messages',
--         'recipient bytes', 'reserve') | fence reply
-- (a resend that finds its lost attempt answers {'ok', seq, 0}: no epoch, nothing published)
--
-- Out of memory: Redis refuses a script's writes only until its first write, so every
-- item writes XADD first (refused at maxmemory; nothing before it writes) and a refused
-- call changes nothing.
-- Cost: Lua hands a number to Redis as "%.17g" (a libc float print costs more than most of
-- the commands here), so numbers are passed as the caller's strings or formatted '%d'.
local fmt = string.format
-- (each tonumber of a string is a libc strtod: the window and the retention are converted
-- only where used)
local window_s, idem_s = ARGV[2], ARGV[5]
local cap_msgs, cap_bytes = tonumber(ARGV[3]), tonumber(ARGV[4])
-- the rate_limit-th newest rate-window entry as an index from the oldest: ZRANGE's "-n"
-- (none when fewer are held)
local nth_newest = '-' .. ARGV[1]
-- and the one before it ('-0' for a limit of 1: not read), for a window partly in the meta
local nth_before = fmt('-%d', tonumber(ARGV[1]) - 1)
-- the recipient-wide limits (docs/design-decisions.md, "Per-recipient quotas"): a
-- default-channel item checks them with its recipient's record in the same slot; a
-- non-default one was admitted by that record's shard before it was sent (rcpt_admit.lua)
local rcap_msgs, rcap_bytes, rrate = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local rcpt_on = rcap_msgs > 0 or rcap_bytes > 0 or rrate > 0
local reserve = tonumber(ARGV[9])

local fences = {}  -- slot state key -> fence reply, or false when this shard owns it
-- the boot mark's run and the seq floor, read with the first item's slot state (one MGET)
local boot_read, run, waited, floor = false, nil, false, nil
local stats, stats_order = {}, {}  -- slot statistics key -> {messages, bytes, minute}, in first-use order
local wakes, wake_order = {}, {}  -- channel -> {seq, first now, replies, epoch, carried, bytes}, in first-use order
-- A wakeup carries its channel's messages of this call when they are this small in total
-- (payloads + messageIds) and someone subscribes, so a woken waiter answers without reading
-- them back. Only references are kept until PUBSUB NUMSUB says whether anyone listens:
-- building the text for nobody (most enqueues) cost ~20 % of the script at 256 B.
local CARRY_BYTES = 8192

-- Add one slot's stored messages and bytes of one minute to its statistics, and its
-- enqueues to that minute's counter 'w<minute start ms>' (the rebalance planner's rate is
-- the larger of this minute's and the last one's: relay/storage/maintenance.py). Three
-- increments: Lua's tonumber and number printing cost more than these commands, and a
-- minute's first increment is where counters older than the last minute are dropped.
local function add_stats(stats_key, s)
  local one = s[1] == 1
  local n = one and '1' or fmt('%d', s[1])
  redis.call('HINCRBY', stats_key, 'msgs', n)
  redis.call('HINCRBY', stats_key, 'bytes', one and s[4] or fmt('%d', s[2]))
  local minute = s[3]
  if redis.call('HINCRBY', stats_key, 'w' .. fmt('%d', minute), n) == s[1] then
    local last = tonumber(redis.call('HGET', stats_key, 'wlast') or '0')
    if last < minute then  -- (a relay whose clock is behind never moves it back)
      local older = 'w' .. fmt('%d', last - 60000)
      if last < minute - 60000 then
        redis.call('HDEL', stats_key, older, 'w' .. fmt('%d', last))
      else
        redis.call('HDEL', stats_key, older)
      end
      redis.call('HSET', stats_key, 'wlast', fmt('%d', minute))
    end
  end
end

local function enqueue_one(k, a)
  local state_key, meta_key, msgs_key, idem_key = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local idemx_key, rate_key, index_key, stats_key = KEYS[k + 5], KEYS[k + 6], KEYS[k + 7], KEYS[k + 8]
  local rcpt_key = KEYS[k + 9]
  local payload, now_s, ikey, digest = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4]
  local message_id, qid, channel, token, resend = ARGV[a + 5], ARGV[a + 6], ARGV[a + 7], ARGV[a + 8], ARGV[a + 9]
  local f = fences[state_key]
  if f == nil then
    if boot_read then
      f = fence(state_key) or false
    else
      local v = redis.call('MGET', state_key, 'rf:boot', 'rf:seq-floor')
      run, waited = boot_run(v[2])
      floor, boot_read = v[3], true
      f = fence(state_key, v[1]) or false
    end
    fences[state_key] = f
  end
  if f then return f end
  if resend == '1' then
    -- the lost attempt ran with the same `now`: its rate-window entry "<seq>:<token>" is
    -- scored `now` and stays for the rate window, within which the relay resends; it is in
    -- the sorted set, or in the meta's 'w' when it was the window's only one (below)
    for _, member in ipairs(redis.call('ZRANGEBYSCORE', rate_key, now_s, now_s)) do
      local s = attempt_seq(member, token)
      if s then return {'ok', s, 0} end
    end
    local at, member = inline_rate(redis.call('HGET', meta_key, 'w'), 0, 0)
    local s = at == now_s and attempt_seq(member, token)
    if s then return {'ok', s, 0} end
  end
  local meta = redis.call('HMGET', meta_key, 'epoch', 'r', 'seq', 'bytes', 'w')
  if ikey ~= '' then
    local prev = redis.call('HGET', idem_key, ikey)
    if prev then
      local sep = string.find(prev, ':', 1, true)
      local pseq = tonumber(string.sub(prev, 1, sep - 1))
      if digest == '*' or string.sub(prev, sep + 1) == digest then return {'dup', pseq} end
      return {'conflict', pseq}
    end
  end
  -- Sliding window: refused while `rate_limit` stored messages are younger than `window`,
  -- i.e. while the rate_limit-th newest is; retry when it leaves the window. Ranked by
  -- score (the enqueue time), so relays whose clocks disagree still count the same set.
  -- Old entries are trimmed lazily (below): the rank lookup ignores them.
  -- A window holding a single enqueue is the meta's field 'w' instead of the sorted set
  -- (docs/memory.md: the set's key cost a queue ~190 B); with a second one inside the window
  -- both move to the set (below). Both are read as one window: one a relay of an earlier
  -- version wrote to the set may sit beside the field.
  local now = tonumber(now_s)
  local trim = false
  local w_at, w_member, wt = nil, nil, nil
  if meta[5] then w_at, w_member, wt = inline_rate(meta[5], now, tonumber(window_s)) end
  local nth = redis.call('ZRANGE', rate_key, nth_newest, nth_newest, 'WITHSCORES')
  local t = nth[2] and tonumber(nth[2])
  if wt then
    -- the limit-th newest of the set and the field: the set's, or the field's when that is
    -- newer and the set's (limit-1)-th newest (none for a limit of 1) is newer still
    local above = wt
    if nth_before ~= '-0' then
      local before = redis.call('ZRANGE', rate_key, nth_before, nth_before, 'WITHSCORES')
      above = before[2] and math.min(tonumber(before[2]), wt)
    end
    if above and (not t or above > t) then t = above end
  end
  if t then
    local window = tonumber(window_s)
    if t > now - window then return {'rate', math.max(1, t + window - now)} end
    trim = true
  end
  local size = string.len(payload)
  local held = (tonumber(meta[4]) or 0) + size
  local len = redis.call('XLEN', msgs_key)
  if len + 1 > cap_msgs then return {'full', 'messages'} end
  if held > cap_bytes then return {'full', 'bytes'} end
  if reserve > 0 and held > reserve then return {'full', 'reserve'} end
  if rcpt_on and string.byte(qid, -1) == 46 then  -- "<recipient>.": the default channel
    local r = string.sub(qid, 1, -2) .. '|'
    local h = redis.call('HMGET', rcpt_key, r .. 'n', r .. 'b', r .. 'w')
    if rcap_msgs > 0 and len + 1 + (tonumber(h[1]) or 0) > rcap_msgs then
      return {'full', 'recipient messages'}
    end
    if rcap_bytes > 0 and held + (tonumber(h[2]) or 0) > rcap_bytes then
      return {'full', 'recipient bytes'}
    end
    -- the recipient's rate: this queue's window plus its other channels' ring (with no ring,
    -- the queue's own limit above already implies a recipient limit at least as large)
    if rrate > 0 and (h[3] or rrate < tonumber(ARGV[1])) then
      local window = tonumber(window_s)
      local others, leaves = ring_count(h[3], now, window)
      local from = '(' .. fmt('%d', now - window)
      if others + redis.call('ZCOUNT', rate_key, from, '+inf') + (wt and 1 or 0) >= rrate then
        local first = redis.call('ZRANGEBYSCORE', rate_key, from, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
        local oldest = first[2] and tonumber(first[2])
        if wt and (not oldest or wt < oldest) then oldest = wt end
        if oldest then
          local mine = oldest + window - now
          if leaves == 0 or mine < leaves then leaves = mine end
        end
        return {'rrate', math.max(1, leaves)}
      end
    end
  end

  -- Stored. The lost-tail check (as the prelude's) is folded into this one meta write.
  local seq = tonumber(meta[3])
  local epoch, created, lost = nil, false, false
  if not meta[1] then epoch, created = token, true end
  local stamp = nil
  if run and meta[2] ~= run then
    stamp = run
    if meta[2] then
      seq = (seq or 0) + SEQ_JUMP
      if not waited then epoch, lost = lost_tail_epoch(run, meta_key), true end
    end
  end
  seq = (seq or seq_floor(floor)) + 1
  local seq_s, size_s = fmt('%d', seq), fmt('%d', size)
  local held_s = meta[4] and fmt('%d', held) or size_s  -- (no meta bytes: held is this one)
  redis.call('XADD', msgs_key, seq_s .. '-0', 'p', payload, 't', now_s, 'm', message_id, 'n', size_s)
  if len == 0 and size < 4096 then
    -- Redis 7.0 gives a stream's new node a listpack of 4 KiB at once (min(4096,
    -- stream-node-max-bytes)), 16x a 256-byte message: a copy holds only what is in it, so a
    -- stream's first entry is copied into place (its later entries grow the copy as needed;
    -- a payload of 4 KiB or more outgrew the 4 KiB already). The copy's name is keys.py's
    -- COMPACT_SUFFIX after the stream's; it lives only within this call.
    local copy = msgs_key .. ':compact'
    redis.call('COPY', msgs_key, copy, 'REPLACE')
    redis.call('RENAME', copy, msgs_key)
  end
  if created then
    -- a new queue keeps the epoch reads already answered for it; one still in the index
    -- lost its meta (its history), so it keeps the fresh token instead (SADD answers
    -- whether it was there: one call, after XADD, so XADD still writes first)
    if redis.call('SADD', index_key, qid) == 1 and not lost then
      epoch = epoch_of(run, redis.call('HGET', stats_key, 'qgen'), qid)
    end
    -- (no 'created' any more: only trim.lua reads it, for a queue of seq 0, which an enqueue
    -- never leaves; its 19 bytes took the meta's listpack from 96 to 128 B: docs/memory.md.
    -- A meta an earlier version wrote keeps it, and trim.lua still reads it there.)
  end
  -- This enqueue's rate-window entry: the meta's field when the window holds no other (no
  -- field inside the window, and no sorted set: it expires one window after its newest
  -- entry, and PEXPIRE, which it needs anyway, answers whether it exists), else the set, the
  -- field's entry with it.
  local member = seq_s .. ':' .. token
  local in_set = wt or redis.call('PEXPIRE', rate_key, window_s) == 1
  local m = {'seq', seq_s, 'bytes', held_s}
  if epoch then m[5], m[6] = 'epoch', epoch end
  if stamp then m[#m + 1], m[#m + 2] = 'r', stamp end
  if not in_set then m[#m + 1], m[#m + 2] = 'w', now_s .. ':' .. member end
  redis.call('HSET', meta_key, unpack(m))
  if in_set then
    if wt then
      redis.call('ZADD', rate_key, w_at, w_member, now_s, member)
      redis.call('PEXPIRE', rate_key, window_s)
    else
      redis.call('ZADD', rate_key, now_s, member)
    end
    if meta[5] then redis.call('HDEL', meta_key, 'w') end  -- (moved, or out of the window)
    -- bounded: entries past the window go when the rank lookup met one, and every 10th seq
    if trim or string.sub(seq_s, -1) == '0' then
      redis.call('ZREMRANGEBYSCORE', rate_key, '-inf', fmt('%d', now - tonumber(window_s)))
    end
  end
  if ikey ~= '' then
    redis.call('HSET', idem_key, ikey, seq_s .. ':' .. digest)
    redis.call('ZADD', idemx_key, fmt('%d', now + tonumber(idem_s)), ikey)
    -- expire a few old idempotency keys per write: bounded work, no background job
    local old = redis.call('ZRANGEBYSCORE', idemx_key, '-inf', now_s, 'LIMIT', 0, 8)
    if #old > 0 then
      redis.call('HDEL', idem_key, unpack(old))
      redis.call('ZREM', idemx_key, unpack(old))
    end
  end
  -- slot statistics: summed per slot and minute, written once per call (or minute)
  local minute = now - (now % 60000)
  local st = stats[stats_key]
  if not st then
    st = {0, 0, minute}
    stats[stats_key] = st
    stats_order[#stats_order + 1] = stats_key
  elseif st[3] ~= minute then
    add_stats(stats_key, st)
    st[1], st[2], st[3] = 0, 0, minute
  end
  st[1], st[2], st[4] = st[1] + 1, st[2] + size, size_s  -- (st[4]: its bytes when it holds one)
  local cur_epoch = epoch or meta[1]
  local reply = {'ok', seq, 0, cur_epoch}
  local w = wakes[channel]
  if not w then
    w = {seq_s, now_s, {}, cur_epoch, {}, 0}
    wakes[channel] = w
    wake_order[#wake_order + 1] = channel
  end
  w[1] = seq_s
  w[3][#w[3] + 1] = reply
  local carried = w[5]
  if carried then
    local n = w[6] + size + string.len(message_id)
    if n > CARRY_BYTES or w[4] ~= cur_epoch then
      w[5] = false
    else
      w[6] = n
      local c = #carried
      carried[c + 1], carried[c + 2], carried[c + 3], carried[c + 4] = seq_s, now_s, message_id, payload
    end
  end
  return reply
end

local replies = {}
for i = 1, #KEYS / 9 do
  replies[i] = enqueue_one(9 * (i - 1), 9 + 9 * (i - 1))
end
for _, stats_key in ipairs(stats_order) do
  add_stats(stats_key, stats[stats_key])  -- each holds at least the item that created it
end
-- one wakeup per channel that someone listens to, after every write: "<newest seq>:<first
-- enqueue time>:<epoch>" (relay/storage/wakeups.py; the time measures wake latency), followed,
-- when its messages may be carried, by each message: "\n<seq>:<time>:<len messageId>:<len
-- payload>\n<messageId><payload>". Nobody listening: no PUBLISH (and subscribers 0).
if #wake_order > 0 then
  local listening = redis.call('PUBSUB', 'NUMSUB', unpack(wake_order))  -- {channel, n, ...}
  for i, channel in ipairs(wake_order) do
    if listening[2 * i] > 0 then
      local w = wakes[channel]
      local head = w[1] .. ':' .. w[2] .. ':' .. w[4]
      local carried = w[5]
      local text = head
      if carried then
        local parts = {head}
        for j = 1, #carried, 4 do
          local mid, payload = carried[j + 2], carried[j + 3]
          parts[#parts + 1] = fmt('\n%s:%s:%d:%d\n', carried[j], carried[j + 1], string.len(mid), string.len(payload))
          parts[#parts + 1] = mid
          parts[#parts + 1] = payload
        end
        text = table.concat(parts)
      end
      local subs = redis.call('PUBLISH', channel, text)
      for _, reply in ipairs(w[3]) do reply[3] = subs end
    end
  end
end
return replies
