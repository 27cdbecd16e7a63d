--[[ tq_begin: a TransferQueue put or clear of several steps announces itself, unless a checkpoint is being
taken or loaded (the adapter broker.transfer_queue: kv_batch_put, put, kv_clear, clear_samples,
clear_partition).

A put looks its rows up, writes its fields, then its tags; a clear empties its rows in the dock, then frees
them: a checkpoint taken between two steps would hold keys listed without data, data without its tags, or
rows cleared but still listed. So such a write registers here first and unregisters when done (ZREM); a
checkpoint registers in td:{NAME}:tq:saving and waits until no write is registered (tq_settled.lua) before it
copies the keys, and a write that would begin meanwhile waits for the checkpoint. A write whose process
dies stays registered only until its deadline.

KEYS[1]     td:{NAME}:tq:saving     checkpoint id -> when it is given up (ms of server time), a sorted set
KEYS[2]     td:{NAME}:tq:writing    write id -> when it is given up (ms), a sorted set
ARGV[1]     the write's id
ARGV[2]     how long the write may take, ms

Returns 1 (registered), or 0 (a checkpoint is under way: nothing registered; begin again shortly).
]]
-- @include bits
-- @include leases

local bad = wrong_type(1, 2, 'zset')
if bad then return redis.error_reply(bad) end
local now = now_ms()
if redis.call('ZCOUNT', KEYS[1], '(' .. int_text(now), '+inf') > 0 then return 0 end
redis.call('ZADD', KEYS[2], int_text(now + tonumber(ARGV[2])), ARGV[1])
return 1
