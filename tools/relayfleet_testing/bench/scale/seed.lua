-- seed: the retention phase's messages written as enqueue.lua leaves them (relay/storage/lua/
-- enqueue.lua: stream entry '<seq>-0' with p, t, m, n; the first entry's stream copied into
-- place; meta seq, bytes, epoch, w; the slot index entry; the slot's msgs and bytes statistics),
-- a queue's messages in one loop: seeding 10,000,000 messages through enqueue.lua (one rate
-- check, meta read and write, statistics and wakeup per message) took over an hour on the
-- shared machine. Nothing else: no relay run mark ('r': no relay ran), no idempotency keys,
-- no rate sorted set (a seeded queue's enqueues are hours apart: each alone in its window),
-- no per-minute counters (the planner's, not retention's). tests/tools/test_bench_scale.py
-- checks the keys against enqueue.lua's.
-- Per queue i, 4 keys from k = 4 * (i - 1): meta, msgs, slot index, slot statistics
-- and 4 arguments from a = 1 + 4 * (i - 1): queue id, first message's time (ms), step (ms),
-- message count
-- ARGV[1] payload (every message's)
local payload = ARGV[1]
local size = string.len(payload)
local size_s = string.format('%d', size)
for i = 1, #KEYS / 4 do
  local k, a = 4 * (i - 1), 1 + 4 * (i - 1)
  local meta_key, msgs_key, index_key, stats_key = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local qid, start, step, n = ARGV[a + 1], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  for seq = 1, n do
    redis.call('XADD', msgs_key, string.format('%d-0', seq), 'p', payload,
      't', string.format('%d', start + (seq - 1) * step), 'm', '', 'n', size_s)
    if seq == 1 and size < 4096 then
      redis.call('COPY', msgs_key, msgs_key .. ':compact', 'REPLACE')
      redis.call('RENAME', msgs_key .. ':compact', msgs_key)
    end
  end
  local held, seq_s = string.format('%d', n * size), string.format('%d', n)
  local token = string.sub(redis.sha1hex('seed:' .. qid), 1, 16)
  -- 'w': the rate window of the last enqueue, alone in its window ("<time>:<seq>:<token>")
  redis.call('HSET', meta_key, 'seq', seq_s, 'bytes', held, 'epoch', token,
    'w', string.format('%d', start + (n - 1) * step) .. ':' .. seq_s .. ':' .. token)
  redis.call('SADD', index_key, qid)
  redis.call('HINCRBY', stats_key, 'msgs', n)
  redis.call('HINCRBY', stats_key, 'bytes', held)
end
return #KEYS / 4
