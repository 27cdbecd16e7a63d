--[[ unhold: the last step of a put that claim.lua held a lease for: give each row it moved its own
deadline back, whatever the put's outcome.

claim.lua moves the lease of the put's rows to the put's time bound (call_timeout, 30 s by default), so that
it cannot run out between the put's steps. Left there, a put that did not ack (ack=False), or that was
refused, kept the rows from a worker's dead lease for that long, not the lease's own (a second, say). A
row keeps the held deadline where the lease is no longer what claim.lua left: acked or given back since
(no deadline), taken by another token, or renewed to another deadline.

KEYS[1]     td:{NAME}:meta
KEYS[2]     td:{NAME}:tokens:CONSUMER    of the delivery's lease
KEYS[3]     td:{NAME}:leases:CONSUMER
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     the token of the delivery's lease
ARGV[3]     the deadline claim.lua held the rows to (ms of server time)
ARGV[4..]   row, deadline, row, deadline, ...: claim.lua's reply after its first value

Returns how many rows got their deadline back.
]]
-- @include bits
-- @include schema

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local bad = wrong_type(2, 2, 'hash') or wrong_type(3, 3, 'zset')
if bad then return redis.error_reply(bad) end
local held = tonumber(ARGV[3])
local back = 0
for i = 4, #ARGV - 1, 2 do
  local row = ARGV[i]
  local deadline = redis.call('ZSCORE', KEYS[3], row)
  if deadline and tonumber(deadline) == held and redis.call('HGET', KEYS[2], row) == ARGV[2] then
    redis.call('ZADD', KEYS[3], ARGV[i + 1], row)
    back = back + 1
  end
end
return back
