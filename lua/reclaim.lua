--[[ reclaim: give back a consumer's rows whose lease expired, and say how far the consumer is.

all_consumed calls this, so rows leased by a worker that died come back even when no sampling call
runs (a worker taking explicit rows never samples).

KEYS[1]     td:{NAME}:meta
KEYS[2]     td:{NAME}:consumed:CONSUMER
KEYS[3]     td:{NAME}:gtaken:CONSUMER
KEYS[4]     td:{NAME}:leases:CONSUMER
KEYS[5]     td:{NAME}:tokens:CONSUMER
KEYS[6]     td:{NAME}:redelivered:CONSUMER
KEYS[7]     td:{NAME}:gremnant:CONSUMER (see include/leases.lua)
ARGV[1]     the schema the client expects (see include/schema.lua)
ARGV[2]     n_samples_per_prompt
ARGV[3]     optional: "all" gives back every leased row, expired or not (the caller knows every holder is
            gone: a driver that restarted the consumer's whole worker group); acked rows are not leased, and
            stay handed out

Returns {rows handed to the consumer, rows of those still leased}.
]]
-- @include bits
-- @include schema
-- @include leases

local wrong_schema = schema_error(KEYS[1], ARGV[1])
if wrong_schema then return redis.error_reply(wrong_schema) end
local bad = wrong_type(2, 3, 'string') or wrong_type(4, 4, 'zset') or wrong_type(5, 5, 'hash')
  or wrong_type(6, 7, 'string')
if bad then return redis.error_reply(bad) end

-- Every lease's score is a time in ms: one past the largest a double holds exactly is after all of them.
local now = ARGV[3] == 'all' and 9007199254740992 or now_ms()
local _, corrupt = reclaim_expired(KEYS[2], KEYS[3], KEYS[7], KEYS[4], KEYS[5], KEYS[6], tonumber(ARGV[2]), now)
if corrupt then return redis.error_reply(corrupt) end
return {redis.call('BITCOUNT', KEYS[2]), redis.call('ZCARD', KEYS[4])}
