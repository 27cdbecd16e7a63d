--[[ ack: confirm that a consumer has finished with leased rows.

The rows leave the lease set and stay marked consumed. Only rows still in the lease set count: an
ack arriving after the lease expired and the rows were given back changes nothing (the rows are
redone, which at-least-once delivery allows), and neither does a stale ack from before a clear,
which must not hide the rows written since. Repeating an ack is harmless.

KEYS[1]     td:{NAME}:leases:CONSUMER
ARGV[1..]   row indexes, decimal

Returns how many of the rows were still leased.
]]
-- @include bits

local bad = wrong_type(1, 1, 'zset')
if bad then return redis.error_reply(bad) end

local rows = {}
for i = 1, #ARGV do rows[i] = ARGV[i] end
return call_in_chunks('ZREM', KEYS[1], rows)
