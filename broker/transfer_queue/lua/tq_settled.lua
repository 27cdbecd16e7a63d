--[[ tq_settled: a TransferQueue checkpoint holds new puts and clears off and counts those still under way
(the adapter broker.transfer_queue: save_checkpoint, load_checkpoint; see tq_begin.lua).

The checkpoint registers (or renews) itself, which makes every write that begins from now on wait; writes
past their deadline (their process died) are dropped. The checkpoint calls this until it returns 0, then
copies or replaces the system's keys, then unregisters (ZREM): no write is half done in what it copies,
and none lands half on what it restores.

KEYS[1]     td:{NAME}:tq:saving     checkpoint id -> when it is given up (ms of server time), a sorted set
KEYS[2]     td:{NAME}:tq:writing    write id -> when it is given up (ms), a sorted set
ARGV[1]     the checkpoint's id
ARGV[2]     how long the checkpoint may hold writes off from now, ms

Returns how many writes are under way.
]]
-- @include bits
-- @include leases

local bad = wrong_type(1, 2, 'zset')
if bad then return redis.error_reply(bad) end
local now = now_ms()
redis.call('ZADD', KEYS[1], int_text(now + tonumber(ARGV[2])), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', int_text(now))
return redis.call('ZCARD', KEYS[2])
